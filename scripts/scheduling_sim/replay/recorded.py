"""A recorded deployment, read back from its trace for a what-if replay.

:func:`read_recording` reads ``FILE`` (and its rotated files, oldest first) with
:func:`runtime.trace.files.read_trace` and keeps, per request with a request
line: its arrival (``submitted_ns``, the frontend's submission as the
coordinator saw it), prompt length, message endpoints and boundaries, prompt
page digests, max tokens, and from its finish line the output it produced,
its finish reason and whether it was cancelled; and from the frame lines when
the deployment published its tokens (each frame that committed some, as
applied) and, with snapshot programs, when its response completed (its
terminal lane's frame).  Also the catalog (the start line's programs, and
every graph a frame names), and the scheduler's configuration and policy
(the scheduler line, format 2).

A request is not replayed, and is named in :attr:`Recording.skipped` with why,
when it produced no output and was not cancelled (the trace closed or was cut
before its first token), or when its frames name it but its request line is
gone (a rotated-away file).
A trace written before format 2 lacks what the replay needs:
:class:`RecordingError` names the missing lines and fields.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from runtime.catalog import GraphDescriptor
from runtime.trace.files import Trace, read_trace
from scripts.scheduling_sim.replay.costs import frame_descriptor, parse_program

# What a request line must hold for a replay (format 2 added all but the first six).
REQUEST_FIELDS = (
    "request", "submitted_ns", "admitted_ns", "prompt_tokens", "max_tokens", "fence",
    "message_endpoints", "boundaries", "prompt_pages", "prompt_tail",
)  # fmt: skip
FINISH_FIELDS = ("request", "output_tokens", "finish_reason", "cancelled", "at_ns")
FRAME_FIELDS = ("fence", "graph", "device_ns", "plan_ns", "sent_ns", "applied_ns", "lanes",
                "ranks")  # fmt: skip


class RecordingError(ValueError):
    """The trace cannot be replayed; the message names the file and what is missing."""


@dataclass
class RecordedRequest:
    request: int  # the scheduler's id in the recorded deployment
    submitted_ns: int  # coordinator clock
    admitted_ns: int
    prompt_len: int
    max_tokens: int
    message_endpoints: tuple[int, ...]
    boundaries: tuple[int, ...]
    prompt_pages: tuple[str, ...]
    prompt_tail: str | None
    output_tokens: int = 0
    finish_reason: str = "unfinished"
    cancelled: bool = False
    finish_ns: int | None = None  # the finish line's time (None: unfinished)
    publications_ns: list[int] = field(default_factory=list)  # frames that committed tokens
    counted_tokens: int = 0  # tokens of those frames (the output when no finish line says)
    terminal_ns: int | None = None  # its terminal snapshot's frame, applied

    @property
    def finished_ns(self) -> int | None:
        """When its response completed as the deployment saw it: its terminal
        snapshot applied, else its finish (None when it never finished)."""
        if self.finish_reason == "unfinished":
            return None
        return self.terminal_ns if self.terminal_ns is not None else self.finish_ns


@dataclass
class Recording:
    path: str
    trace: Trace
    requests: list[RecordedRequest]  # replayed, by submission
    skipped: dict[int, str]  # request id -> why it is not replayed
    catalog: list[GraphDescriptor]
    scheduler: dict  # the scheduler line's fields (class, config, policy, preset)

    @property
    def t0_ns(self) -> int:
        """The first replayed request's submission: time zero of the replay."""
        return self.requests[0].submitted_ns

    @property
    def frames(self) -> list[dict]:
        return self.trace.frames


def read_recording(path: str) -> Recording:
    """``path`` read for a replay (see the module docstring); RecordingError if it cannot be."""
    trace = read_trace(path)
    _check_format(path, trace)
    finishes = {line["request"]: line for line in trace.finishes}
    requests: dict[int, RecordedRequest] = {}
    for line in sorted(trace.requests, key=lambda r: (r["submitted_ns"], r["request"])):
        r = RecordedRequest(
            line["request"], line["submitted_ns"], line["admitted_ns"], line["prompt_tokens"],
            line["max_tokens"], tuple(line["message_endpoints"]), tuple(line["boundaries"]),
            tuple(line["prompt_pages"]), line["prompt_tail"],
        )  # fmt: skip
        end = finishes.get(r.request)
        if end is not None:
            r.output_tokens, r.finish_reason = end["output_tokens"], end["finish_reason"]
            r.cancelled, r.finish_ns = bool(end["cancelled"]), end["at_ns"]
        requests[r.request] = r
    skipped = _publications(trace, requests)
    for r in list(requests.values()):
        if r.output_tokens < 1 and not r.cancelled:
            skipped[r.request] = f"produced no output ({r.finish_reason})"
            del requests[r.request]
    if not requests:
        raise RecordingError(f"{path}: no request to replay ({_why(skipped)})")
    return Recording(path, trace, list(requests.values()), skipped, _catalog(trace),
                     dict(trace.scheduler or {}))  # fmt: skip


def _check_format(path: str, trace: Trace) -> None:
    version = trace.start.get("v", 1) if trace.start else 1
    missing = []
    if not trace.requests:
        missing.append("request lines")
    else:
        absent = [f for f in REQUEST_FIELDS if any(f not in r for r in trace.requests)]
        if absent:
            missing.append("request lines' " + ", ".join(absent))
    if not trace.finishes and version < 2:  # format 2 cut short (killed) may have none yet
        missing.append("finish lines (output length, finish reason, cancellation)")
    elif any(f not in line for line in trace.finishes for f in FINISH_FIELDS):
        missing.append("finish lines' " + ", ".join(FINISH_FIELDS))
    if not trace.frames:
        missing.append("frame lines")
    elif any(f not in frame for frame in trace.frames for f in FRAME_FIELDS):
        missing.append("frame lines' " + ", ".join(FRAME_FIELDS))
    if missing:
        raise RecordingError(
            f"{path}: cannot replay a trace of format {version} without "
            + "; ".join(missing)
            + " (format 2 records them: trace the deployment again with this flare)"
        )


def _publications(trace: Trace, requests: dict[int, RecordedRequest]) -> dict[int, str]:
    """Each request's token frames (up to its finish) and terminal frame, as applied;
    requests the frames name without a request line, as skipped."""
    skipped: dict[int, str] = {}
    for frame in trace.frames:
        lanes = frame["lanes"]
        for request, phase, count in zip(lanes["request"], lanes["phase"], lanes["token_count"]):
            r = requests.get(request)
            if r is None:
                skipped.setdefault(request, "no request line (its file rotated away?)")
            elif phase == "terminal":
                r.terminal_ns = frame["applied_ns"]
            elif count and (r.finish_ns is None or frame["applied_ns"] <= r.finish_ns):
                r.publications_ns.append(frame["applied_ns"])
                r.counted_tokens += count
    for r in requests.values():
        if r.finish_ns is None:  # no finish line: the trace was cut (a killed process)
            r.output_tokens = r.counted_tokens
    return skipped


def _catalog(trace: Trace) -> list[GraphDescriptor]:
    """The start line's programs, then any other graph a frame ran (a trace cut short)."""
    catalog = [parse_program(name) for name in trace.start.get("programs", ())]
    seen = set(catalog)
    for frame in trace.frames:
        desc = frame_descriptor(frame)
        if desc not in seen:
            seen.add(desc)
            catalog.append(desc)
    return catalog


def _why(skipped: dict[int, str]) -> str:
    reasons: dict[str, int] = {}
    for why in skipped.values():
        reasons[why] = reasons.get(why, 0) + 1
    return "; ".join(f"{n} {why}" for why, n in reasons.items()) or "none admitted"
