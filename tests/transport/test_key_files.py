"""Key files (runtime/transport/key_files.py, docs/security.md): ``flare keys``
writes private bundles that load back; existing keys are kept unless forced;
readable secrets, missing and malformed files are refused naming the file."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from runtime.cli import main as flare_main
from runtime.transport.key_files import generate_keys, load_client_keys, load_server_keys
from runtime.transport.security import TransportKeyError, per_run_keys


def _mode(path: Path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_flare_keys_writes_private_bundles_that_load_back(tmp_path: Path) -> None:
    root = tmp_path / "keys"
    assert flare_main(["keys", str(root), "--clients", "2"]) == 0
    coordinator, host0, host1 = root / "coordinator", root / "ranks-0", root / "ranks-1"
    for directory in (root, coordinator, coordinator / "authorized_clients", host0, host1):
        assert _mode(directory) == 0o700, directory
    files = [p for p in root.rglob("*") if p.is_file()]
    assert len(files) == 2 + 2 + 2 * 3  # server pair, 2 authorized publics, 2 x 3 per host
    assert all(_mode(p) == 0o600 for p in files)
    assert not list(host0.glob("server.key_secret")) and not list(coordinator.glob("client*"))

    server = load_server_keys(coordinator)
    clients = [load_client_keys(host0), load_client_keys(host1)]
    assert {c.public for c in clients} == set(server.clients) and len(server.clients) == 2
    assert all(c.server == server.public for c in clients)
    assert clients[0].secret != clients[1].secret
    # The top-level directory is accepted when it names one bundle for the role.
    assert load_server_keys(root) == server
    with pytest.raises(TransportKeyError, match="several key directories"):
        load_client_keys(root)


def test_existing_keys_are_kept_unless_forced(tmp_path: Path) -> None:
    root = tmp_path / "keys"
    generate_keys(root)
    before = load_server_keys(root / "coordinator")
    with pytest.raises(TransportKeyError, match="refusing to overwrite"):
        generate_keys(root)
    assert flare_main(["keys", str(root)]) == 2
    assert load_server_keys(root / "coordinator") == before
    generate_keys(root, clients=1, force=True)
    after = load_server_keys(root / "coordinator")
    assert after.public != before.public and after.clients != before.clients
    assert load_client_keys(root / "ranks-0").public == after.clients[0]


def test_readable_secret_files_are_refused_naming_the_file(tmp_path: Path) -> None:
    root = generate_keys(tmp_path / "keys")
    secret = root / "ranks-0" / "client.key_secret"
    os.chmod(secret, 0o640)
    with pytest.raises(TransportKeyError, match=f"{secret}.*readable by others.*0640"):
        load_client_keys(root / "ranks-0")
    server_secret = root / "coordinator" / "server.key_secret"
    os.chmod(server_secret, 0o604)
    with pytest.raises(TransportKeyError, match=f"{server_secret}.*readable"):
        load_server_keys(root / "coordinator")


def test_missing_and_malformed_key_files_are_named(tmp_path: Path) -> None:
    root = generate_keys(tmp_path / "keys")
    public = root / "ranks-0" / "client.key"
    public.unlink()
    with pytest.raises(TransportKeyError, match=f"{public}: no such key file"):
        load_client_keys(root / "ranks-0")
    public.write_text("not a key\n")
    with pytest.raises(TransportKeyError, match=f"{public}: a z85 key has 40 characters"):
        load_client_keys(root / "ranks-0")
    other = per_run_keys().clients[0]
    public.write_text(other.public + "\n")
    with pytest.raises(TransportKeyError, match="does not belong to its secret key"):
        load_client_keys(root / "ranks-0")
    for old in (root / "coordinator" / "authorized_clients").iterdir():
        old.unlink()
    with pytest.raises(TransportKeyError, match="authorized_clients: no client public key"):
        load_server_keys(root / "coordinator")
    with pytest.raises(TransportKeyError, match="no such key directory"):
        load_server_keys(tmp_path / "absent")
