"""A stand-in rank for the socket tests, run in a spawned process.

It answers the handshake, reports a catalog, then answers every frame with a
Completion until shutdown.  Its exit code tells the test what went wrong.
"""

from __future__ import annotations

import dataclasses
import sys

from runtime.transport.channels import ChannelEndpoints
from runtime.transport.completion import Completion, LaneResult
from runtime.transport.control import Control
from runtime.transport.frame import Frame
from runtime.transport.rank_channel import RankChannel
from tests.support import transport_examples as examples

EXIT_OK = 0
EXIT_NO_PING = 3
EXIT_TIMEOUT = 4
EXIT_OUT_OF_ORDER = 5
EXIT_UNEXPECTED = 6
WAIT_MS = 9_000


def token_for(fence: int, slot: int) -> int:
    return fence * 64 + slot


def completion_for(frame: Frame, rank: int, world_size: int) -> Completion:
    if rank != 0:
        return Completion(frame.fence, rank, world_size, device_ns=frame.fence + 100 * rank)
    lanes = tuple(
        LaneResult(lane.slot, lane.generation, (token_for(frame.fence, lane.slot),))
        for lane in frame.lanes
    )
    return Completion.from_results(
        frame.fence,
        rank,
        world_size,
        device_ns=frame.fence + 1,
        lanes=lanes,
        sidecars={"confidence": examples.confidence()},
    )


def main(frames: str, completions: str, rank: int, world_size: int, expected: int) -> None:
    endpoints = ChannelEndpoints(frames=frames, completions=completions)
    with RankChannel(endpoints, rank) as channel:
        try:
            channel.handshake(timeout_ms=WAIT_MS)
        except TimeoutError:
            sys.exit(EXIT_NO_PING)
        report = examples.catalog_report()
        channel.send(dataclasses.replace(report, rank=rank, world_size=world_size))
        for fence in range(expected):
            message = channel.recv(timeout_ms=WAIT_MS)
            if message is None:
                sys.exit(EXIT_TIMEOUT)
            if not isinstance(message, Frame):
                sys.exit(EXIT_UNEXPECTED)
            if message.fence != fence:
                sys.exit(EXIT_OUT_OF_ORDER)
            channel.send(completion_for(message, rank, world_size))
        message = channel.recv(timeout_ms=WAIT_MS)
        if message is None:
            sys.exit(EXIT_TIMEOUT)
        if message != Control("shutdown"):
            sys.exit(EXIT_UNEXPECTED)
    sys.exit(EXIT_OK)
