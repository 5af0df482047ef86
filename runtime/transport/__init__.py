"""Coordinator <-> rank transport: ZeroMQ with versioned msgpack schemas.

``schema``: one frozen, validated dataclass per message (``frame``: the
columnar Frame; ``columns``: int64 column helpers; ``sampling``:
SamplingParams; ``restore``: Restore and the frame's page copies).
``codec``: the versioned msgpack envelope.  ``channels``: the coordinator's
and the ranks' ZeroMQ ends, with the start-up handshake.
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
    Restore,
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
    "Restore",
    "SamplingParams",
    "Tensor",
    "TransportError",
    "decode",
    "encode",
]
