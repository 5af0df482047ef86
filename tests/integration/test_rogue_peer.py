"""A rogue local process attacks a deployment's TCP endpoints (issue 15).

Without CURVE, a process of any user on the machine could subscribe to the
frames (reading every prompt's token ids) and push completions the coordinator
took for a rank's: the client received forged tokens.  Here a real deployment
(the engine and a rank process over TCP loopback, keys made for the run) is
attacked by a separate process without the keys that connects a SUB to the
frames endpoint and a PUSH to the completions endpoint, reads what it can and
forges a completion for every fence it sees or guesses.  It must read nothing,
no forgery may reach the engine, and the client must get exactly the tokens
the same request gets without the rogue.  The same rogue against a deployment
started with ``insecure_transport`` shows that the attack is real.

Run as a script, this file is the rogue: ``python test_rogue_peer.py FRAMES
COMPLETIONS SECONDS blind|precise|flood`` prints one JSON line (frames read, prompt tokens seen,
forgeries queued).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FORGED_TOKEN = 7
BLIND_FENCES = 400  # fences guessed when nothing can be read
FLOOD_BASE = 1_000_000  # "flood": forged fences from here on, never in flight
PROMPT = [5, 17, 33, 2, 91, 40, 8, 64, 12]
NEW = 24
WAIT_S = 120


def rogue(frames: str, completions: str, seconds: float, blind: bool, base: int = 0) -> dict:
    """Read frames and forge completions for ``seconds``; what it managed.

    Every frame read is answered at once with a completion of the same lanes
    carrying FORGED_TOKEN; with ``blind``, while nothing can be read, it also
    forges completions for the first BLIND_FENCES fences (slot 0, generations
    1..3) five times a second, numbered from ``base``; a ``base`` far above the
    deployment's fences floods it with completions for fences never sent, and then
    it answers no frame."""
    import zmq

    from runtime.transport.codec import decode, encode
    from runtime.transport.completion import Completion, LaneResult
    from runtime.transport.fields import ProtocolError
    from runtime.transport.frame import Frame

    context = zmq.Context()
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.LINGER, 0)
    push = context.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    sub.connect(frames)
    push.connect(completions)
    time.sleep(0.5)  # for the subscription to reach the publisher
    print("ready", flush=True)
    read, prompt_tokens, attempted, queued = 0, [], 0, 0

    def forge(message: Completion) -> None:
        nonlocal attempted, queued
        attempted += 1
        try:  # queued on the rogue's side; only an accepted connection carries it
            push.send(encode(message), zmq.NOBLOCK)
            queued += 1
        except zmq.Again:  # no connection to queue it on (refused), or its queue is full
            pass

    end = time.monotonic() + seconds
    next_blind = 0.0
    while time.monotonic() < end:
        if sub.poll(5):
            read += 1
            try:
                frame = decode(sub.recv())
            except ProtocolError:
                continue
            if not isinstance(frame, Frame) or base:
                continue
            lanes = []
            for lane in frame.lanes:
                prompt_tokens.extend(lane.prompt_tokens)
                lanes.append(LaneResult(lane.slot, lane.generation, (FORGED_TOKEN,) * lane.commits))
            forge(Completion.from_results(frame.fence, 0, 1, 1, lanes=lanes))
        elif blind and time.monotonic() >= next_blind:  # nothing to read: guess
            next_blind = time.monotonic() + 0.2
            for fence in range(base, base + BLIND_FENCES):
                lanes = [LaneResult(0, 1 + fence % 3, (FORGED_TOKEN,))]
                forge(Completion.from_results(fence, 0, 1, 1, lanes=lanes))
    sub.close()
    push.close()
    context.term()
    return {"read": read, "prompt_tokens": prompt_tokens, "attempted": attempted, "queued": queued}


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    args = sys.argv[1:]
    mode = args[3]
    base = FLOOD_BASE if mode == "flood" else 0
    print(json.dumps(rogue(args[0], args[1], float(args[2]), mode != "precise", base)), flush=True)
    sys.exit(0)


import pytest  # noqa: E402

from runtime.deploy.config import DeploymentConfig  # noqa: E402
from runtime.deploy.local import LocalDeployment  # noqa: E402
from runtime.transport.security import ENV_CLIENT_SECRET  # noqa: E402
from tests.support.checkpoints import write_tiny  # noqa: E402

pytestmark = pytest.mark.process


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("rogue-model")
    write_tiny("llama", path, seed=21)
    return path


def _deployment(model_dir: Path, **kwargs: object) -> LocalDeployment:
    return LocalDeployment(
        DeploymentConfig(
            model=str(model_dir), tensor_parallel_size=1, max_concurrency=4,
            max_prefill_tokens=64, num_pages=64, device="cpu", startup_timeout_s=WAIT_S,
            transport="tcp", **kwargs,
        )
    )  # fmt: skip


def _start_rogue(
    deployment: LocalDeployment, seconds: float, blind: bool, flood: bool = False
) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLARE_TRANSPORT_")}
    endpoints = deployment.engine.endpoints
    return subprocess.Popen(
        [
            sys.executable,
            __file__,
            endpoints.frames,
            endpoints.completions,
            str(seconds),
            "flood" if flood else "blind" if blind else "precise",
        ],
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )


def _rogue_ready(process: subprocess.Popen) -> None:
    assert process.stdout is not None
    assert process.stdout.readline().strip() == "ready"


def _rogue_result(process: subprocess.Popen) -> dict:
    out, _ = process.communicate(timeout=WAIT_S)
    assert process.returncode == 0
    return json.loads(out.strip().splitlines()[-1])


def _generate(deployment: LocalDeployment) -> list[int]:
    stream = deployment.engine.submit(PROMPT, NEW, ignore_eos=True)
    return stream.result(timeout=WAIT_S).token_ids


def test_a_rogue_without_the_keys_reads_nothing_and_forges_nothing(model_dir: Path) -> None:
    with _deployment(model_dir) as clean:
        expected = _generate(clean)
    assert len(expected) == NEW

    with _deployment(model_dir) as attacked:
        engine = attacked.engine
        assert engine.rank_keys() is not None  # tcp without given keys: keys made for the run
        assert ENV_CLIENT_SECRET not in os.environ  # handed to the rank, not kept here
        rogue = _start_rogue(attacked, seconds=6.0, blind=True)
        try:
            _rogue_ready(rogue)
            deadline = time.monotonic() + WAIT_S
            while engine.metrics()["transport_auth_denied_total"] < 2:  # SUB and PUSH refused
                assert time.monotonic() < deadline, "the rogue's connections were not refused"
                time.sleep(0.05)
            ignored_before = engine.stats.counters().get("ignored_messages", 0)
            got = _generate(attacked)
            result = _rogue_result(rogue)
        finally:
            if rogue.poll() is None:
                rogue.kill()
        counters = engine.stats.counters()
    assert got == expected  # the client sees only the true tokens
    assert result["read"] == 0 and result["prompt_tokens"] == []  # no frame was readable
    assert result["attempted"] > 0  # it tried
    assert engine.rejected_messages == 0  # none reached the engine's decoder
    assert counters.get("ignored_messages", 0) == ignored_before


def test_without_curve_the_same_rogue_reads_prompts_and_forges(model_dir: Path) -> None:
    """The attack is real: an insecure deployment leaks the prompt and takes forgeries."""
    with _deployment(model_dir, insecure_transport=True) as exposed:
        engine = exposed.engine
        assert engine.rank_keys() is None
        rogue = _start_rogue(exposed, seconds=6.0, blind=False)
        try:
            _rogue_ready(rogue)
            ignored_before = engine.stats.counters().get("ignored_messages", 0)
            got = _generate(exposed)
            result = _rogue_result(rogue)
        finally:
            if rogue.poll() is None:
                rogue.kill()
        ignored = engine.stats.counters().get("ignored_messages", 0) - ignored_before
    assert result["read"] > 0 and result["prompt_tokens"][: len(PROMPT)] == PROMPT
    assert result["queued"] > 0
    # Every forgery reached the engine: it took the rogue's tokens where the rogue
    # answered first, and ignored the forgeries (or the true answers) that came second.
    assert FORGED_TOKEN in got or ignored > 0


def test_a_flood_of_forgeries_is_logged_as_a_burst_and_a_count(model_dir: Path) -> None:
    """Without CURVE a rogue can push thousands of forged completions a second; the
    coordinator logs a burst of them and then counts (issue 23: 8,388 lines in 8 s
    before).  The handler is guarded the way the coordinator process guards its own
    (``install_rate_limit`` in ``runtime/coordinator/__main__.py``)."""
    import logging

    from runtime.logs import DEFAULT_BURST, RateLimitFilter, install_rate_limit

    class Lines(logging.Handler):
        def __init__(self) -> None:
            super().__init__()
            self.lines: list[str] = []

        def emit(self, record: logging.LogRecord) -> None:
            self.lines.append(record.getMessage())

    handler = Lines()
    install_rate_limit(handler)
    engine_log = logging.getLogger("runtime.coordinator.engine")
    engine_log.addHandler(handler)
    try:
        with _deployment(model_dir, insecure_transport=True) as exposed:
            engine = exposed.engine
            ignored_before = engine.stats.counters().get("ignored_messages", 0)
            rogue = _start_rogue(exposed, seconds=3.0, blind=True, flood=True)
            try:
                _rogue_ready(rogue)
                result = _rogue_result(rogue)
            finally:
                if rogue.poll() is None:
                    rogue.kill()
            # The engine reads completions while frames are in flight: a request makes
            # it drain what the rogue queued (up to the sockets' high-water marks).
            _generate(exposed)
            ignored = engine.stats.counters().get("ignored_messages", 0) - ignored_before
    finally:
        engine_log.removeHandler(handler)
    for guard in handler.filters:
        if isinstance(guard, RateLimitFilter):
            guard.flush()  # the interval's count now rather than in 10 s
    forged_lines = [line for line in handler.lines if line.startswith("ignoring completion")]
    summaries = [line for line in handler.lines if line.startswith("suppressed")]
    assert result["queued"] > 1000  # the flood was real
    assert ignored > 500  # and reached the engine, which ignored each forgery
    assert len(forged_lines) <= DEFAULT_BURST  # logged: one burst ...
    assert summaries and any("ignoring completion" in line for line in summaries)  # ... a count
