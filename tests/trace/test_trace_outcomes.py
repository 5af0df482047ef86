"""Each traced request's outcome (the writer thread's ledger) and its prompt digests,
and what the writer does with several lines per item and later files' headers."""

from __future__ import annotations

import json
from pathlib import Path

from runtime.trace.files import read_trace, trace_files
from runtime.trace.outcomes import RequestLedger, prompt_digests
from runtime.trace.writer import TraceOptions, TraceWriter


def lanes(*rows: tuple[int, str, int, int]) -> dict[str, list]:
    """(request, phase, tokens committed, eos) per lane, as a frame line's columns."""
    return {
        "request": [r[0] for r in rows],
        "phase": [r[1] for r in rows],
        "token_count": [r[2] for r in rows],
        "finished": [r[3] for r in rows],
    }


def ends(lines: list[dict]) -> list[tuple]:
    return [(x["request"], x["output_tokens"], x["finish_reason"], x["cancelled"]) for x in lines]


def test_a_request_ends_at_its_max_tokens_or_its_eos_as_the_scheduler_rules():
    ledger = RequestLedger()
    ledger.admitted(1, 3)
    ledger.admitted(2, 10)
    ledger.admitted(3, 10)
    assert ledger.frame(1, lanes((1, "prefill", 1, 0), (2, "prefill", 0, 0)), (), 100) == []
    # Request 2's eos is ignored (its lane's ignore_eos); request 3's is not.
    done = ledger.frame(
        2,
        lanes((1, "decode", 2, 0), (2, "decode", 1, 1), (3, "prefill", 1, 1)),
        (False, True, False),
        200,
    )
    assert ends(done) == [(1, 3, "length", False), (3, 1, "stop", False)]
    assert [(x["fence"], x["at_ns"]) for x in done] == [(2, 200), (2, 200)]
    # A frame applied after a request finished: its tokens are discarded.
    assert ledger.frame(3, lanes((1, "decode", 1, 0), (2, "decode", 1, 0)), (), 300) == []
    assert len(ledger) == 1


def test_restore_and_terminal_lanes_commit_nothing():
    ledger = RequestLedger()
    ledger.admitted(1, 1)
    assert ledger.frame(1, lanes((1, "restore", 1, 0), (1, "terminal", 1, 0)), (), 10) == []
    assert len(ledger) == 1


def test_a_cancel_ends_a_request_with_what_it_had_and_changes_nothing_after_its_end():
    ledger = RequestLedger()
    ledger.admitted(1, 8)
    ledger.admitted(2, 1)
    ledger.frame(1, lanes((1, "prefill", 1, 0), (2, "prefill", 1, 0)), (), 10)
    assert ends(ledger.cancelled(1, 2, 15)) == [(1, 1, "cancelled", True)]
    assert ledger.cancelled(2, 2, 16) == []  # finished already
    assert ledger.frame(2, lanes((1, "decode", 1, 0)), (), 20) == []  # discarded
    ledger.admitted(3, 4)
    assert ends(ledger.close(3, 30)) == [(3, 0, "unfinished", False)]
    assert len(ledger) == 0


def test_prompt_digests_chain_full_pages_and_name_the_tail():
    a = list(range(40))
    b = [*range(16), 99, *range(17, 40)]
    pages, tail = prompt_digests(a, 16)
    assert len(pages) == 2 and tail is not None and all(len(p) == 16 for p in pages)
    other, other_tail = prompt_digests(b, 16)
    assert other[0] == pages[0] and other[1] != pages[1] and other_tail != tail
    assert prompt_digests(a[:32], 16) == (pages, None)
    assert prompt_digests(a, 16, salt="tenant")[0][0] != pages[0]
    assert prompt_digests([], 16) == ([], None)


def test_a_render_may_write_several_lines_and_add_to_later_start_lines(tmp_path: Path):
    def render(item: int):
        if item == 1:
            writer.add_header({"scheduler": {"config": {"max_slots": 3}}})
            return [
                {"event": "frame", "fence": 1, "ranks": []},
                {"event": "finish", "fence": 1, "request": 0},
            ]
        return {"event": "frame", "fence": item, "ranks": [], "pad": "x" * 3000}

    path = tmp_path / "t.jsonl"
    writer = TraceWriter(
        TraceOptions(str(path), max_bytes=4096, keep=2),
        render,
        {"world_size": 1},
        file_only=("finish",),
    )
    for item in range(1, 4):
        writer.offer(item)
    writer.close()
    assert writer.frames == 3 and writer.written == 4
    files = trace_files(str(path))
    assert len(files) >= 2
    first = json.loads(Path(files[0]).read_text().splitlines()[0])
    assert "scheduler" not in first and first["v"] == 2
    later = json.loads(path.read_text().splitlines()[0])
    assert later["scheduler"] == {"config": {"max_slots": 3}}
    trace = read_trace(str(path))
    assert len(trace.finishes) == 1 and trace.bad_lines == 0
    assert trace.scheduler == {"config": {"max_slots": 3}}
