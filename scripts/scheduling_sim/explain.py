"""Why did a request wait?  Replays a flare simulation and, at every decision
while one request waited for its first token (or its next token), prints the
winner next to the best candidate that would have served that request, with
the numbers of the spec objective: value, duration, age slope and score, and
the request's own prices.

    python -m scripts.scheduling_sim.explain --suite chat95 --profile llama1b-h100-additive
    python -m scripts.scheduling_sim.explain --requests 64 --prompt-len 64:4096 \\
        --output-len 16:512 --arrival-rate 20 --mixed-prefill --request worst-ttft

``--request`` takes a request id, ``worst-ttft`` (default) or ``worst-gap``.
The first run finds the request; the second, identical run (the simulation is
deterministic) watches it.  Prints a readable trace; the last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from dataclasses import replace
from itertools import pairwise

from runtime.coordinator import policy as selection
from scripts.scheduling_sim.__main__ import config_from_args, workload_from_args
from scripts.scheduling_sim.__main__ import parse_args as sim_args
from scripts.scheduling_sim.runner import simulate


def _describe(c: selection.Candidate) -> dict:
    desc = c.entry.descriptor
    prompt = c.lanes[c.prompt_row] if c.prompt_row >= 0 else None
    return {
        "graph": desc.describe(),
        "rows": len(c.lanes),
        "prompt_request": None if prompt is None else prompt.request.handle.id,
        "prompt_tokens": c.prompt_tokens,
        "value": round(c.value, 1),
        "age_slope": round(c.age_slope, 4),
        "t_ms": round(c.t_ms, 3),
        "score": round(c.score, 2),
    }


class Watch:
    """Wraps the production scheduler; at each plan() notes the watched request's loss."""

    def __init__(self, scheduler, request_id: int, window: tuple[int, int]) -> None:
        self._s = scheduler
        self.request_id = request_id
        self.window = window
        self.rows: list[dict] = []

    def __getattr__(self, name):
        return getattr(self._s, name)

    def plan(self):
        s = self._s
        start, end = self.window
        if start <= s.now_ns <= end:
            ctx = s._context()
            if ctx is not None:
                self._note(ctx)
        return s.plan()

    def _note(self, ctx) -> None:
        cands = selection.candidates(ctx)
        winner = selection.best(cands)
        if winner is None:
            return
        mine = [c for c in cands if any(v.request.handle.id == self.request_id for v in c.lanes)]
        mine.sort(key=selection.Candidate.rank_key, reverse=True)
        if any(c is winner for c in mine):
            row = {"at_ms": round(self._s.now_ns / 1e6, 3), "served": True}
            row["winner"] = _describe(winner)
            row["runners_up"] = [_describe(c) for c in mine if c is not winner][:2]
            self.rows.append(row)
            return
        view = next(
            (v for v in ctx.prefill + ctx.decode if v.request.handle.id == self.request_id), None
        )
        if view is None:  # not eligible now: its previous frame is in flight
            row = {"at_ms": round(self._s.now_ns / 1e6, 3), "served": False, "in_flight": True}
            row["winner"] = _describe(winner)
            row["queued_frames"] = self._s.in_flight
            self.rows.append(row)
            return
        row = {
            "at_ms": round(self._s.now_ns / 1e6, 3),
            "served": False,
            "queued_frames": self._s.in_flight,
            "winner": _describe(winner),
            "best_with_request": _describe(max(mine, key=selection.Candidate.rank_key))
            if mine
            else None,
        }
        if view is not None:
            row["token_price"] = round(view.token_price, 3)
            row["delivery_price"] = round(view.delivery_price, 3)
            row["prompt_pos"] = view.prompt_pos
        self.rows.append(row)


def pick(sim, which: str) -> tuple[int, tuple[int, int]]:
    stats = list(sim.requests.values())
    if which == "worst-ttft":
        s = max(stats, key=lambda s: s.ttft_ns or 0)
        return s.handle.id, (s.arrival_ns, s.arrival_ns + (s.ttft_ns or 0))
    if which == "worst-gap":
        best = None
        for s in stats:
            p = s.publications_ns
            for a, b in pairwise(p):
                if best is None or b - a > best[0]:
                    best = (b - a, s.handle.id, a, b)
        if best is None:
            raise SystemExit("no request published twice")
        return best[1], (best[2], best[3])
    s = sim.requests[int(which)]
    return s.handle.id, (s.arrival_ns, s.arrival_ns + (s.ttft_ns or 0))


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--request", default="worst-ttft")
    p.add_argument("--suite", help="a bench_schedulers workload name instead of the flags")
    p.add_argument("--show", type=int, default=12, help="decisions printed (all go to JSON)")
    own, rest = p.parse_known_args(argv)
    args = sim_args(rest)
    cfg = replace(config_from_args(args), scheduler="flare")
    if own.suite:
        cfg = replace(cfg, mixed_prefill=True)
        from scripts.bench_schedulers import capacity, workload

        cap, _ = capacity(cfg)
        make = lambda: workload(own.suite, cap, False)  # noqa: E731
    else:
        make = lambda: workload_from_args(args)  # noqa: E731
    report, sim = simulate(cfg, make())
    request_id, window = pick(sim, own.request)
    stats = sim.requests[request_id]

    watch: list[Watch] = []

    def observe(scheduler) -> Watch:
        watch.append(Watch(scheduler, request_id, window))
        return watch[-1]

    simulate(cfg, make(), wrap=observe)
    rows = watch[0].rows
    print(
        f"request {request_id}: prompt {stats.prompt_len}, output {stats.output_target}, "
        f"arrived {stats.arrival_ns / 1e6:.1f} ms, window {window[0] / 1e6:.1f}.."
        f"{window[1] / 1e6:.1f} ms ({(window[1] - window[0]) / 1e6:.1f} ms), "
        f"{len(rows)} decisions"
    )
    lost = [r for r in rows if not r["served"]]
    winners = Counter(r["winner"]["graph"].split()[0] for r in lost)
    print(f"decisions it lost: {len(lost)} (winner kinds {dict(winners)})")
    for r in rows[: own.show]:
        w = r["winner"]
        line = f"  {r['at_ms']:>10.2f} ms  winner {w['graph']:<28} score {w['score']:>10.2f}"
        line += f" (value {w['value']}, T {w['t_ms']} ms, rows {w['rows']})"
        if r.get("in_flight"):
            line += "  (its frame is in flight)"
        elif not r["served"]:
            b = r.get("best_with_request")
            if b is not None:
                line += f"\n{'':>16}mine   {b['graph']:<28} score {b['score']:>10.2f}"
                line += f" (value {b['value']}, T {b['t_ms']} ms, rows {b['rows']},"
                line += f" prompt tokens {b['prompt_tokens']})"
            line += f"  f/x {r.get('token_price')}, queued {r['queued_frames']}"
        else:
            line += "  <- its best (committed once the window allows)"
            for b in r.get("runners_up", []):
                line += f"\n{'':>16}next   {b['graph']:<28} score {b['score']:>10.2f}"
                line += f" (value {b['value']}, T {b['t_ms']} ms, rows {b['rows']},"
                line += f" prompt tokens {b['prompt_tokens']})"
        print(line)
    print(
        json.dumps(
            {"request": request_id, "window_ns": list(window), "summary": report, "rows": rows},
            sort_keys=True,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
