"""Reading the rank processes' messages on a coordinator channel."""

from __future__ import annotations

from runtime.transport.coordinator_channel import CoordinatorChannel


def collect(channel: CoordinatorChannel, kind, count: int, timeout_ms=60_000) -> list:
    got = []
    while len(got) < count:
        message = channel.recv(timeout_ms=timeout_ms)
        assert message is not None, f"timed out waiting for {kind.__name__}"
        if isinstance(message, kind):
            got.append(message)
    return sorted(got, key=lambda m: (getattr(m, "fence", 0), m.rank))
