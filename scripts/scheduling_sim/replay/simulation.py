"""The replay itself: a recorded deployment's traffic, on its costs and host, under a scheduler.

* **Arrivals.**  One per replayed request, in submission order, at its
  submission time less the first request's; it is admitted after the host
  model's admission delay (in order, as the engine admits), and its TTFT
  counts from its submission.  It asks for the output it produced
  (``max_output_tokens`` = its recorded output length, so the replay generates
  the same amount), with its message endpoints and boundaries, and prompt
  token ids rebuilt from its page digests (:func:`prompt_tokens`): requests
  whose recorded prompts shared cached pages share them here, and no others.
* **Cancellations.**  A cancelled request stops at its recorded output
  length the way it stopped in the deployment: it keeps its recorded
  ``max_tokens``, and once it has produced its recorded output it is
  cancelled (``Scheduler.cancel``) as long after its last token as the
  recorded cancel came after it (after its submission when it had none).  So
  it holds its slot, and rides in the frames planned meanwhile, as it did;
  should the replay give it tokens in that delay, it keeps them.  The
  baselines cannot cancel: under them it asks for its recorded output and
  finishes there.
* **Scheduler.**  ``flare`` is the production :class:`Scheduler` with the
  recorded ``SchedulerConfig`` (slots, pages, prefix caching) over the
  recorded catalog, under the recorded policy or ``policy``; a baseline gets
  the recorded slot count over the catalog without packed prefill and state
  programs (it runs neither), and the baselines' shared prefix cache model
  when the recording had prefix caching on.
* **Device and host.**  :class:`ReplaySimulation` charges each frame its
  measured cost (:mod:`.costs`) as the host model runs it (:mod:`.host`).
"""

from __future__ import annotations

import heapq
import itertools
import random
from collections.abc import Sequence
from dataclasses import dataclass

from runtime.catalog import GraphDescriptor, GraphKind
from runtime.coordinator.config import PolicyConfig, SchedulerConfig
from runtime.coordinator.requests import RequestSpec
from runtime.coordinator.scheduler import Scheduler
from scripts.scheduling_sim.baselines import make_baseline
from scripts.scheduling_sim.engine import InFlight, Simulation
from scripts.scheduling_sim.replay.costs import MeasuredCosts
from scripts.scheduling_sim.replay.host import HostModel
from scripts.scheduling_sim.replay.recorded import RecordedRequest, Recording, RecordingError
from scripts.scheduling_sim.workload import Arrival

DEFAULT_PAGE_SIZE = 16  # runtime.coordinator.engine.trace's, when the trace states none
TOKEN_RANGE = 1 << 20  # rebuilt prompt token ids lie in [1, TOKEN_RANGE)
STATE_KINDS = (GraphKind.SNAPSHOT, GraphKind.RESTORE)


def _ids(seed: str, count: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, TOKEN_RANGE) for _ in range(count)]


def prompt_tokens(r: RecordedRequest, page_size: int) -> tuple[int, ...]:
    """Prompt ids with the recorded sharing: each full page's ids drawn from its
    chained digest (equal digests, equal pages), the partial last page's from its
    own digest, anything the digests do not cover from the request's id."""
    tokens: list[int] = []
    for digest in r.prompt_pages:
        tokens += _ids(digest, page_size)
    rest = r.prompt_len - len(tokens)
    if rest > 0:
        tokens += _ids(r.prompt_tail or f"request {r.request}", rest)
    return tuple(tokens[: r.prompt_len])


def page_size(recording: Recording) -> int:
    config = recording.scheduler.get("config") or {}
    return int(config.get("page_size") or DEFAULT_PAGE_SIZE)


@dataclass
class Traffic:
    """The replay's requests: ``arrivals`` at their admission times, in order; each
    one's ``submitted`` time (both relative to the first submission); ``cancels``:
    by arrival index, (output tokens, ns after the last of them) of a cancel."""

    arrivals: list[Arrival]
    submitted: list[int]
    cancels: dict[int, tuple[int, int]]


def _cancel(r: RecordedRequest) -> tuple[int, int] | None:
    if not r.cancelled or r.finish_ns is None:
        return None
    last = r.publications_ns[-1] if r.publications_ns else r.submitted_ns
    return r.output_tokens, max(0, r.finish_ns - last)


def traffic(recording: Recording, host: HostModel, cancellable: bool = True) -> Traffic:
    """The recorded requests as the replay's traffic (see the module docstring);
    not ``cancellable`` (a baseline, which cannot cancel): a cancelled request
    asks for its recorded output length and finishes there."""
    t0, admitted = recording.t0_ns, 0
    size = page_size(recording)
    out = Traffic([], [], {})
    for index, r in enumerate(recording.requests):
        at = r.submitted_ns - t0
        admitted = max(admitted, at + host.admission_ns(at))
        cancel = _cancel(r) if cancellable else None
        if cancel is not None:
            out.cancels[index] = cancel
        spec = RequestSpec(
            r.prompt_len, r.max_tokens if cancel else r.output_tokens, boundaries=r.boundaries,
            message_endpoints=r.message_endpoints, prompt_tokens=prompt_tokens(r, size),
        )  # fmt: skip
        out.arrivals.append(Arrival(admitted, spec))
        out.submitted.append(at)
    return out


def policy_for(recording: Recording, name: str | None) -> tuple[PolicyConfig, str]:
    """``name``'s preset, else the recorded policy; and how the report names it."""
    if name is not None:
        return PolicyConfig.preset(name), name
    recorded = recording.scheduler.get("policy")
    if not recorded:
        raise RecordingError(f"{recording.path}: the trace records no policy: pass --policy")
    fields = {k: v for k, v in recorded.items() if k in PolicyConfig.__dataclass_fields__}
    preset = recording.scheduler.get("preset")
    return PolicyConfig(**fields), f"{preset or 'custom'} (recorded)"


def scheduler_config(recording: Recording) -> SchedulerConfig:
    """The recorded ``SchedulerConfig`` (unknown fields dropped); without one, the
    slots of the largest decode batch in the catalog."""
    recorded = recording.scheduler.get("config") or {}
    fields = {k: v for k, v in recorded.items() if k in SchedulerConfig.__dataclass_fields__}
    if "max_slots" not in fields:
        batches = [d.batch_capacity for d in recording.catalog if d.kind is GraphKind.DECODE]
        fields["max_slots"] = min(64, max(batches, default=64))
    return SchedulerConfig(**fields)


def baseline_catalog(catalog: Sequence[GraphDescriptor]) -> list[GraphDescriptor]:
    """What a baseline selects from: no packed prefill, no state programs."""
    return [
        d
        for d in catalog
        if d.kind not in STATE_KINDS and not (d.kind is GraphKind.PREFILL and d.batch_capacity > 1)
    ]


def make_replay_scheduler(name: str, recording: Recording, policy: PolicyConfig | None):
    """flare (under ``policy``) or the baseline ``name`` over the recorded catalog."""
    config = scheduler_config(recording)
    if name == "flare":
        return Scheduler(list(recording.catalog), config, policy or PolicyConfig())
    return make_baseline(
        name,
        baseline_catalog(recording.catalog),
        max_slots=config.max_slots,
        prefix_caching=config.enable_prefix_caching,
    )


class ReplaySimulation(Simulation):
    """:class:`Simulation` with a host model around the device (see :mod:`.host`),
    and the traffic's cancellations.

    The scheduler plans the host's plan delay after the events that prompt it
    (a completion, an admission, a cancel; a later one before that moment
    postpones it, as the engine takes every waiting event before it plans),
    and, after each frame it plans, again once the host has built and sent
    that frame; at no other time.  A frame dispatched while the device runs
    another starts the host's turnaround after that one ends; otherwise the
    host's launch time after its planning.  It runs for its measured cost as
    the host executes it, and its completion is seen the host's completion
    time after it ends (completions are still applied in fence order).  A
    request's stats count from its submission, not its admission; a cancelled
    one finishes at its cancel.
    """

    def __init__(
        self,
        scheduler,
        costs: MeasuredCosts,
        traffic: Traffic,
        host: HostModel,
        catalog: Sequence[GraphDescriptor],
        seed: int = 0,
    ) -> None:
        super().__init__(
            scheduler, costs.duration_ns, traffic.arrivals, host_delay_ns=0, seed=seed,
            catalog=catalog,
        )  # fmt: skip
        self.host = host
        self._submitted = traffic.submitted
        self._cancels = traffic.cancels
        self._watched: dict[int, tuple[int, int]] = {}  # handle id -> (tokens, delay)
        self._due: list[tuple[int, int]] = []  # (cancel time, handle id), a heap
        self._plan_at: int | None = None  # when the engine plans next
        self.graphs_run: set[GraphDescriptor] = set()
        self.sequence: list[str] = []  # the graphs run, in fence order

    def _event(self, command: bool = False) -> None:
        """Something the engine reacts to happened now (a completion; ``command``: an
        admission or a cancel): it plans the host's delay after the last such event."""
        at = self.now_ns + self.host.plan_ns(self.now_ns, command)
        pending = self._plan_at
        self._plan_at = at if pending is None or pending < self.now_ns else max(pending, at)

    def _dispatch(self) -> None:
        """Plan only at the planning moment the events set; after a frame, plan again
        once the host has built and sent it."""
        if self._plan_at is None or self._plan_at > self.now_ns:
            return
        self._plan_at = None
        plan = self.scheduler.plan()
        if plan is not None:
            self._launch(plan)
            self._plan_at = self.now_ns + self.host.build_ns(self.now_ns)

    def _admit_due(self) -> None:
        """Due cancels, then due admissions (each stats' arrival its submission)."""
        while self._due and self._due[0][0] <= self.now_ns:
            _, request = heapq.heappop(self._due)
            stats = self.requests[request]
            if stats.finished_ns is None:
                self.scheduler.cancel(stats.handle)
                stats.finished_ns = self.now_ns
                self._event(command=True)
        before = len(self.requests)
        super()._admit_due()
        new = len(self.requests) - before
        if not new:
            return
        self._event(command=True)
        latest = list(itertools.islice(reversed(self.requests.values()), new))[::-1]
        for index, stats in enumerate(latest, before):
            stats.arrival_ns = self._submitted[index]
            if index in self._cancels:
                self._watched[stats.handle.id] = self._cancels[index]
                self._watch(stats, stats.arrival_ns)

    def _watch(self, stats, reached_ns: int) -> None:
        """Schedule ``stats``'s cancel once it has its recorded output."""
        tokens, delay = self._watched[stats.handle.id]
        if stats.output_tokens >= tokens:
            del self._watched[stats.handle.id]
            heapq.heappush(self._due, (max(self.now_ns, reached_ns + delay), stats.handle.id))

    def _complete(self, frame: InFlight) -> None:
        super()._complete(frame)
        self._event()
        for request in [r for r in frame_requests(frame) if r in self._watched]:
            self._watch(self.requests[request], self.now_ns)

    def _timer_ns(self) -> int | None:
        times = [self._due[0][0]] if self._due else []
        if self._plan_at is not None:
            times.append(self._plan_at)
        return min(times, default=None)

    def _run_on_device(self, fence: int, plan) -> InFlight:
        host, now = self.host, self.now_ns
        if now < self.device_free_ns:
            start = self.device_free_ns + host.turnaround_ns(self.device_free_ns)
        else:
            start = now + host.launch_ns(now)
        end = host.execute(start, self.duration_ns(plan.graph))
        self.device_free_ns = end
        self.busy_ns += end - start
        self.graphs_run.add(plan.graph)
        self.sequence.append(plan.graph.describe())
        applied = end + host.completion_ns(end)
        return InFlight(fence, plan, now, applied, end - start, queued=bool(self.inflight))


def frame_requests(frame: InFlight) -> list[int]:
    """The request ids of a frame's lanes."""
    return [lane.handle.id for lane in frame.plan.lanes]
