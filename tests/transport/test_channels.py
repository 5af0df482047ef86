"""ZeroMQ channels over real sockets: handshake, ordered frames, rejection of bad input."""

from __future__ import annotations

import logging
import multiprocessing
import os
import socket
import stat
import threading
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

import msgpack
import pytest
import zmq

from runtime.catalog import GraphDescriptor, GraphKind
from runtime.transport.catalog_report import CatalogReport
from runtime.transport.channels import ChannelEndpoints, EndpointError, HandshakeTimeout
from runtime.transport.codec import encode
from runtime.transport.completion import Completion
from runtime.transport.control import Control
from runtime.transport.coordinator_channel import CoordinatorChannel
from runtime.transport.frame import Frame
from runtime.transport.frame_lane import FrameLane
from runtime.transport.rank_channel import RankChannel
from runtime.transport.schema import PROTOCOL_VERSION
from tests.support import rank_worker
from tests.support import transport_examples as examples

WAIT_MS = 9_000
WAIT_S = WAIT_MS / 1000
FRAMES = 100
WORLD_SIZE = 2
DECODE4 = GraphDescriptor(GraphKind.DECODE, batch_capacity=4)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _frame(fence: int) -> Frame:
    lanes = tuple(
        FrameLane(slot, 1 + fence, "decode", 0, (), 10 + fence, (slot,), 1)
        for slot in range(1 + fence % 4)
    )
    return Frame.from_lanes(fence, DECODE4, lanes, release_slots=(8,) if fence % 10 == 0 else ())


@pytest.fixture
def coordinator_factory() -> Iterator[Any]:
    made: list[CoordinatorChannel] = []

    def make(world_size: int = WORLD_SIZE, **kwargs: Any) -> CoordinatorChannel:
        made.append(CoordinatorChannel(world_size, **kwargs))
        return made[-1]

    yield make
    for channel in made:
        channel.close()


# ---------------------------------------------------------------- two ranks, two processes


@pytest.mark.parametrize("transport", ["ipc", "tcp"])
@pytest.mark.process
def test_two_rank_processes_receive_every_frame_in_order(
    transport: str, coordinator_factory: Any
) -> None:
    kwargs: dict[str, Any] = {"transport": transport}
    if transport == "tcp":
        kwargs.update(frame_port=_free_port(), completion_port=_free_port())
    coordinator = coordinator_factory(**kwargs)
    endpoints = coordinator.endpoints
    if transport == "tcp":
        assert endpoints.frames == f"tcp://127.0.0.1:{kwargs['frame_port']}"
        assert endpoints.completions == f"tcp://127.0.0.1:{kwargs['completion_port']}"
    else:
        assert endpoints.frames.startswith(f"ipc://{coordinator.run_dir}/")

    spawn = multiprocessing.get_context("spawn")
    ranks = [
        spawn.Process(
            target=rank_worker.main,
            args=(endpoints.frames, endpoints.completions, rank, WORLD_SIZE, FRAMES),
            daemon=True,
        )
        for rank in range(WORLD_SIZE)
    ]
    try:
        for process in ranks:
            process.start()
        coordinator.handshake(timeout_s=WAIT_S)

        # Catalog reports sent right after each rank's ready are kept for recv.
        reports = [coordinator.recv(timeout_ms=WAIT_MS) for _ in range(WORLD_SIZE)]
        assert all(isinstance(r, CatalogReport) for r in reports)
        assert sorted(r.rank for r in reports) == list(range(WORLD_SIZE))

        for fence in range(FRAMES):
            coordinator.publish(_frame(fence))

        by_fence: dict[int, dict[int, Completion]] = defaultdict(dict)
        for _ in range(FRAMES * WORLD_SIZE):
            message = coordinator.recv(timeout_ms=WAIT_MS)
            assert isinstance(message, Completion), message
            assert message.rank not in by_fence[message.fence]
            by_fence[message.fence][message.rank] = message
        assert coordinator.recv(timeout_ms=0) is None
        assert sorted(by_fence) == list(range(FRAMES))
        for fence, completions in by_fence.items():
            assert sorted(completions) == list(range(WORLD_SIZE))
            frame = _frame(fence)
            expected = rank_worker.completion_for(frame, 0, WORLD_SIZE)
            assert completions[0] == expected
            assert [lane.tokens for lane in completions[0].lane_results()] == [
                (rank_worker.token_for(fence, lane.slot),) for lane in frame.lanes
            ]
            assert completions[1].num_lanes == 0 and completions[1].sidecars == {}
        assert coordinator.rejected == 0

        coordinator.shutdown_ranks()
        for process in ranks:
            process.join(timeout=WAIT_S)
        assert [p.exitcode for p in ranks] == [rank_worker.EXIT_OK] * WORLD_SIZE
    finally:
        for process in ranks:
            if process.is_alive():
                process.kill()
                process.join(timeout=WAIT_S)


# ---------------------------------------------------------------- handshake


def _answer_pings(rank: RankChannel, stop: threading.Event) -> None:
    while not stop.is_set():
        rank.recv(timeout_ms=20)


def test_handshake_timeout_names_the_missing_ranks(coordinator_factory: Any) -> None:
    coordinator = coordinator_factory(world_size=3)
    stop = threading.Event()
    with RankChannel(coordinator.endpoints, 1) as present:
        thread = threading.Thread(target=_answer_pings, args=(present, stop))
        thread.start()
        try:
            with pytest.raises(HandshakeTimeout) as raised:
                coordinator.handshake(timeout_s=0.5)
        finally:
            stop.set()
            thread.join(timeout=WAIT_S)
    assert raised.value.missing_ranks == (0, 2)
    assert "rank(s) [0, 2]" in str(raised.value)


def test_rank_handshake_times_out_without_a_coordinator(coordinator_factory: Any) -> None:
    coordinator = coordinator_factory(world_size=1)
    with RankChannel(coordinator.endpoints, 0) as rank, pytest.raises(HandshakeTimeout):
        rank.handshake(timeout_ms=100)


def _handshake_in_process(coordinator: CoordinatorChannel, rank: RankChannel) -> None:
    thread = threading.Thread(target=rank.handshake, kwargs={"timeout_ms": WAIT_MS})
    thread.start()
    coordinator.handshake(timeout_s=WAIT_S)
    thread.join(timeout=WAIT_S)


def test_handshake_in_process_then_frames_and_late_readies(coordinator_factory: Any) -> None:
    coordinator = coordinator_factory(world_size=1)
    with RankChannel(coordinator.endpoints, 0) as rank:
        _handshake_in_process(coordinator, rank)
        # Pings still queued at the rank are answered inside recv, never returned.
        coordinator.publish(_frame(0))
        assert rank.recv(timeout_ms=WAIT_MS) == _frame(0)
        rank.send(Completion(0, 0, 1, device_ns=5))
        # A late ready is dropped by the coordinator without complaint.
        assert coordinator.recv(timeout_ms=WAIT_MS) == Completion(0, 0, 1, device_ns=5)
        assert coordinator.rejected == 0 and rank.rejected == 0


def test_spinning_receive_gets_messages_and_still_times_out(coordinator_factory: Any) -> None:
    coordinator = coordinator_factory(world_size=1)
    with RankChannel(coordinator.endpoints, 0) as rank:
        _handshake_in_process(coordinator, rank)
        for fence in range(3):
            coordinator.publish(_frame(fence))
            assert rank.recv(timeout_ms=WAIT_MS, spin_us=2000) == _frame(fence)
            rank.send(Completion(fence, 0, 1, device_ns=5))
            assert coordinator.recv(timeout_ms=WAIT_MS, spin_us=2000).fence == fence
        # Nothing sent: the spin ends, the blocking wait ends at the timeout.
        assert rank.recv(timeout_ms=30, spin_us=1000) is None
        assert coordinator.recv(timeout_ms=0, spin_us=1000) is None


# ---------------------------------------------------------------- malformed input

MALFORMED = [
    pytest.param([b"\xc1garbage"], "malformed msgpack", id="not-msgpack"),
    pytest.param(
        [msgpack.packb({"v": 1, "t": "Control", "b": {}})], "protocol version 1", id="version"
    ),
    pytest.param(
        [msgpack.packb({"v": PROTOCOL_VERSION, "t": "Evil", "b": {}})], "unknown message", id="type"
    ),
    pytest.param([b"\x80\x04\x95\x00"], "malformed msgpack", id="pickle"),
    pytest.param([encode(Control("ready", 1, 1))[:-2]], "malformed msgpack", id="truncated"),
    pytest.param([encode(Control("ping")), b"x"], "multipart", id="multipart"),
    pytest.param([encode(_frame(1))], "unexpected Frame", id="misdirected-frame"),
    pytest.param([encode(Completion(1, 0, 3, 5))], "world size 3", id="wrong-world-size"),
    pytest.param([encode(Control("ready", 5, 1))], "rank 5", id="control-from-unknown-rank"),
]


@pytest.mark.parametrize(("parts", "reason"), MALFORMED)
def test_coordinator_skips_malformed_message_and_keeps_serving(
    parts: list[bytes], reason: str, coordinator_factory: Any, caplog: pytest.LogCaptureFixture
) -> None:
    coordinator = coordinator_factory(world_size=2)
    context = zmq.Context()
    push = context.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    try:
        push.connect(coordinator.endpoints.completions)
        with caplog.at_level(logging.WARNING, logger="runtime.transport"):
            push.send_multipart(parts)
            valid = Completion(3, 1, 2, device_ns=77)
            push.send(encode(valid))
            assert coordinator.recv(timeout_ms=WAIT_MS) == valid
    finally:
        push.close()
        context.term()
    assert coordinator.rejected == 1
    (record,) = [r for r in caplog.records if r.name == "runtime.transport"]
    assert record.levelno == logging.WARNING
    assert reason in record.getMessage()


def test_rank_skips_malformed_message_and_keeps_serving(
    tmp_path: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """A stand-in coordinator made of raw sockets sends garbage to a rank."""
    endpoints = ChannelEndpoints(
        frames=f"ipc://{tmp_path}/frames", completions=f"ipc://{tmp_path}/completions"
    )
    context = zmq.Context()
    pub, pull = context.socket(zmq.PUB), context.socket(zmq.PULL)
    try:
        for sock in (pub, pull):
            sock.setsockopt(zmq.LINGER, 0)
        pub.bind(endpoints.frames)
        pull.bind(endpoints.completions)
        with RankChannel(endpoints, 0) as rank:
            for _ in range(WAIT_MS // 20):  # hand-made handshake: ping until ready comes
                pub.send(encode(Control("ping", nonce=7)))
                assert rank.recv(timeout_ms=10) is None  # pings are answered, not returned
                if pull.poll(10):
                    break
            assert Control.from_wire(msgpack.unpackb(pull.recv())["b"]) == Control("ready", 0, 7)
            with caplog.at_level(logging.WARNING, logger="runtime.transport"):
                pub.send(b"not msgpack at all")
                pub.send(msgpack.packb({"v": 0, "t": "Frame", "b": _frame(2).to_wire()}))
                pub.send(encode(Control("ping", rank=1, nonce=7)))  # control from a rank
                pub.send(encode(examples.completion()))  # misdirected
                pub.send(encode(_frame(2)))
                assert rank.recv(timeout_ms=WAIT_MS) == _frame(2)
            assert rank.rejected == 4
            reasons = [r.getMessage() for r in caplog.records if r.name == "runtime.transport"]
            assert len(reasons) == 4
            for expected in ("malformed msgpack", "protocol version 0", "rank 1", "Completion"):
                assert any(expected in reason for reason in reasons), (expected, reasons)
    finally:
        pub.close()
        pull.close()
        context.term()


# ---------------------------------------------------------------- endpoints and lifecycle


@pytest.mark.parametrize("host", ["0.0.0.0", "*", "", "::", "10.1.2.3", "192.168.0.7"])
def test_non_loopback_bind_is_refused_without_allow_remote(host: str) -> None:
    with pytest.raises(EndpointError, match="allow_remote"):
        CoordinatorChannel(1, transport="tcp", host=host)


@pytest.mark.parametrize("host", ["eth0", "example.com", "1.2.3"])
def test_host_must_be_an_address(host: str) -> None:
    with pytest.raises(EndpointError, match="IP address"):
        CoordinatorChannel(1, transport="tcp", host=host)


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "127.0.0.2"])
def test_loopback_tcp_binds_any_free_port(host: str, coordinator_factory: Any) -> None:
    coordinator = coordinator_factory(world_size=1, transport="tcp", host=host)
    address = "127.0.0.1" if host == "localhost" else host
    assert coordinator.endpoints.frames.startswith(f"tcp://{address}:")
    assert coordinator.endpoints.frames != coordinator.endpoints.completions
    assert coordinator.run_dir is None


def test_ipc_run_directory_is_private_and_removed_on_close(short_tmp: Any) -> None:
    coordinator = CoordinatorChannel(1, run_dir=str(short_tmp))
    run_dir = coordinator.run_dir
    assert run_dir is not None and os.path.dirname(run_dir) == str(short_tmp)
    assert stat.S_IMODE(os.stat(run_dir).st_mode) == 0o700
    assert coordinator.endpoints == ChannelEndpoints(
        frames=f"ipc://{run_dir}/frames", completions=f"ipc://{run_dir}/completions"
    )
    coordinator.close()
    coordinator.close()  # idempotent
    assert not os.path.exists(run_dir)
    assert coordinator.closed


def test_failed_bind_cleans_up(coordinator_factory: Any) -> None:
    first = coordinator_factory(world_size=1, transport="tcp")
    port = int(first.endpoints.frames.rsplit(":", 1)[1])
    with pytest.raises(Exception, match="cannot bind"):
        CoordinatorChannel(1, transport="tcp", frame_port=port)


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="world_size"):
        CoordinatorChannel(0)
    with pytest.raises(EndpointError, match="transport"):
        CoordinatorChannel(1, transport="udp")
    with pytest.raises(EndpointError, match="frame_port"):
        CoordinatorChannel(1, transport="tcp", frame_port=70_000)
    with pytest.raises(EndpointError, match="frames"):
        ChannelEndpoints(frames="inproc://x", completions="ipc:///tmp/x")


def test_send_paths_check_direction_and_rank(coordinator_factory: Any) -> None:
    coordinator = coordinator_factory(world_size=2)
    with pytest.raises(TypeError):
        coordinator.publish(examples.completion())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="rank"):
        coordinator.publish(Control("ping", rank=0))
    with RankChannel(coordinator.endpoints, 1) as rank:
        with pytest.raises(ValueError, match="rank 0"):
            rank.send(examples.completion())  # rank 0's completion from rank 1
        with pytest.raises(TypeError):
            rank.send(examples.frame())  # type: ignore[arg-type]
    coordinator.close()
    with pytest.raises(Exception, match="closed"):
        coordinator.publish(Control("shutdown"))
    with pytest.raises(Exception, match="closed"):
        coordinator.recv(timeout_ms=0)
