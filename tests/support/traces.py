"""Synthetic live-plan traces (format 2) for the trace readers and the what-if replay.

:class:`TraceBuilder` writes what ``flare run --trace`` would: a start line, a
scheduler line, request lines, frame lines with one rank's timestamps, finish
lines and an end line.  Times are in nanoseconds on one clock; a frame's device
starts ``LAUNCH_NS`` after it is sent and is applied ``COMPLETION_NS`` after
its device ends.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from runtime.catalog import GraphDescriptor, GraphKind

LAUNCH_NS = 200_000
COMPLETION_NS = 300_000
PROGRAMS = ["prefill B=1 C=64", "prefill B=1 C=128", "decode B=1", "decode B=2", "snapshot B=1"]
BALANCED = {
    "output_token_value": 64.0,
    "token_fairness": 16.0,
    "delivery_fairness": 4.0,
    "decode_age_price": 0.1,
    "terminal_value": 256.0,
    "terminal_age_price": 1.0,
    "adaptation_ms": 100.0,
    "estimate_ttl_ns": 30_000_000_000,
    "adaptive_verification_alpha": 1.0,
}


def graph(name: str) -> GraphDescriptor:
    words = name.split()
    extents = dict(w.split("=") for w in words[1:])
    return GraphDescriptor(
        GraphKind(words[0]), int(extents["B"]), prompt_capacity=int(extents.get("C", 0))
    )


@dataclass
class TraceBuilder:
    """Lines of one trace; :meth:`write` puts them in a file."""

    now_ns: int = 1_000_000_000
    fence: int = 0
    lines: list[dict] = field(default_factory=list)
    version: int = 2

    def __post_init__(self) -> None:
        self.lines.append(
            {
                "event": "start",
                "v": self.version,
                "file_index": 0,
                "model": "tiny",
                "world_size": 1,
                "programs": list(PROGRAMS),
            }
        )

    def scheduler(self, max_slots: int = 4, policy: dict | None = None) -> None:
        config = {"max_slots": max_slots, "page_size": 16, "num_pages": 256}
        self.lines.append(
            {
                "event": "scheduler",
                "fence": self.fence + 1,
                "scheduler": "Scheduler",
                "config": config,
                "policy": policy or dict(BALANCED),
                "preset": "balanced",
            }
        )

    def request(self, request: int, prompt: int, max_tokens: int, at_ns: int, **extra) -> None:
        line = {
            "event": "request",
            "fence": self.fence + 1,
            "request": request,
            "submitted_ns": at_ns,
            "admitted_ns": at_ns + 50_000,
            "prompt_tokens": prompt,
            "max_tokens": max_tokens,
            "message_endpoints": [],
            "boundaries": [],
            "ignore_eos": True,
            "group": None,
            "prompt_pages": [],
            "prompt_tail": None,
        }
        line.update(extra)
        self.lines.append(line)

    def frame(
        self, name: str, lanes: list[tuple[int, str, int]], device_ns: int, at_ns: int | None = None
    ) -> dict:
        """A frame of graph ``name`` sent at ``at_ns`` (default: now); ``lanes``:
        (request, phase, tokens committed).  Advances now to its application."""
        self.fence += 1
        sent = self.now_ns if at_ns is None else at_ns
        start = sent + LAUNCH_NS
        end = start + device_ns
        applied = end + COMPLETION_NS
        desc = graph(name)
        line = {
            "event": "frame",
            "fence": self.fence,
            "graph": name,
            "kind": desc.kind.value,
            "batch_capacity": desc.batch_capacity,
            "token_capacity": 1,
            "proposal_depth": 0,
            "target_capacity": desc.target_capacity,
            "prompt_capacity": desc.prompt_capacity,
            "reason": "ordinary",
            "queued": False,
            "plan_ns": sent,
            "sent_ns": sent,
            "applied_ns": applied,
            "device_ns": device_ns,
            "skew_ns": 0,
            "lanes": {
                "request": [r for r, _, _ in lanes],
                "phase": [p for _, p, _ in lanes],
                "token_count": [n for _, _, n in lanes],
                "finished": [0] * len(lanes),
                "tokens": [7] * sum(n for _, _, n in lanes),
            },
            "ranks": [
                {
                    "rank": 0,
                    "device_ns": device_ns,
                    "readiness_delay_ns": 0,
                    "launch_wait_ns": 0,
                    "host_times": [sent + 50_000, start, end, end + 10],
                    "stage_ns": [],
                    "arrived_ns": applied - 10,
                    "clock_offset_ns": 0,
                    "clock_error_ns": 0,
                    "clock_samples": 1,
                    "clock_source": "x",
                }
            ],
        }
        self.lines.append(line)
        self.now_ns = applied
        return line

    def finish(self, request: int, tokens: int, reason: str = "length", at_ns: int = 0) -> None:
        self.lines.append(
            {
                "event": "finish",
                "fence": self.fence,
                "request": request,
                "output_tokens": tokens,
                "finish_reason": reason,
                "cancelled": reason == "cancelled",
                "at_ns": at_ns or self.now_ns,
            }
        )

    def write(self, path: Path, end: bool = True) -> str:
        lines = list(self.lines)
        if end:
            lines.append({"event": "end", "v": self.version, "frames": self.fence})
        path.write_text("".join(json.dumps(line) + "\n" for line in lines))
        return str(path)


def simple_trace(path: Path) -> str:
    """Two requests: 0 (70 prompt tokens, 3 output tokens, then a snapshot) and 1
    (20 prompt tokens, cancelled after 2 of 8)."""
    b = TraceBuilder()
    b.scheduler()
    b.request(0, 70, 3, b.now_ns)
    b.frame("prefill B=1 C=128", [(0, "prefill", 1)], 10_000_000)
    b.request(1, 20, 8, b.now_ns)
    b.frame("prefill B=1 C=64", [(1, "prefill", 1)], 6_000_000)
    b.frame("decode B=2", [(0, "decode", 1), (1, "decode", 1)], 3_000_000)
    b.finish(1, 2, "cancelled", at_ns=b.now_ns + 1000)
    b.frame("decode B=2", [(0, "decode", 1), (1, "decode", 1)], 3_000_000)
    b.finish(0, 3)
    b.frame("snapshot B=1", [(0, "terminal", 0)], 20_000)
    return b.write(path)
