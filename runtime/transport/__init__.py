"""Coordinator <-> rank transport: ZeroMQ with versioned msgpack schemas.

``schema``: one frozen, validated dataclass per message (``frame``: the
columnar Frame; ``columns``: int64 column helpers; ``sampling``:
SamplingParams).  ``codec``: the versioned msgpack envelope.  ``channels``:
the coordinator's and the ranks' ZeroMQ ends, with the start-up handshake.
"""

from runtime.transport.channels import (
    ChannelEndpoints,
    CoordinatorChannel,
    EndpointError,
    HandshakeTimeout,
    RankChannel,
    TransportError,
)
from runtime.transport.codec import decode, encode
from runtime.transport.schema import (
    PROTOCOL_VERSION,
    CatalogReport,
    Completion,
    Control,
    Frame,
    FrameLane,
    LaneResult,
    ProtocolError,
    SamplingParams,
    Tensor,
)

__all__ = [
    "PROTOCOL_VERSION",
    "CatalogReport",
    "ChannelEndpoints",
    "Completion",
    "Control",
    "CoordinatorChannel",
    "EndpointError",
    "Frame",
    "FrameLane",
    "HandshakeTimeout",
    "LaneResult",
    "ProtocolError",
    "RankChannel",
    "SamplingParams",
    "Tensor",
    "TransportError",
    "decode",
    "encode",
]
