"""Coordinator <-> rank transport: ZeroMQ with versioned msgpack schemas.

``schema``: the protocol version and the registry of messages, one frozen,
validated dataclass each (``frame``: the columnar Frame, ``frame_lane`` its
per-lane view, ``frame_checks`` its rules; ``completion``: a rank's answer;
``tensor``: sidecar tensors; ``catalog_report``; ``control``; ``inspection``;
``columns``: int64 column helpers; ``sampling``: SamplingParams; ``restore``:
Restore and the frame's page copies).  ``codec``: the versioned msgpack
envelope.  ``channels``: the receive loop both ends share;
``coordinator_channel`` and ``rank_channel``: the coordinator's and the ranks'
ZeroMQ ends, with the start-up handshake; ``run_dirs``: their ipc directories.
``security``, ``key_files`` and ``gatekeeper``: CURVE keys, their files and
the coordinator's ZAP handler.
"""

from runtime.transport.catalog_report import CatalogReport
from runtime.transport.channels import (
    ChannelEndpoints,
    EndpointError,
    HandshakeTimeout,
    TransportError,
)
from runtime.transport.codec import decode, encode
from runtime.transport.completion import Completion, LaneResult
from runtime.transport.control import Control
from runtime.transport.coordinator_channel import CoordinatorChannel
from runtime.transport.fields import ProtocolError
from runtime.transport.frame import Frame
from runtime.transport.frame_lane import FrameLane
from runtime.transport.rank_channel import RankChannel
from runtime.transport.restore import Restore
from runtime.transport.sampling import SamplingParams
from runtime.transport.schema import PROTOCOL_VERSION
from runtime.transport.tensor import Tensor

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
