"""The selection context: prices and ages projected to the planning start.

Selection scores every candidate at the time the plan would start: now, or the
queue's expected end.  This module copies each runnable request's dual rates,
advances the copies through every queued frame (its estimated duration, its
lanes' expected service, every other participant starved), measures output ages
from the projected last delivery, and builds the lane views the candidate
builders consume.  Stored state never changes here.
"""

from __future__ import annotations

from runtime.catalog import GraphKind
from runtime.coordinator.config import PolicyConfig
from runtime.coordinator.cost import CostCatalog
from runtime.coordinator.plan import LaneWork
from runtime.coordinator.policy import LaneView, SelectionContext
from runtime.coordinator.queue import ExecutionQueue
from runtime.coordinator.requests import Request
from runtime.coordinator.service import (
    FALLBACK_NORMALIZER,
    Normalizers,
    catalog_normalizers,
    starting_rate,
    update_rate,
)
from runtime.coordinator.state_ops import StateViews, snapshot_sigma_ms
from runtime.coordinator.utility import decode_lane_value, reference_interval_ms
from runtime.coordinator.vision import WindowStore
from runtime.coordinator.vision_select import window_views
from runtime.image_spans import fit_chunk


class CatalogView:
    """Quantities derived from the measured catalog, cached per catalog version."""

    def __init__(self, catalog: CostCatalog) -> None:
        self.catalog = catalog
        self._norms: tuple[int, Normalizers] | None = None
        self._family: tuple[int, list[tuple[float, int]]] | None = None
        self._sigma: dict[int, float] = {}  # streams -> sigma, for the family's version

    def normalizers(self) -> Normalizers:
        cache = self._norms
        if cache is None or cache[0] != self.catalog.version:
            cache = (self.catalog.version, catalog_normalizers(self.catalog))
            self._norms = cache
        return cache[1]

    def decode_sigma_ms(self, streams: int) -> float:
        """The decode family's reference interval for ``streams`` streams (k = K).

        The family is every measured graph that can serve a decode-only
        population: ordinary decode, and mixed shapes (their B rows all decode
        when no prompt row rides along).  Per batch capacity only the fastest
        graph can minimize T / min(B, k), so the family keeps that one.
        """
        version = self.catalog.version
        if self._family is None or self._family[0] != version:
            fastest: dict[int, float] = {}
            for kind in (GraphKind.DECODE, GraphKind.MIXED):
                for e in self.catalog.entries(kind):
                    if e.known:
                        b, t_ms = e.descriptor.batch_capacity, e.estimate_ns / 1e6
                        if t_ms < fastest.get(b, float("inf")):
                            fastest[b] = t_ms
            self._family = (version, [(t, b) for b, t in fastest.items()])
            self._sigma = {}
        sigma = self._sigma.get(streams)
        if sigma is None:
            sigma = self._sigma[streams] = reference_interval_ms(self._family[1], streams, streams)
        return sigma


def _project_queue(state: dict[int, list], queue: ExecutionQueue, tau: float) -> None:
    """Advance copies of (x, z, last delivery) through every queued frame."""
    for frame in queue.frames:
        dt_ms = frame.plan.estimated_duration_ns / 1e6
        norms = frame.normalizers
        tref = norms.tokens or FALLBACK_NORMALIZER
        dref = norms.deliveries or FALLBACK_NORMALIZER
        served: dict[int, LaneWork] = {lane.handle.id: lane for lane in frame.plan.lanes}
        for p in frame.participants:
            s = state.get(p.request.handle.id)
            if s is None:
                continue
            lane = served.get(p.request.handle.id)
            tokens = lane.expected_tokens if lane else 0.0
            prompt = lane.prompt_tokens if lane else 0
            s[0] = update_rate(s[0], tref, dt_ms, tokens, tau, prompt, norms.prefill_tokens)
            if p.decoding and p.request.delivery_rate is not None:
                deliveries = lane.expected_deliveries if lane else 0.0
                s[1] = update_rate(s[1], dref, dt_ms, deliveries, tau)
            if lane is not None and lane.expected_deliveries > 0:
                s[2] = frame.expected_end_ns


def build_context(
    now_ns: int,
    runnable: list[Request],
    queue: ExecutionQueue,
    policy: PolicyConfig,
    catalog: CostCatalog,
    view: CatalogView,
    page_size: int = 0,
    terminal: list[Request] | None = None,
    restoring: list[Request] | None = None,
    windowing: list[Request] | None = None,
    window_store: WindowStore | None = None,
) -> SelectionContext | None:
    """The selection context of ``runnable`` at the planning start.  With
    ``page_size``, each lane's work is capped by the KV pages it holds (a
    prefill chunk, a decode round's rows); a lane whose pages hold nothing more
    is left out (the residency preempts for it).  ``terminal``: requests awaiting
    their terminal snapshot (oldest first); ``restoring``: resumed requests
    awaiting their restore; both go to ``ctx.states`` (runtime.coordinator.state_ops)."""
    terminal = terminal or []
    restoring = restoring or []
    windowing = windowing or []
    if not (runnable or terminal or restoring or windowing):
        return None
    start = queue.expected_end_ns(now_ns)
    c = policy.decode_age_price
    beta = policy.output_token_value
    state = _projected_state(runnable, [*restoring, *windowing], queue, policy, view, start)
    n_decoders = sum(1 for r in runnable if r.consumed_prompt >= r.prefill_target)
    slope = c * view.decode_sigma_ms(n_decoders) if n_decoders else 0.0
    imaged: list[LaneView] = []
    vision_rows: list[LaneView] = []
    prefill, decode, scored = _lane_views(
        runnable, state, policy, page_size, start, slope, (imaged, vision_rows)
    )
    ctx = SelectionContext(
        now_ns=now_ns,
        start_ns=start,
        beta=beta,
        ttl_ns=catalog.ttl_ns,
        catalog=catalog,
        prefill=prefill,
        decode=decode,
        decode_age_slope=slope,
        active_age_price=c * n_decoders + policy.terminal_age_price * len(terminal),
        scored=scored,
        imaged=imaged,
    )
    if window_store is not None and (vision_rows or windowing):
        views = [_window_view(r, state, policy) for r in windowing]
        ctx.vision = window_views(vision_rows, views, window_store, page_size)
    if terminal or restoring:
        ctx.states = _state_views(ctx, state, terminal, restoring, policy, slope, start)
    return ctx


def _projected_state(
    runnable: list[Request],
    restoring: list[Request],
    queue: ExecutionQueue,
    policy: PolicyConfig,
    view: CatalogView,
    start: int,
) -> dict[int, list]:
    """Each request's dual rates and last visible delivery ``[x, z, last_visible]``
    (a request with no history at its fair share), projected through the queue."""
    population = max(1, len(runnable))
    x0 = starting_rate(view.decode_sigma_ms(population), population)
    state: dict[int, list] = {}
    for r in (*runnable, *restoring):
        if r.last_visible_ns is not None:
            last_visible = r.last_visible_ns
        elif r.became_decoder_ns is not None:
            last_visible = r.became_decoder_ns
        else:
            last_visible = start
        x = x0 if r.token_rate is None else r.token_rate
        z = x0 if r.delivery_rate is None else r.delivery_rate
        state[r.handle.id] = [x, z, last_visible]
    _project_queue(state, queue, policy.adaptation_ms)
    return state


def _lane_views(
    runnable: list[Request],
    state: dict[int, list],
    policy: PolicyConfig,
    page_size: int,
    start: int,
    slope: float,
    images: tuple[list[LaneView], list[LaneView]],
) -> tuple[list[LaneView], list[LaneView], list[LaneView]]:
    """The prompt rows, decode lanes and scored prompt rows (RequestSpec.score_prompt)
    ``runnable`` may offer at ``start``; ``images`` receives the unscored prompt
    rows of requests with images and the rows with images still to encode."""
    f, g = policy.token_fairness, policy.delivery_fairness
    beta = policy.output_token_value
    prefill: list[LaneView] = []
    decode: list[LaneView] = []
    scored: list[LaneView] = []
    unbounded = 1 << 30
    for r in runnable:
        x, z, last_visible = state[r.handle.id]
        token_price = f / x
        held = len(r.pages) * page_size if page_size else unbounded
        pos = r.consumed_prompt
        if pos < r.prefill_target:
            if r.inflight_fences:
                continue  # one prefill chunk at a time; its completion is feedback
            available = min(r.prefill_available(pos), held - pos)
            if r.vision is not None:  # image spans atomic; rows awaiting vision kept
                available = fit_chunk(r.spec.images, pos, max(0, available))
                if available <= 0 and not r.vision.pending():
                    continue
            elif available <= 0:
                continue
            finish = beta + token_price
            if not r.spec.max_output_tokens:  # a scored prompt of no output: none to commit
                finish = 0.0
            elif r.committed_output:  # a resumed decoder: its final chunk is its next step
                age_ms = max(0, start - last_visible) / 1e6
                finish = decode_lane_value(1.0, 1.0, token_price, g / z, beta) + slope * age_ms
            row = _prompt_view(r, token_price, pos, available, finish)
            if r.vision is not None:
                if r.vision.pending():
                    images[1].append(row)
                if available <= 0:
                    continue
            rows = scored if r.spec.score_prompt else (prefill if r.vision is None else images[0])
            rows.append(row)
            continue
        spec = r.spec
        inflight = r.inflight_output
        if r.inflight_fences and (
            spec.step_feedback or spec.max_output_tokens - r.committed_output - inflight < 1
        ):
            continue  # needs the in-flight completion first
        output = r.committed_output + inflight
        room = held - (spec.prompt_len + output - 1)
        if room <= 0:
            continue  # no page for its next token
        delivery_price = g / z
        age_ms = max(0, start - last_visible) / 1e6
        # decode_lane_value(1, 1, ...) + the age value, the same arithmetic inline
        value = (beta + token_price) + delivery_price + slope * age_ms
        decode.append(
            LaneView(
                r, token_price, delivery_price, spec.prompt_len, 0, 0, output, value,
                r.last_selected, 0, 0.0, room,
            )
        )  # fmt: skip
    return prefill, decode, scored


def _prompt_view(
    r: Request, token_price: float, pos: int, available: int, finish: float
) -> LaneView:
    """``r`` as a prompt row at ``pos`` taking up to ``available`` tokens; its final
    chunk's output token is worth ``finish``."""
    return LaneView(
        r,
        token_price,
        0.0,
        pos,
        available,
        min(r.distance_to_endpoint(pos), available),
        r.committed_output,
        0.0,
        r.last_selected,
        r.history_end,
        finish,
    )


def _state_views(
    ctx: SelectionContext,
    state: dict[int, list],
    terminal: list[Request],
    restoring: list[Request],
    policy: PolicyConfig,
    slope: float,
    start: int,
) -> StateViews:
    """Terminal lanes with their ages; resumed requests as the lanes their restore
    makes ready: a decoder when only the pending token is left to feed, else a
    prompt row at the restored position."""
    f, g, beta = policy.token_fairness, policy.delivery_fairness, policy.output_token_value
    ages = []
    for r in terminal:
        since = r.terminal_since_ns if r.terminal_since_ns is not None else start
        view = LaneView(r, 0.0, 0.0, r.consumed_prompt, 0, 0, r.committed_output, 0.0,
                        r.last_selected)  # fmt: skip
        ages.append((view, max(0, start - since) / 1e6))
    decode_ready: list[LaneView] = []
    prompt_ready: list[LaneView] = []
    for r in restoring:
        x, z, last_visible = state[r.handle.id]
        token_price, delivery_price = f / x, g / z
        age_ms = max(0, start - last_visible) / 1e6
        value = decode_lane_value(1.0, 1.0, token_price, delivery_price, beta) + slope * age_ms
        pos = r.consumed_prompt
        if pos == r.prefill_target - 1:
            decode_ready.append(
                LaneView(
                    r,
                    token_price,
                    delivery_price,
                    r.spec.prompt_len,
                    0,
                    0,
                    r.committed_output,
                    value,
                    r.last_selected,
                )
            )
        else:
            available = r.prefill_available(pos)
            if r.vision is not None:  # its reach once its window's images are encoded
                available = fit_chunk(r.spec.images, pos, r.prefill_reach(pos))
            prompt_ready.append(_prompt_view(r, token_price, pos, available, value))
    return StateViews(ages, decode_ready, prompt_ready, snapshot_sigma_ms(ctx, len(terminal)))


def _window_view(r: Request, state: dict[int, list], policy: PolicyConfig) -> LaneView:
    """A request between two image windows, as the prompt row its next window
    makes ready (its price now; ``available`` is filled by the window views)."""
    x = state[r.handle.id][0]
    token_price = policy.token_fairness / x
    finish = policy.output_token_value + token_price if r.spec.max_output_tokens else 0.0
    return _prompt_view(r, token_price, r.consumed_prompt, 0, finish)
