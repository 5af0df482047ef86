"""``--ranks external`` settings: validation naming the field, the addresses the
coordinator binds, and the rank command it logs (runtime/deploy/external.py)."""

from __future__ import annotations

import pytest

from runtime.deploy.config import DeploymentConfig
from runtime.deploy.external import ExternalRanks, bind_address, external_channel
from runtime.deploy.local import external_rank_command
from runtime.transport.channels import ChannelEndpoints
from runtime.transport.security import per_run_keys


def test_defaults_are_fixed_ports_on_loopback_and_a_long_handshake() -> None:
    external = ExternalRanks(world_size=2)
    assert (external.frames_port, external.completions_port, external.heartbeat_port) == (
        29600,
        29601,
        29602,
    )
    assert external.handshake_timeout_s >= 1800  # a 70B load from network storage
    channel = external_channel(external)
    assert channel["endpoints"].frames == "tcp://127.0.0.1:29600"
    assert channel["endpoints"].completions == "tcp://127.0.0.1:29601"
    assert channel["endpoints"].heartbeat == "tcp://127.0.0.1:29602"
    assert channel["allow_remote"] is False
    assert external_channel(None) == {}


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"world_size": 0}, ["world_size", "1..64"]),
        ({"world_size": 2, "frames_port": 70000}, ["frames_port", "65535"]),
        ({"world_size": 2, "heartbeat_port": 29600}, ["ports must differ"]),
        ({"world_size": 2, "bind_host": "0.0.0.0"}, ["bind_host", "allow_remote"]),
        ({"world_size": 2, "bind_host": "10.1.2.3"}, ["not a loopback address"]),
        ({"world_size": 2, "bind_host": "node7"}, ["bind_host", "IP address", "node7"]),
        ({"world_size": 2, "handshake_timeout_s": 0}, ["handshake_timeout_s"]),
        ({"world_size": 2, "handshake_timeout_s": float("inf")}, ["handshake_timeout_s"]),
    ],
)
def test_bad_settings_name_the_field(kwargs: dict, words: list[str]) -> None:
    with pytest.raises(ValueError) as info:
        ExternalRanks(**kwargs)
    for word in words:
        assert word in str(info.value)


def test_remote_addresses_need_allow_remote_and_ipv6_is_bracketed() -> None:
    external = ExternalRanks(world_size=2, bind_host="0.0.0.0", allow_remote=True)
    assert external.endpoint(29600) == "tcp://0.0.0.0:29600"
    six = ExternalRanks(world_size=2, bind_host="::1")
    assert six.endpoint(29601) == "tcp://[::1]:29601"
    assert bind_address("localhost").is_loopback
    assert str(bind_address("*")) == "0.0.0.0"


def test_the_logged_rank_command_names_every_endpoint_and_the_catalog_flags() -> None:
    external = ExternalRanks(world_size=2, bind_host="0.0.0.0", allow_remote=True)
    config = DeploymentConfig(
        tensor_parallel_size=2,
        max_concurrency=8,
        num_pages=64,
        device="cpu",
        external=external,
        transport_keys=per_run_keys().server,
    )
    endpoints = ChannelEndpoints(
        frames="tcp://0.0.0.0:29600",
        completions="tcp://0.0.0.0:29601",
        heartbeat="tcp://0.0.0.0:29602",
    )
    command = external_rank_command(endpoints, config)
    text = " ".join(command)
    assert command[:2] == ["torchrun", "--nnodes"]
    # A wildcard bind address is no address a rank can reach: HOST stands for it.
    assert "--frames-endpoint tcp://HOST:29600" in text
    assert "--completions-endpoint tcp://HOST:29601" in text
    assert "--heartbeat-endpoint tcp://HOST:29602" in text
    assert "--transport-keys KEYS_DIR/ranks-K" in text
    # The flags that decide the ranks' catalog must match on every node.
    assert "--max-concurrency 8" in text and "--num-pages 64" in text
    assert "--device cpu" in text


def test_world_size_must_equal_the_tensor_parallel_size() -> None:
    with pytest.raises(ValueError, match="world_size 4 must equal tensor_parallel_size 2"):
        DeploymentConfig(
            tensor_parallel_size=2,
            external=ExternalRanks(world_size=4),
            insecure_transport=True,
        )
