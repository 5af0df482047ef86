"""The frontend's side of the coordinator link (runtime/frontend/client.py) against a
stand-in coordinator on real ZeroMQ sockets: while the coordinator does not read,
nothing the frontend sends is refused or dropped (its outbox keeps it, in order);
a status carrying an error marks the coordinator failed; a lost coordinator ends
open requests as errors, not as aborts."""

from __future__ import annotations

import asyncio

import pytest
import zmq

from runtime.frontend.client import CoordinatorClient, CoordinatorGone, LocalEnd
from runtime.transport.api import Cancel, Heartbeat, Publish, Status, Submit
from runtime.transport.channels import HIGH_WATER_MARK, make_socket
from runtime.transport.codec import decode, encode
from runtime.transport.sampling import SamplingParams

READY = Status(0, True, "m", 100, 4096, 1, 4)


class Coordinator:
    """The coordinator's two sockets, connected to a client's endpoints."""

    def __init__(self, client: CoordinatorClient) -> None:
        self.context = zmq.Context()
        self.inbox = make_socket(self.context, zmq.PULL)
        self.outbox = make_socket(self.context, zmq.PUSH)
        self.inbox.connect(client.endpoints.requests)
        self.outbox.connect(client.endpoints.outputs)

    def say(self, message: object) -> None:
        self.outbox.send(encode(message))

    async def read(self, count: int, limit_s: float = 30.0) -> list[object]:
        """``count`` messages, reading without blocking the event loop (the client's
        writer runs on it)."""
        got: list[object] = []
        deadline = asyncio.get_running_loop().time() + limit_s
        while len(got) < count:
            try:
                got.append(decode(self.inbox.recv(zmq.NOBLOCK)))
            except zmq.Again:
                assert asyncio.get_running_loop().time() < deadline, f"{len(got)} of {count}"
                await asyncio.sleep(0.001)
        return got

    def close(self) -> None:
        self.inbox.close(linger=0)
        self.outbox.close(linger=0)
        self.context.term()


async def connected() -> tuple[CoordinatorClient, Coordinator]:
    client = CoordinatorClient()
    coordinator = Coordinator(client)
    coordinator.say(READY)
    await client.wait_ready(10)
    return client, coordinator


def test_nothing_sent_is_refused_or_dropped_while_the_coordinator_does_not_read():
    count = 5 * HIGH_WATER_MARK  # beyond both sockets' queues

    async def go() -> None:
        client, coordinator = await connected()
        try:
            for rid in range(1, count + 1):  # the coordinator reads nothing meanwhile
                client.submit(rid, (1, 2, 3), 4, SamplingParams(), group=rid // 16)
            client.publish(7, 3, 123)
            client.cancel(5)
            assert client.queued > 0  # the sockets took what they could; the rest waits
            got = await coordinator.read(count + 2)
            assert [type(m) for m in got] == [Submit] * count + [Publish, Cancel]
            assert [m.request_id for m in got] == [*range(1, count + 1), 7, 5]  # in order
            assert client.queued == 0
            assert client.open_requests == count - 1  # request 5 was cancelled
        finally:
            await client.close()
            coordinator.close()

    asyncio.run(go())


def test_a_status_with_an_error_marks_the_coordinator_failed_and_lose_ends_work_as_errors():
    async def go() -> None:
        client, coordinator = await connected()
        try:
            queues = [client.submit(rid, (1,), 2, SamplingParams()) for rid in (1, 2)]
            coordinator.say(Heartbeat(1, False))
            coordinator.say(Status(0, False, "m", 100, 4096, 1, 4, error="rank 1 exited"))
            await asyncio.sleep(0.2)  # the reader routes them
            assert not client.serving and client.failure == "rank 1 exited"
            with pytest.raises(CoordinatorGone, match="rank 1 exited"):
                client.submit(3, (1,), 2, SamplingParams())
            # The coordinator process exits: the open requests' work is lost.
            assert client.lose("the coordinator exited with code 1") == 2
            for queue in queues:
                assert queue.get_nowait() == LocalEnd("the coordinator exited with code 1", True)
            with pytest.raises(CoordinatorGone):
                client.cancel(1)  # nothing more is sent
            assert client.failure == "the coordinator exited with code 1"
        finally:
            await client.close()
            coordinator.close()

    asyncio.run(go())


def test_an_operator_stop_still_ends_open_requests_as_aborted():
    async def go() -> None:
        client, coordinator = await connected()
        try:
            queue = client.submit(1, (1,), 2, SamplingParams())
            client.abort_all()
            end = queue.get_nowait()
            assert end == LocalEnd() and end.error is None and not end.failed
        finally:
            await client.close()
            coordinator.close()

    asyncio.run(go())
