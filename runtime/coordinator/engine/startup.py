"""Start-up: collect one catalog report per rank and check that they agree.

The ranks must agree with each other, and with what the coordinator knows
(:class:`~runtime.identity.ExpectedIdentity`: its own model directory, code
and protocol versions), on every field of :data:`AGREED_FIELDS`: protocol and
code version, the model's identity (digests of its config, tokenizer and
weights, the draft's), dtype, device type, the model's limits and the page
geometry, and on the catalog.  A mismatch fails start-up with one
:class:`EngineStartError` naming every field that differs and which parties
hold which value, e.g. ``start-up: ranks disagree on weights_digest: ranks 0-1
have 3f2a01c4b5d6..., rank 2 has 9c01...``.  ``model_name`` (the directory's
basename) is for display only: two copies of a model agree whatever their
directories are called.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from runtime.catalog import GraphDescriptor, GraphKind
from runtime.coordinator.engine.config import EngineStartError
from runtime.identity import ExpectedIdentity, is_digest
from runtime.transport.catalog_report import CatalogReport
from runtime.transport.coordinator_channel import CoordinatorChannel

log = logging.getLogger("runtime.coordinator.engine")

# Fields every rank must report identically, in the order they are named.
AGREED_FIELDS = (
    "protocol_version",
    "code_version",
    "config_digest",
    "tokenizer_digest",
    "weights_digest",
    "weights_full_digest",
    "draft_digest",
    "dtype",
    "device_type",
    "vocab_size",
    "max_context",
    "page_size",
    "num_pages",
    "kv_page_bytes",
    "vision_windows",
    "window_rows",
    "image_tokens",
)
# "" in these is "not computed" (no tokenizer files; no --verify-weights): not compared.
OPTIONAL_FIELDS = frozenset({"tokenizer_digest", "weights_full_digest"})
COORDINATOR = "the coordinator"
SHOWN_DIGEST_CHARS = 12


@dataclass(frozen=True)
class ModelFacts:
    """What the ranks agreed on: the catalog and the model's limits."""

    descriptors: tuple[GraphDescriptor, ...]
    vocab_size: int
    max_context: int
    page_size: int
    num_pages: int
    model_name: str
    dtype: str = ""
    device_type: str = ""
    code_version: str = ""
    config_digest: str = ""
    weights_digest: str = ""
    # The ranks' image-feature store (docs/vision.md): windows of window_rows
    # feature rows for images of image_tokens rows each; zeros: a text-only model.
    vision_windows: int = 0
    window_rows: int = 0
    image_tokens: int = 0

    @property
    def max_decode_batch(self) -> int:
        return max(d.batch_capacity for d in self.descriptors if d.kind is GraphKind.DECODE)


START_POLL_MS = 200  # how often the start-up waits look at ``abort``


def collect_reports(
    channel: CoordinatorChannel,
    world_size: int,
    timeout_s: float,
    abort: Callable[[], str | None] | None = None,
) -> dict[int, CatalogReport]:
    """One CatalogReport from every rank 0..world_size-1, or EngineStartError.

    ``abort``: looked at every :data:`START_POLL_MS`; a reason (a rank the
    heartbeats found gone) ends the wait at once with that reason."""
    reports: dict[int, CatalogReport] = {}
    deadline = time.monotonic() + timeout_s
    while len(reports) < world_size:
        why = abort() if abort is not None else None
        if why:
            missing = sorted(set(range(world_size)) - set(reports))
            raise EngineStartError(f"{why} while waiting for the catalog of rank(s) {missing}")
        remaining_ms = int((deadline - time.monotonic()) * 1000)
        wait_ms = min(remaining_ms, START_POLL_MS)
        message = channel.recv(timeout_ms=max(0, wait_ms)) if remaining_ms > 0 else None
        if message is None and remaining_ms > START_POLL_MS:
            continue
        if message is None:
            missing = sorted(set(range(world_size)) - set(reports))
            raise EngineStartError(
                f"no catalog report from rank(s) {missing} of {world_size} "
                f"within {timeout_s:g} s (catalog_timeout_s)"
            )
        if not isinstance(message, CatalogReport):
            log.warning("start-up: ignoring %s before the catalog", type(message).__name__)
            continue
        if message.rank in reports:
            log.warning(
                "start-up: rank %d reported its catalog twice; keeping the first", message.rank
            )
            continue
        reports[message.rank] = message
    return reports


def _names(descriptors: set[tuple], by_key: Mapping[tuple, GraphDescriptor]) -> str:
    return ", ".join(sorted(by_key[k].describe() for k in descriptors)) or "none"


def _show(value: object) -> str:
    if is_digest(value):
        return f"{value[:SHOWN_DIGEST_CHARS]}..."  # type: ignore[index]
    if value == "":
        return "none"
    return str(value)


def _ranks(ranks: list[int]) -> str:
    """[0, 1, 2, 5] -> "ranks 0-2, 5"; [3] -> "rank 3"."""
    runs: list[str] = []
    start = prev = ranks[0]
    for rank in [*ranks[1:], None]:
        if rank is not None and rank == prev + 1:
            prev = rank
            continue
        runs.append(str(start) if start == prev else f"{start}-{prev}")
        if rank is not None:
            start = prev = rank
    return f"rank {runs[0]}" if len(ranks) == 1 else "ranks " + ", ".join(runs)


def _holders(parties: list[int | str]) -> str:
    """The parties holding one value, e.g. "the coordinator and ranks 0-1 have"."""
    names = [p for p in parties if isinstance(p, str)]
    ranks = sorted(p for p in parties if isinstance(p, int))
    if ranks:
        names.append(_ranks(ranks))
    verb = "has" if len(names) == 1 and len(ranks) <= 1 else "have"
    return f"{' and '.join(names)} {verb}"


def disagreements(
    reports: Mapping[int, CatalogReport], expected: ExpectedIdentity | None = None
) -> list[tuple[str, str, bool]]:
    """(field, what each party holds, whether the coordinator holds a value) for
    every field of :data:`AGREED_FIELDS` on which the ranks (and the coordinator,
    with ``expected``) do not all agree."""
    theirs = expected.fields() if expected is not None else {}
    found = []
    for name in AGREED_FIELDS:
        groups: dict[object, list[int | str]] = {}
        if name in theirs:
            groups[theirs[name]] = [COORDINATOR]
        for rank in sorted(reports):
            value = getattr(reports[rank], name)
            if value == "" and name in OPTIONAL_FIELDS:
                continue
            groups.setdefault(value, []).append(rank)
        if len(groups) > 1:
            held = ", ".join(f"{_holders(parties)} {_show(v)}" for v, parties in groups.items())
            found.append((name, held, name in theirs))
    return found


def agree(
    reports: Mapping[int, CatalogReport], expected: ExpectedIdentity | None = None
) -> ModelFacts:
    """The ranks' common facts; EngineStartError naming every field that differs and
    which ranks (and "the coordinator", given ``expected``) hold which value."""
    if 0 not in reports:
        raise EngineStartError("no catalog report from rank 0")
    ref = reports[0]
    problems = []
    allowed = expected is not None and expected.allow_code_mismatch
    for name, held, coordinator in disagreements(reports, expected):
        if name == "code_version" and allowed:
            log.warning("start-up: different code versions (allowed): %s", held)
            continue
        parties = f"{COORDINATOR} and the ranks" if coordinator else "ranks"
        problems.append(f"{parties} disagree on {name}: {held}")
    ref_keys = {d.key: d for d in ref.descriptors}
    for rank in sorted(reports):
        keys = {d.key: d for d in reports[rank].descriptors}
        if rank != 0 and keys.keys() != ref_keys.keys():
            only_ref = set(ref_keys) - set(keys)
            only_here = set(keys) - set(ref_keys)
            problems.append(
                f"rank {rank} disagrees with rank 0 on descriptors: "
                f"only on rank 0: {_names(only_ref, ref_keys)}; "
                f"only on rank {rank}: {_names(only_here, keys)}"
            )
    if problems:
        raise EngineStartError("start-up: " + "; ".join(problems))
    names = {r.model_name for r in reports.values()}
    if len(names) > 1:
        log.info("start-up: the ranks name the model differently (%s)", ", ".join(sorted(names)))
    kinds = {d.kind for d in ref.descriptors}
    for needed in (GraphKind.PREFILL, GraphKind.DECODE):
        if needed not in kinds:
            raise EngineStartError(
                f"descriptors: the catalog has no {needed.value} program; the engine needs "
                "prefill and decode programs"
            )
    log.info(
        "start-up: %d rank(s) agree: %s %s on %s, config %s, weights %s, code %s",
        len(reports),
        ref.model_name,
        ref.dtype,
        ref.device_type,
        _show(ref.config_digest),
        _show(ref.weights_digest),
        ref.code_version,
    )
    return ModelFacts(
        descriptors=tuple(ref.descriptors),
        vocab_size=ref.vocab_size,
        max_context=ref.max_context,
        page_size=ref.page_size,
        num_pages=ref.num_pages,
        model_name=ref.model_name,
        dtype=ref.dtype,
        device_type=ref.device_type,
        code_version=ref.code_version,
        config_digest=ref.config_digest,
        weights_digest=ref.weights_digest,
        vision_windows=ref.vision_windows,
        window_rows=ref.window_rows,
        image_tokens=ref.image_tokens,
    )
