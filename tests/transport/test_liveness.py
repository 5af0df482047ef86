"""Liveness both ways (runtime/transport/liveness.py), the coordinator's per-frame
watchdog arithmetic, and "never silence": heartbeats over real sockets in this
process, silent peers on either side, forged heartbeats, a message a rank cannot
decode, a silent fake rank failing the engine, a replayed frame refused."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import zmq

from runtime.coordinator.engine import ERROR, Engine, EngineConfig, EngineError
from runtime.coordinator.engine.config import (
    DEFAULT_WATCHDOG_MARGIN_S,
    DEFAULT_WATCHDOG_MULTIPLE,
    frame_watchdog_ns,
)
from runtime.ranks.watchdog import frame_deadline_ns
from runtime.transport.channels import ChannelEndpoints
from runtime.transport.codec import decode, encode
from runtime.transport.control import Control
from runtime.transport.coordinator_channel import CoordinatorChannel
from runtime.transport.fields import MAX_ERROR_CHARS, ProtocolError
from runtime.transport.liveness import CoordinatorLiveness, LivenessConfig, RankHeartbeat
from runtime.transport.rank_channel import RankChannel
from tests.support.fake_rank import FakeSpec, LocalRanks

FAST = LivenessConfig(interval_s=0.05, timeout_s=0.4)
WAIT_S = 10.0


def wait_for(predicate: Callable[[], Any], limit_s: float = WAIT_S) -> Any:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.01)
    raise AssertionError(f"not within {limit_s} s")


# ------------------------------------------------------------------ schema and arithmetic


def test_control_error_and_heartbeat_schema() -> None:
    error = Control("error", 2, reason="v: protocol version 3, this build speaks 8")
    assert decode(encode(error)) == error
    assert error.to_wire() == {
        "command": "error", "rank": 2, "nonce": 0, "count": 0,
        "reason": "v: protocol version 3, this build speaks 8",
    }  # fmt: skip
    assert decode(encode(Control("heartbeat", -1, nonce=7))).nonce == 7
    assert Control("heartbeat", 3).rank == 3
    for build, field in [
        (lambda: Control("error", 1), "reason"),  # an error says why
        (lambda: Control("error", -1, reason="x"), "rank"),  # from a rank
        (lambda: Control("heartbeat", reason="x"), "reason"),  # only errors carry one
        (lambda: Control("error", 1, reason="x" * (MAX_ERROR_CHARS + 1)), "reason"),
        (lambda: Control("error", 1, reason=b"x"), "reason"),
    ]:
        with pytest.raises(ProtocolError) as raised:
            build()
        assert raised.value.field == field


def test_liveness_config_names_the_bad_field() -> None:
    assert LivenessConfig() == LivenessConfig(1.0, 10.0)
    for kwargs, text in [
        ({"interval_s": 0}, "interval_s"),
        ({"timeout_s": float("nan")}, "timeout_s"),
        ({"interval_s": True}, "interval_s"),
        ({"interval_s": 2.0, "timeout_s": 2.0}, "must exceed interval_s"),
    ]:
        with pytest.raises(ValueError, match=text):
            LivenessConfig(**kwargs)


def test_watchdog_arithmetic() -> None:
    # Known cost: multiple x expected + margin.
    assert frame_watchdog_ns(2_000_000, 25.0, 75.0, 120.0) == 50_000_000 + 75_000_000_000
    # Unknown cost (no estimate yet): the floor, at least the margin.
    assert frame_watchdog_ns(0, 25.0, 75.0, 120.0) == 120_000_000_000
    assert frame_watchdog_ns(0, 25.0, 75.0, 10.0) == 75_000_000_000
    # An empty frame's cost is known (nothing runs): the margin alone.
    assert frame_watchdog_ns(0, 25.0, 75.0, 120.0, known=True) == 75_000_000_000
    # The defaults are looser than the ranks' own deadline (20 x + 60 s), known or not,
    # so a hung rank's own report (where it is stuck) normally arrives first.
    for expected in (0, 1_000_000, 50_000_000, 3_000_000_000):
        rank = frame_deadline_ns(expected, 20.0, 60.0)
        ours = frame_watchdog_ns(
            expected, DEFAULT_WATCHDOG_MULTIPLE, DEFAULT_WATCHDOG_MARGIN_S, 120.0
        )
        assert ours > rank
    with pytest.raises(ValueError, match="frame_watchdog_multiple"):
        EngineConfig(frame_watchdog_multiple=0)
    with pytest.raises(ValueError, match="heartbeat_timeout_s"):
        EngineConfig(heartbeat_interval_s=1.0, heartbeat_timeout_s=0.5)


# ------------------------------------------------------------------ heartbeats over sockets


@pytest.fixture
def pair() -> Iterator[tuple[CoordinatorChannel, RankChannel]]:
    coordinator = CoordinatorChannel(1, heartbeat=True)
    rank = RankChannel(coordinator.endpoints, 0)
    yield coordinator, rank
    rank.close()
    coordinator.close()


def start_pair(
    coordinator: CoordinatorChannel,
    rank: RankChannel,
    on_gone: Callable[[int, str], None],
) -> tuple[CoordinatorLiveness, RankHeartbeat]:
    watcher = CoordinatorLiveness(coordinator.take_heartbeat_socket(), 1, FAST, on_gone)
    sock = rank.open_heartbeat_socket()
    assert sock is not None
    beat = RankHeartbeat(sock, 0, FAST, exit_process=False)
    watcher.start()
    beat.start()
    return watcher, beat


def test_heartbeats_flow_both_ways_and_a_silent_rank_is_reported_once(pair) -> None:
    coordinator, rank = pair
    assert coordinator.endpoints.heartbeat.startswith("ipc://")
    gone: list[tuple[int, str]] = []
    watcher, beat = start_pair(coordinator, rank, lambda r, why: gone.append((r, why)))
    try:
        wait_for(lambda: watcher.heard == [0] and beat.heard >= 3)
        time.sleep(3 * FAST.timeout_s)  # alive: heartbeats keep coming both ways
        assert gone == [] and beat.fired is None
        # A frame expected to run long: no rank counts as silent before its end.
        watcher.expect_until(time.monotonic_ns() + int(1.5e9))
        beat.close()  # the rank falls silent
        stopped = time.monotonic()
        wait_for(lambda: gone, limit_s=5.0)
        assert time.monotonic() - stopped >= 1.5
        time.sleep(2 * FAST.timeout_s)
        assert len(gone) == 1  # reported once
        rank_id, reason = gone[0]
        assert rank_id == 0 and reason.startswith("rank 0 is gone: no heartbeat for")
        assert "heartbeat timeout 0.4 s" in reason
    finally:
        beat.close()
        watcher.close()


def test_a_rank_whose_coordinator_falls_silent_gives_up(pair) -> None:
    coordinator, rank = pair
    watcher, beat = start_pair(coordinator, rank, lambda r, why: None)
    try:
        wait_for(lambda: beat.heard >= 2)
        watcher.close()  # the coordinator is gone
        stopped = time.monotonic()
        wait_for(lambda: beat.fired, limit_s=5.0)
        assert time.monotonic() - stopped < FAST.timeout_s + 2.0
        assert "rank 0: no heartbeat from the coordinator" in beat.fired
        assert "the coordinator is gone" in beat.fired
        wait_for(lambda: not beat.alive)
    finally:
        beat.close()
        watcher.close()


def test_a_stopping_coordinator_says_farewell_and_the_rank_stays(pair) -> None:
    """A normal stop is no death: a rank still busy in a long frame reads the frames
    socket's shutdown only after the frame, so its heartbeat thread must not end the
    process in the silence that follows the coordinator's farewell."""
    coordinator, rank = pair
    watcher, beat = start_pair(coordinator, rank, lambda r, why: None)
    try:
        wait_for(lambda: beat.heard >= 2 and watcher.heard == [0])
        watcher.close(farewell=True)
        wait_for(lambda: beat.stopping, limit_s=5.0)
        time.sleep(3 * FAST.timeout_s)  # far past the heartbeat timeout
        assert beat.fired is None and beat.alive
    finally:
        beat.close()
        watcher.close()


def test_after_watch_all_a_rank_that_never_heartbeats_is_gone(pair) -> None:
    coordinator, _ = pair
    gone: list[int] = []
    watcher = CoordinatorLiveness(
        coordinator.take_heartbeat_socket(), 1, FAST, lambda r, why: gone.append(r)
    )
    watcher.start()
    try:
        time.sleep(2 * FAST.timeout_s)
        assert gone == []  # not watched before it was heard from or watch_all
        watcher.watch_all()
        assert wait_for(lambda: gone, limit_s=5.0) == [0]
    finally:
        watcher.close()
    with pytest.raises(Exception, match="taken"):
        coordinator.take_heartbeat_socket()


def test_forged_heartbeats_are_rejected_and_counted(pair) -> None:
    coordinator, _ = pair
    gone: list[int] = []
    watcher = CoordinatorLiveness(
        coordinator.take_heartbeat_socket(), 1, FAST, lambda r, why: gone.append(r)
    )
    watcher.start()
    context = zmq.Context()
    rogue = context.socket(zmq.DEALER)
    rogue.connect(coordinator.endpoints.heartbeat)
    try:
        rogue.send(b"\x93not msgpack")
        rogue.send(encode(Control("ready", 0, nonce=1)))  # not a heartbeat
        rogue.send(encode(Control("heartbeat", 5)))  # no such rank in a world of 1
        rogue.send_multipart([encode(Control("heartbeat", 0)), b"extra"])
        wait_for(lambda: watcher.rejected >= 4)
        assert watcher.heard == [] and gone == []  # nothing was taken for a rank
        assert rogue.poll(3 * FAST.interval_s * 1000) == 0  # and nothing sent to it
    finally:
        rogue.close(linger=0)
        context.term()
        watcher.close()


def test_an_undecodable_message_is_answered_with_an_error_control(pair) -> None:
    coordinator, rank = pair
    answered = threading.Thread(target=rank.handshake, args=(int(WAIT_S * 1000),))
    answered.start()
    coordinator.handshake(WAIT_S)  # the rank's subscription is in place
    answered.join()
    coordinator._pub.send(b"\xc1 garbage")  # what a broken frame looks like to a rank
    wait_for(lambda: rank.recv(timeout_ms=10) is None and rank.rejected)
    error = wait_for(lambda: coordinator.recv(timeout_ms=10))
    assert isinstance(error, Control) and error.command == "error" and error.rank == 0
    assert error.reason  # says why
    assert rank.rejected == 1


# ------------------------------------------------------------------ the engine


class Rig:
    """An engine and in-process fake ranks (no heartbeats: the watchdog's case)."""

    def __init__(self, world_size: int, **config: Any) -> None:
        config.setdefault("handshake_timeout_s", WAIT_S)
        config.setdefault("catalog_timeout_s", WAIT_S)
        config.setdefault("shutdown_grace_s", 0)
        self.engine = Engine(EngineConfig(world_size=world_size, **config))
        self.ranks = LocalRanks(self.engine.bind(), world_size, FakeSpec())
        threads = self.ranks.handshake_in_background()
        self.engine.start()
        for thread in threads:
            thread.join(WAIT_S)

    def close(self) -> None:
        self.engine.stop()
        self.ranks.close()


@pytest.fixture
def rigs() -> Iterator[list[Rig]]:
    made: list[Rig] = []
    yield made
    for rig in made:
        rig.close()


def test_a_silent_fake_rank_fails_the_engine_naming_the_rank_and_the_fence(rigs) -> None:
    rig = Rig(2, frame_watchdog_margin_s=0.2, frame_watchdog_floor_s=0.5)
    rigs.append(rig)
    engine = rig.engine
    stream = engine.submit([1, 2, 3], 5)
    while not engine.in_flight_fences:
        engine.step(10)
    fence = engine.in_flight_fences[0]
    rank0, _ = rig.ranks.take(timeout_ms=int(WAIT_S * 1000))
    rig.ranks.send([rank0, []])  # rank 1 never answers
    started = time.monotonic()
    with pytest.raises(EngineError) as raised:
        while time.monotonic() - started < WAIT_S:
            engine.step(20)
    message = str(raised.value)
    assert f"fence {fence}: no completion from rank(s) [1] within 0.5 s" in message
    assert "frame watchdog; cost still unknown" in message
    assert stream.result(timeout=0).finish_reason == ERROR


def test_an_error_control_fails_the_frames_in_flight_at_once(rigs) -> None:
    rig = Rig(2)  # the default watchdog: minutes; the error control must not wait for it
    rigs.append(rig)
    engine = rig.engine
    stream = engine.submit([1, 2, 3], 5)
    while not engine.in_flight_fences:
        engine.step(10)
    fence = engine.in_flight_fences[0]
    engine._channel._pub.send(b"\xc1")  # a message no rank can decode
    started = time.monotonic()
    with pytest.raises(EngineError, match=r"rank \d could not decode a message") as raised:
        while time.monotonic() - started < WAIT_S:
            # The ranks read on (the frame first, then the junk, which may arrive a
            # moment later); each answers the junk with an error control.  Their
            # frame's completions are never sent: the frame stays in flight.
            rig.ranks.take(timeout_ms=10)
            engine.step(20)
    assert time.monotonic() - started < 5.0
    assert f"fence(s) {fence}" in str(raised.value)
    assert stream.result(timeout=0).finish_reason == ERROR


def test_rank_gone_fails_the_engine_naming_the_rank_and_the_fences(rigs) -> None:
    rig = Rig(2)
    rigs.append(rig)
    engine = rig.engine
    engine.run_in_thread()
    stream = engine.submit([1, 2, 3], 5)
    wait_for(lambda: engine.in_flight_fences)
    fence = engine.in_flight_fences[0]
    threading.Thread(target=engine.rank_gone, args=(1, "rank 1 exited with code -9")).start()
    result = stream.result(timeout=WAIT_S)
    assert result.finish_reason == ERROR
    assert f"rank 1 exited with code -9; fence(s) {fence}" in str(engine.error)
    assert "unanswered by rank 1" in str(engine.error)


def test_the_engine_binds_a_heartbeat_endpoint_a_bare_channel_none() -> None:
    with CoordinatorChannel(2, transport="tcp", heartbeat=True) as channel:
        assert channel.endpoints.heartbeat.startswith("tcp://127.0.0.1:")
        assert len({channel.endpoints.frames, channel.endpoints.heartbeat}) == 2
    with CoordinatorChannel(1) as channel:  # its ranks run no heartbeat: it sends none
        assert channel.endpoints.heartbeat == ""
        with pytest.raises(Exception, match="heartbeat socket"):
            channel.take_heartbeat_socket()
    engine = Engine(EngineConfig())
    try:
        assert engine.bind().heartbeat.startswith("ipc://")
    finally:
        engine.stop()
    assert ChannelEndpoints("ipc:///a", "ipc:///b").heartbeat == ""
    with pytest.raises(ValueError, match="heartbeat endpoint"):
        ChannelEndpoints("ipc:///a", "ipc:///b", "udp://x")


# ------------------------------------------------------------------ a replayed frame


class ScriptedChannel:
    """The rank loop's channel: scripted messages in, every sent message kept."""

    def __init__(self, messages: list) -> None:
        self.messages = list(messages)
        self.sent: list = []

    def recv(self, timeout_ms=None, spin_us=0):
        return self.messages.pop(0) if self.messages else None

    def send(self, message) -> None:
        self.sent.append(message)


def test_a_replayed_frame_is_refused_naming_its_fence() -> None:
    from runtime.catalog import GraphKind
    from runtime.ranks.capacity import CapacityConfig
    from runtime.ranks.frame_loop import FrameLoop
    from runtime.ranks.model import default_model_dir, load_model
    from runtime.ranks.worker import RankWorker
    from runtime.transport.frame import Frame
    from runtime.transport.sampling import SamplingParams

    capacity = CapacityConfig(max_concurrency=2, min_prefill_tokens=64, max_prefill_tokens=64)
    worker = RankWorker(load_model(default_model_dir()), capacity, num_pages=16, page_size=16)
    kinds = {(d.kind, d.batch_capacity): d for d in worker.catalog}
    prefill, decode = kinds[(GraphKind.PREFILL, 1)], kinds[(GraphKind.DECODE, 1)]
    first = Frame(
        1, prefill, slot=[0], generation=[1], phase=[1], position=[0], query_len=[5],
        commits=[1], prompt_start=[0], prompt_tokens=[5, 17, 33, 3, 60], page_count=[4],
        pages=[0, 1, 2, 3], sampling=((0, SamplingParams()),), expected_ns=1_000_000,
    )  # fmt: skip
    second = Frame(
        2, decode, slot=[0], generation=[1], phase=[0], position=[5], query_len=[1],
        commits=[1], prompt_start=[0], page_count=[0], expected_ns=1_000_000,
    )  # fmt: skip
    channel = ScriptedChannel([first, second, second, first, Control("shutdown", -1)])
    FrameLoop(worker, channel, 0, None).run()
    fences = [(c.fence, c.error) for c in channel.sent]
    assert [f for f, _ in fences] == [1, 2, 2, 1]
    assert fences[0][1] is None and fences[1][1] is None  # the originals ran
    assert fences[2][1] == (
        "rejected: fence 2 replayed: not greater than fence 2, the last frame this rank received"
    )
    assert fences[3][1].startswith("rejected: fence 1 replayed")
    assert worker.frames == 2  # the replays changed nothing
    assert worker.slots.generation[0] == 1


def test_a_rank_lost_before_its_catalog_fails_start_up_at_once() -> None:
    """The heartbeats watch start-up too: a rank that answered the handshake and
    then fell silent (died or hung preparing its programs) ends the wait for its
    catalog at once, naming it, instead of after catalog_timeout_s."""
    engine = Engine(
        EngineConfig(
            world_size=1,
            heartbeat_interval_s=FAST.interval_s,
            heartbeat_timeout_s=FAST.timeout_s,
            require_heartbeats=True,
            handshake_timeout_s=WAIT_S,
            catalog_timeout_s=60.0,
        )
    )
    endpoints = engine.bind()
    done = threading.Event()

    def rank() -> None:
        channel = RankChannel(endpoints, 0)
        try:
            channel.handshake(int(WAIT_S * 1000))
            sock = channel.open_heartbeat_socket()
            assert sock is not None
            beat = RankHeartbeat(sock, 0, FAST, exit_process=False)
            beat.start()
            time.sleep(3 * FAST.interval_s)
            beat.close()  # silent from here on, and no catalog ever comes
            done.wait(WAIT_S)
        finally:
            channel.close()

    thread = threading.Thread(target=rank, daemon=True)
    thread.start()
    started = time.monotonic()
    try:
        with pytest.raises(EngineError, match="rank 0 is gone: no heartbeat") as raised:
            engine.start()
        assert "catalog of rank(s) [0]" in str(raised.value)
        assert time.monotonic() - started < 10.0  # not the 60 s catalog timeout
    finally:
        done.set()
        thread.join(WAIT_S)
        engine.stop()


def test_stop_ends_a_start_running_in_another_thread_before_closing_its_channel() -> None:
    """start() owns the channel while it waits for the ranks: stop() from another
    thread ends that wait first (EngineStartError), instead of closing sockets the
    start thread is still polling (which libzmq does not allow)."""
    engine = Engine(EngineConfig(world_size=2, handshake_timeout_s=60.0))
    engine.bind()
    errors: list[BaseException] = []

    def start() -> None:
        try:
            engine.start()
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=start, daemon=True)
    thread.start()
    time.sleep(0.5)  # the handshake is waiting for ranks that never come
    stopped = time.monotonic()
    engine.stop()
    thread.join(WAIT_S)
    assert not thread.is_alive()
    assert time.monotonic() - stopped < 5.0
    assert len(errors) == 1 and isinstance(errors[0], EngineError), errors
    assert "the engine is stopping" in str(errors[0])
