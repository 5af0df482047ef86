"""A paused or failed process, on real `flare run` process trees (docs/serving.md,
"Reliability"; CPU, the embedded model, test heartbeats of 0.5 s):

- requests sent while the coordinator is paused (short of the heartbeat
  timeout) are all queued and served, or refused and never run: the
  coordinator's finished plus cancelled choices equal the accepted ones;
- /health turns 503 within a second of the engine failing (a rank killed, a
  rank stopped, from the heartbeat timeout, the coordinator killed or stopped)
  and stays 503 once a coordinator whose ranks left resumes;
- work lost to a failure ends with a 5xx or an SSE error event, never a
  normal finish ("abort" is an operator's stop);
- a hung rank at TP=2 takes the whole deployment down within 15 s.

The figures each test measured are printed (``pytest -s`` shows them).
"""

from __future__ import annotations

import contextlib
import json
import threading
import time

import httpx
import psutil
import pytest

from tests.support.processes import all_gone, tree, wait_for
from tests.support.server import Server

pytestmark = pytest.mark.process

BEAT = ["--heartbeat-interval", "0.5", "--heartbeat-timeout", "2"]
TIMEOUT_S = 2.0  # the heartbeat timeout above
HEALTH_LATENCY_S = 1.0  # the goal: /health is 503 within 1 s of the engine failing
EXIT_S = 15.0  # the goal: the deployment exits within 15 s of a failure


def processes(s: Server, module: str) -> list[psutil.Process]:
    return [p for p in tree(s.proc.pid) if module in " ".join(p.cmdline())]


def resume(procs: list[psutil.Process]) -> None:
    """SIGCONT whatever a failed test left stopped (a stopped process ignores the
    SIGTERM its parent's death sends it, and would stay behind)."""
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            proc.resume()


class Health(threading.Thread):
    """Polls /health every 20 ms and keeps (time, status, message) of every answer."""

    def __init__(self, base: str) -> None:
        super().__init__(daemon=True)
        self.base = base
        self.answers: list[tuple[float, int, str]] = []
        self.done = threading.Event()
        self.start()

    def run(self) -> None:
        with httpx.Client(timeout=2) as http:
            while not self.done.is_set():
                try:
                    r = http.get(f"{self.base}/health")
                    message = r.json()["error"]["message"] if r.status_code != 200 else ""
                    self.answers.append((time.monotonic(), r.status_code, message))
                except (httpx.HTTPError, ValueError):
                    self.answers.append((time.monotonic(), 0, "no answer"))
                time.sleep(0.02)

    def stop(self) -> None:
        self.done.set()
        self.join(5)

    def unhealthy_after(self, since: float) -> float | None:
        """Seconds from ``since`` to the first answer other than 200 from then on."""
        return next((t - since for t, code, _ in self.answers if t >= since and code != 200), None)

    def after(self, since: float) -> list[tuple[float, int, str]]:
        return [a for a in self.answers if a[0] >= since]


class Stream(threading.Thread):
    """A streamed (or, ``stream=False``, a plain) completion read in the background."""

    def __init__(self, base: str, max_tokens: int = 3000, stream: bool = True) -> None:
        super().__init__(daemon=True)
        self.base, self.max_tokens, self.streamed = base, max_tokens, stream
        self.status: int | None = None
        self.events: list[dict] = []
        self.body: dict | None = None
        self.error: BaseException | None = None
        self.start()

    def run(self) -> None:
        request = {"prompt": "alpha beta gamma", "max_tokens": self.max_tokens,
                   "ignore_eos": True, "temperature": 0, "stream": self.streamed}  # fmt: skip
        try:
            with httpx.stream("POST", f"{self.base}/v1/completions", json=request, timeout=60) as r:
                self.status = r.status_code
                if not self.streamed:
                    self.body = json.loads(r.read())
                    return
                for line in r.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        self.events.append(json.loads(line[6:]))
        except httpx.HTTPError as exc:
            self.error = exc

    def outcome(self) -> str:
        """ "error" (a 5xx or an SSE error event), "unanswered" (the connection failed
        before a response began: the server was gone), or the finish reasons seen."""
        if self.status is None and self.error is not None:
            return "unanswered"
        if self.status is not None and self.status >= 500:
            return "error"
        if any("error" in event for event in self.events):
            return "error"
        choices = (
            self.body["choices"]
            if self.body
            else [c for event in self.events for c in event.get("choices", [])]
        )
        return ",".join(c["finish_reason"] for c in choices if c.get("finish_reason"))

    def tokens(self) -> int:
        return sum(1 for e in self.events for c in e.get("choices", []) if c.get("text"))


def assert_failed_as_errors(streams: list[Stream], unanswered_ok: bool = False) -> None:
    """Each request ended with an error (or, ``unanswered_ok``, found no server)."""
    allowed = {"error", "unanswered"} if unanswered_ok else {"error"}
    for stream in streams:
        stream.join(30)
        assert not stream.is_alive()
        outcome = stream.outcome()
        assert outcome in allowed, (outcome, stream.status, stream.body, stream.events[-3:])


def assert_exits(s: Server, procs: list[psutil.Process], since: float, limit_s: float) -> float:
    """``flare run`` exits non-zero within ``limit_s`` of ``since``, nothing left; the time."""
    try:
        code = s.proc.wait(timeout=max(0.1, since + limit_s - time.monotonic()))
    except Exception:
        raise AssertionError(f"flare run still running {limit_s} s after the failure") from None
    took = time.monotonic() - since
    assert code != 0, s.output()[-3000:]
    assert wait_for(lambda: all_gone(procs), 10), [p.pid for p in procs if p.is_running()]
    return took


# ------------------------------------------------------------------ 1. a paused coordinator


def test_requests_sent_during_a_coordinator_pause_are_served_or_refused_never_lost():
    # A pause well under the heartbeat timeout: nothing fails, the requests queue up.
    s = Server("--max-concurrency", "32", "--heartbeat-interval", "0.5",
               "--heartbeat-timeout", "20")  # fmt: skip
    (coordinator,) = processes(s, "runtime.coordinator")
    try:
        before = s.metrics()
        # Three streams of 64 prompts x 16 = 1,024 choices: 3,072 Submits, beyond the
        # two sockets' 1,000-message queues; each client leaves after its first token,
        # so most choices end cancelled.  And a small request that runs to the end.
        big, small = 64 * 16, 4
        outcomes: list[tuple[str, int]] = []  # (outcome, choices)

        def abandoned(seed: int) -> None:
            request = {"prompt": ["x"] * 64, "n": 16, "max_tokens": 64, "seed": seed,
                       "ignore_eos": True, "stream": True}  # fmt: skip
            url = f"{s.base}/v1/completions"
            with httpx.stream("POST", url, json=request, timeout=120) as r:
                outcome = f"http {r.status_code}"
                for line in r.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    event = json.loads(line[6:])
                    if "error" in event:
                        outcome = "error"
                        break
                    if any(c.get("text") for c in event["choices"]):
                        outcome = "served"
                        break  # the client leaves: the choices are cancelled
            outcomes.append((outcome, big))

        def plain() -> None:
            request = {"prompt": "x", "n": small, "max_tokens": 2, "ignore_eos": True}
            r = httpx.post(f"{s.base}/v1/completions", json=request, timeout=120)
            finished = [c["finish_reason"] for c in r.json().get("choices", [])]
            if r.status_code == 200:
                assert finished == ["length"] * small, r.json()
            outcomes.append(("served" if r.status_code == 200 else "error", small))

        coordinator.suspend()  # SIGSTOP
        paused = time.monotonic()
        threads = [threading.Thread(target=abandoned, args=(i,)) for i in range(3)]
        threads.append(threading.Thread(target=plain))
        for thread in threads:
            thread.start()
        time.sleep(2.5)  # the frontend takes them in meanwhile
        coordinator.resume()
        print(f"\npause: {time.monotonic() - paused:.1f} s")
        for thread in threads:
            thread.join(120)
        assert len(outcomes) == 4 and {o for o, _ in outcomes} <= {"served", "error"}, outcomes
        accepted = sum(n for outcome, n in outcomes if outcome == "served")
        refused = sum(n for outcome, n in outcomes if outcome == "error")

        def settled() -> dict[str, float] | None:
            m = s.metrics()
            idle = m["flare_num_requests_running"] == m["flare_num_requests_waiting"] == 0
            return m if idle else None

        after = wait_for(settled, 60) and settled()
        assert after, "requests still held by the coordinator"
        count = {k: after[f"flare_engine_requests_{k}_total"] -
                 before[f"flare_engine_requests_{k}_total"]
                 for k in ("submitted", "finished", "cancelled")}  # fmt: skip
        print(f"accepted {accepted}, refused {refused}, coordinator {count}")
        # Every accepted choice reached the coordinator, no refused one did, and each
        # ended there (finished, or cancelled for the client that left).
        assert count["submitted"] == accepted
        assert count["finished"] + count["cancelled"] == accepted
        assert refused == 0  # the frontend queues what the sockets cannot take yet
    finally:
        resume([coordinator])
        s.stop()


# ------------------------------------------------------------------ 2-3. failures


def test_a_killed_coordinator_fails_open_requests_and_health_at_once():
    s = Server("--max-concurrency", "1", *BEAT)
    procs = tree(s.proc.pid)
    health = None
    try:
        (coordinator,) = processes(s, "runtime.coordinator")
        running = Stream(s.base)
        assert wait_for(lambda: running.tokens() >= 2, 60)
        waiting = Stream(s.base)  # no free slot: it waits in the coordinator
        plain = Stream(s.base, stream=False)
        time.sleep(0.5)
        health = Health(s.base)
        time.sleep(0.3)
        coordinator.kill()  # SIGKILL
        killed = time.monotonic()
        # Every open request, running or waiting, ends with an error: nothing was
        # stopped on purpose, so no "abort".
        assert_failed_as_errors([running, waiting, plain])
        took = assert_exits(s, procs, killed, EXIT_S)
        latency = health.unhealthy_after(killed)
        print(f"\ncoordinator SIGKILL: /health 503 after {latency:.2f} s, exit after {took:.1f} s")
        assert latency is not None and latency <= HEALTH_LATENCY_S
    finally:
        if health is not None:
            health.stop()
        s.stop()


def test_a_killed_rank_turns_health_503_within_a_second():
    s = Server(*BEAT)
    procs = tree(s.proc.pid)
    health = None
    try:
        (rank,) = processes(s, "runtime.ranks")
        running = Stream(s.base)
        assert wait_for(lambda: running.tokens() >= 2, 60)
        health = Health(s.base)
        time.sleep(0.3)
        rank.kill()
        killed = time.monotonic()
        assert_failed_as_errors([running])
        took = assert_exits(s, procs, killed, EXIT_S)
        latency = health.unhealthy_after(killed)
        print(f"\nrank SIGKILL: /health 503 after {latency:.2f} s, exit after {took:.1f} s")
        assert latency is not None and latency <= HEALTH_LATENCY_S
    finally:
        if health is not None:
            health.stop()
        s.stop()


def test_a_hung_rank_at_tp2_fails_health_then_the_whole_deployment_exits():
    s = Server("--tensor-parallel-size", "2", *BEAT)
    procs = tree(s.proc.pid)
    health = None
    stopped = None
    try:
        ranks = processes(s, "runtime.ranks")
        assert len(ranks) == 2
        running = Stream(s.base)
        assert wait_for(lambda: running.tokens() >= 2, 60)
        health = Health(s.base)
        time.sleep(0.3)
        stopped = ranks[1]
        stopped.suspend()  # SIGSTOP: hung, as far as anyone can tell
        hung = time.monotonic()
        assert_failed_as_errors([running])
        took = assert_exits(s, procs, hung, EXIT_S)
        latency = health.unhealthy_after(hung)
        print(
            f"\nrank SIGSTOP at TP=2: /health 503 after {latency:.2f} s "
            f"(heartbeat timeout {TIMEOUT_S:g} s), exit after {took:.1f} s"
        )
        assert latency is not None and latency <= TIMEOUT_S + HEALTH_LATENCY_S
        # The engine's failure is what /health reports, not a silent coordinator.
        messages = {m for _, code, m in health.after(hung) if code == 503}
        assert messages and not any("stopped answering" in m for m in messages), messages
    finally:
        if health is not None:
            health.stop()
        resume([stopped] if stopped is not None else [])
        s.stop()


def test_a_coordinator_resumed_after_its_ranks_left_never_serves_nor_ends_work_as_abort():
    s = Server(*BEAT)
    procs = tree(s.proc.pid)
    health = None
    (coordinator,) = processes(s, "runtime.coordinator")
    try:
        ranks = processes(s, "runtime.ranks")
        health = Health(s.base)
        time.sleep(0.3)
        coordinator.suspend()  # longer than the ranks' heartbeat timeout: they exit
        paused = time.monotonic()
        assert wait_for(lambda: all_gone(ranks), TIMEOUT_S + 10)
        time.sleep(max(0.0, paused + TIMEOUT_S + 1.5 - time.monotonic()))
        coordinator.resume()
        resumed = time.monotonic()
        # Requests sent from the resume on: each refused or failed, never a normal end.
        sent: list[Stream] = []
        while s.proc.poll() is None and time.monotonic() - resumed < EXIT_S:
            sent.append(Stream(s.base, max_tokens=8, stream=len(sent) % 2 == 0))
            time.sleep(0.1)
        took = assert_exits(s, procs, resumed, EXIT_S)
        assert_failed_as_errors(sent, unanswered_ok=True)  # the last ones: the server left
        assert any(stream.outcome() == "error" for stream in sent)
        latency = health.unhealthy_after(paused)
        after_resume = [code for t, code, _ in health.after(resumed)]
        print(
            f"\ncoordinator SIGSTOP: /health 503 after {latency:.2f} s (heartbeat timeout "
            f"{TIMEOUT_S:g} s); after the resume: {len(sent)} requests, none served "
            f"({sum(r.outcome() == 'error' for r in sent)} errors, the rest unanswered), "
            f"/health {sorted(set(after_resume))}, exit after {took:.1f} s"
        )
        assert latency is not None and latency <= TIMEOUT_S + HEALTH_LATENCY_S
        assert 200 not in after_resume
    finally:
        if health is not None:
            health.stop()
        resume([coordinator])
        s.stop()
