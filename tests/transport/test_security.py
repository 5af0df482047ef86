"""CURVE transport security: authenticated channels, refused peers, bounded messages
(runtime/transport/security.py, runtime/transport/gatekeeper.py, docs/security.md);
the key files are test_key_files.py's."""

from __future__ import annotations

import argparse
import contextlib
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq

from runtime.catalog import GraphDescriptor, GraphKind
from runtime.cli.flags.security import rank_keys, transport_config
from runtime.ranks.watchdog import Watchdog
from runtime.transport.channels import MAX_SOCKET_MESSAGE_BYTES, ChannelEndpoints, HandshakeTimeout
from runtime.transport.codec import MAX_MESSAGE_BYTES, encode
from runtime.transport.completion import Completion
from runtime.transport.coordinator_channel import CoordinatorChannel
from runtime.transport.frame import Frame
from runtime.transport.frame_lane import FrameLane
from runtime.transport.key_files import generate_keys, load_client_keys, load_server_keys
from runtime.transport.rank_channel import RankChannel
from runtime.transport.security import (
    ENV_CLIENT_PUBLIC,
    ENV_CLIENT_SECRET,
    ENV_SERVER_KEY,
    ClientKeys,
    DeploymentKeys,
    ServerKeys,
    TransportKeyError,
    per_run_keys,
    secure_client,
)

WAIT_S = 10.0
REFUSED_MS = 1500  # how long a refused peer waits for anything to come through
DECODE4 = GraphDescriptor(GraphKind.DECODE, batch_capacity=4)


def _frame(fence: int) -> Frame:
    lanes = (FrameLane(0, 1, "decode", 0, (), 10 + fence, (0,), 1),)
    return Frame.from_lanes(fence, DECODE4, lanes)


def test_environment_handoff_round_trips_and_is_removed() -> None:
    keys = per_run_keys(clients=2)
    assert len(keys.server.clients) == 2 and keys.clients[1].public == keys.server.clients[1]
    client = keys.clients[0]
    env = dict(client.environment(), OTHER="x")
    assert ClientKeys.from_environment(env) == client
    assert env == {"OTHER": "x"}  # the secret leaves the environment once read
    assert ClientKeys.from_environment(env) is None
    partial = {ENV_SERVER_KEY: client.server, ENV_CLIENT_PUBLIC: client.public}
    with pytest.raises(TransportKeyError, match=ENV_CLIENT_SECRET):
        ClientKeys.from_environment(partial)
    assert "secret" not in repr(client).replace("secret=", "") or client.secret not in repr(client)
    assert keys.server.secret not in repr(keys.server)


def test_rank_flags_require_keys_over_tcp(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    parser = argparse.ArgumentParser(prog="python -m runtime.ranks")

    def args(**kw: Any) -> argparse.Namespace:
        base = {"frames_endpoint": "tcp://127.0.0.1:1", "completions_endpoint": "tcp://1.2.3.4:2"}
        return argparse.Namespace(
            **base, heartbeat_endpoint=None, transport_keys=None, insecure_transport=False, **kw
        )

    for name in (ENV_SERVER_KEY, ENV_CLIENT_PUBLIC, ENV_CLIENT_SECRET):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(SystemExit):
        rank_keys(args(), parser)
    assert rank_keys(argparse.Namespace(**{**vars(args()), "insecure_transport": True}),
                     parser) is None  # fmt: skip
    client = per_run_keys().clients[0]
    for name, value in client.environment().items():
        monkeypatch.setenv(name, value)
    assert rank_keys(args(), parser) == client
    assert ENV_CLIENT_SECRET not in os.environ  # no child process inherits it
    root = generate_keys(tmp_path / "keys")
    namespace = argparse.Namespace(**{**vars(args()), "transport_keys": str(root / "ranks-0")})
    assert rank_keys(namespace, parser) == load_client_keys(root / "ranks-0")


def test_run_flags_external_ranks_need_keys_or_an_explicit_opt_out(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser(prog="flare run")
    root = generate_keys(tmp_path / "keys")

    def run(**kw: Any) -> dict:
        base = {"ranks": "external", "transport_keys": None, "insecure_transport": False}
        return transport_config(argparse.Namespace(**{**base, **kw}), parser)

    with pytest.raises(SystemExit):
        run()
    with pytest.raises(SystemExit):
        run(transport_keys=str(root / "coordinator"), insecure_transport=True)
    with pytest.raises(SystemExit):
        run(ranks="local", transport_keys=str(root / "coordinator"))
    assert run(insecure_transport=True) == {"insecure_transport": True}
    assert run(transport_keys=str(root)) == {"transport_keys": load_server_keys(root)}
    assert run(ranks="local") == {}


# ---------------------------------------------------------------- CURVE channels


@pytest.fixture
def keys() -> DeploymentKeys:
    return per_run_keys()


@pytest.fixture
def secure(keys: DeploymentKeys) -> Iterator[CoordinatorChannel]:
    coordinator = CoordinatorChannel(1, transport="tcp", keys=keys.server)
    yield coordinator
    coordinator.close()


def _rank_answers(rank: RankChannel, timeout_ms: int) -> tuple[threading.Thread, list]:
    """The rank's handshake in a thread (it answers pings while the coordinator waits)."""
    outcome: list = []

    def answer() -> None:
        try:
            rank.handshake(timeout_ms=timeout_ms)
            outcome.append("ok")
        except HandshakeTimeout as exc:
            outcome.append(exc)

    thread = threading.Thread(target=answer, daemon=True)
    thread.start()
    return thread, outcome


def _refused(coordinator: CoordinatorChannel, client: ClientKeys | None) -> list[str]:
    """A rank with ``client`` keys gets nothing through; the reasons the coordinator logged."""
    before = coordinator.auth_denied
    rank = RankChannel(coordinator.endpoints, 0, keys=client)
    try:
        rank.send(Completion(fence=1, rank=0, world_size=1, device_ns=1))
        thread, outcome = _rank_answers(rank, REFUSED_MS)
        with pytest.raises(HandshakeTimeout):
            coordinator.handshake(timeout_s=REFUSED_MS / 1000)
        thread.join(WAIT_S)
        assert len(outcome) == 1 and isinstance(outcome[0], HandshakeTimeout)  # no ping came
        coordinator.publish(_frame(1))
        assert rank.recv(timeout_ms=200) is None
        assert coordinator.recv(timeout_ms=0) is None
        deadline = time.monotonic() + WAIT_S
        while coordinator.auth_denied == before:
            assert time.monotonic() < deadline, "the refusal was not counted"
            time.sleep(0.02)
        return list(coordinator._gatekeeper.recent)  # type: ignore[union-attr]
    finally:
        rank.close()


def test_a_rank_with_the_deployment_keys_handshakes_and_talks(
    secure: CoordinatorChannel, keys: DeploymentKeys
) -> None:
    with RankChannel(secure.endpoints, 0, keys=keys.clients[0]) as rank:
        thread, outcome = _rank_answers(rank, int(WAIT_S * 1000))
        secure.handshake(timeout_s=WAIT_S)
        thread.join(WAIT_S)
        assert outcome == ["ok"]
        secure.publish(_frame(7))
        frame = rank.recv(timeout_ms=int(WAIT_S * 1000))
        assert isinstance(frame, Frame) and frame.fence == 7
        rank.send(Completion(fence=7, rank=0, world_size=1, device_ns=5))
        completion = secure.recv(timeout_ms=int(WAIT_S * 1000))
        assert isinstance(completion, Completion) and completion.fence == 7
    assert secure.auth_denied == 0 and secure.rejected == 0


def test_a_client_key_the_deployment_does_not_admit_is_refused(secure: CoordinatorChannel) -> None:
    stranger = per_run_keys().clients[0]
    impostor = ClientKeys(secure.keys.public, stranger.public, stranger.secret)  # type: ignore[union-attr]
    reasons = _refused(secure, impostor)
    assert any("is not one of the 1 this deployment admits" in r for r in reasons), reasons


def test_a_peer_without_keys_is_refused(secure: CoordinatorChannel) -> None:
    reasons = _refused(secure, None)
    # The server sees the mechanism mismatch, or the keyless peer closing on seeing it.
    assert any("a peer without CURVE keys" in r for r in reasons), reasons


def test_a_peer_with_the_wrong_server_key_is_refused(
    secure: CoordinatorChannel, keys: DeploymentKeys
) -> None:
    client = keys.clients[0]
    wrong = ClientKeys(per_run_keys().server.public, client.public, client.secret)
    reasons = _refused(secure, wrong)
    assert any("failed to decrypt" in r for r in reasons), reasons


def test_the_rank_watchdog_reports_through_curve(
    secure: CoordinatorChannel, keys: DeploymentKeys
) -> None:
    watchdog = Watchdog(
        secure.endpoints.completions, 0, 1, exit_process=False, tick_s=0.01, keys=keys.clients[0]
    )
    try:
        watchdog.arm(fence=3, limit_ns=1, expected_ns=1)
        message = secure.recv(timeout_ms=int(WAIT_S * 1000))
        assert isinstance(message, Completion) and message.fence == 3
        assert message.error and "hung" in message.error
    finally:
        watchdog.close()
    assert secure.auth_denied == 0


def test_heartbeat_sockets_are_curve_too(keys: DeploymentKeys) -> None:
    coordinator = CoordinatorChannel(1, transport="tcp", heartbeat=True, keys=keys.server)
    router = coordinator.take_heartbeat_socket()
    ranks = [RankChannel(coordinator.endpoints, 0, keys=k) for k in (keys.clients[0], None)]
    dealers = [rank.open_heartbeat_socket() for rank in ranks]
    try:
        assert all(d is not None for d in dealers)
        for i, dealer in enumerate(dealers):
            with contextlib.suppress(zmq.Again):  # the keyless one may be refused already
                dealer.send(b"beat %d" % i, zmq.NOBLOCK)  # type: ignore[union-attr]
        assert router.poll(int(WAIT_S * 1000))
        assert router.recv_multipart()[1:] == [b"beat 0"]  # the keyless DEALER's never comes
        assert not router.poll(REFUSED_MS)
        assert coordinator.auth_denied >= 1
    finally:
        for dealer in dealers:
            dealer.close(linger=0)  # type: ignore[union-attr]
        router.close(linger=0)
        for rank in ranks:
            rank.close()
        coordinator.close()


def test_server_keys_validate_their_fields() -> None:
    keys = per_run_keys()
    with pytest.raises(TransportKeyError, match="admits no client key"):
        ServerKeys(keys.server.public, keys.server.secret, ())
    with pytest.raises(TransportKeyError, match="listed twice"):
        ServerKeys(keys.server.public, keys.server.secret, keys.server.clients * 2)
    with pytest.raises(TransportKeyError, match="does not belong"):
        ServerKeys(keys.clients[0].public, keys.server.secret, keys.server.clients)
    with pytest.raises(TypeError, match="ServerKeys"):
        CoordinatorChannel(1, transport="tcp", keys=keys.clients[0])  # type: ignore[arg-type]


# ---------------------------------------------------------------- bounded messages


@pytest.mark.parametrize("curve", [False, True], ids=["plain", "curve"])
def test_an_oversize_message_is_refused_and_the_channel_keeps_serving(curve: bool) -> None:
    keys = per_run_keys() if curve else None
    coordinator = CoordinatorChannel(1, transport="tcp", keys=keys.server if keys else None)
    context = zmq.Context()
    raw = context.socket(zmq.PUSH)
    raw.setsockopt(zmq.LINGER, 0)
    try:
        if keys is not None:  # an authenticated peer gets no more than the limit either
            secure_client(raw, keys.clients[0])
        raw.connect(coordinator.endpoints.completions)
        assert MAX_SOCKET_MESSAGE_BYTES < MAX_MESSAGE_BYTES + 65536
        raw.send(b"\x00" * (MAX_SOCKET_MESSAGE_BYTES + 1))
        assert coordinator.recv(timeout_ms=1000) is None
        with RankChannel(coordinator.endpoints, 0, keys=keys.clients[0] if keys else None) as rank:
            rank.send(Completion(fence=9, rank=0, world_size=1, device_ns=1))
            message = coordinator.recv(timeout_ms=int(WAIT_S * 1000))
            assert isinstance(message, Completion) and message.fence == 9
        # ZeroMQ refused it while it arrived: the decoder never saw it.
        assert coordinator.rejected == 0
        # A message within the limit from the same kind of peer is still decoded (and
        # rejected as garbage), so the refusal above was the size, not the peer.
        raw.send(encode(Completion(fence=10, rank=0, world_size=1, device_ns=1))[:-1])
        deadline = time.monotonic() + WAIT_S
        while coordinator.rejected == 0:
            assert coordinator.recv(timeout_ms=100) is None
            assert time.monotonic() < deadline, "the small message never arrived"
    finally:
        raw.close()
        context.term()
        coordinator.close()


def test_an_unauthenticated_engine_over_tcp_gets_per_run_keys() -> None:
    from runtime.coordinator.engine import Engine, EngineConfig

    endpoints = ChannelEndpoints("tcp://127.0.0.1:0", "tcp://127.0.0.1:0")
    engine = Engine(EngineConfig(endpoints=endpoints))
    try:
        client = engine.rank_keys()
        assert client is not None
        assert engine._channel is not None and engine._channel.keys is not None
        assert engine._channel.keys.clients == (client.public,)
        assert engine.metrics()["transport_auth_denied_total"] == 0
    finally:
        engine.stop()
    insecure = Engine(EngineConfig(endpoints=endpoints, insecure_transport=True))
    try:
        assert insecure.rank_keys() is None
    finally:
        insecure.stop()
    ipc = Engine(EngineConfig())
    try:
        assert ipc.rank_keys() is None  # ipc: its 0700 directory, no CURVE
    finally:
        ipc.stop()
