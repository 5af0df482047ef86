"""Every message between the coordinator and the ranks, and the protocol version.

One frozen dataclass per message, each in the module of its family:
:class:`~runtime.transport.frame.Frame` (coordinator -> ranks, with its
:class:`~runtime.transport.sampling.SamplingParams` and
:class:`~runtime.transport.restore.Restore` records),
:class:`~runtime.transport.completion.Completion` (a rank's answer, carrying
:class:`~runtime.transport.tensor.Tensor` sidecars),
:class:`~runtime.transport.catalog_report.CatalogReport` (start-up),
:class:`~runtime.transport.control.Control` (out of band) and
:class:`~runtime.transport.inspection.RankStatus` (inspection).

Construction validates every field (type, range and the consistency of
lengths) and raises :class:`~runtime.transport.fields.ProtocolError` naming the
field, so an invalid message can neither be built by a sender nor accepted by
a receiver.  ``to_wire()`` gives plain msgpack-able maps; ``from_wire()``
checks the map's keys exactly (every field is required, no unknown field is
allowed), converts nested messages and constructs, which validates.

Protocol version 2: the per-lane data of :class:`Frame` and of
:class:`Completion` travel as int64 columns (``columns.py``: ``array('q')``
here, little-endian msgpack ``bin`` on the wire).  :class:`FrameLane` and
:class:`LaneResult` are per-lane views of them for tests and consumers; they
are not messages.  Protocol version 6 adds the frame's ``copies`` and
``restores`` (``restore.py``: page copies and restored rows for prefix reuse
and preemption).  Protocol version 7 adds the state lanes (phase 2,
``PHASE_STATE``) of RESTORE and SNAPSHOT programs: restore rows and terminal
rows that feed and commit nothing (``frame.py``).  Protocol version 8 adds
the start-up identity to :class:`CatalogReport` (``runtime/identity.py``:
model digests, dtype, device type, code version, KV bytes per page).
Protocol version 9 adds scored prefill (``frame.py``: the frame's
``score_next`` column and ``score_k``; ``completion.py``: the
``prompt_logprobs`` and ``prompt_logprob_token_ids`` sidecars).
Protocol version 10 adds vision (``frame.py``: a VISION frame's
``image_base`` column and ``pixels``, a prompt frame's ``feature_rows``;
``catalog_report.py``: the feature store's ``vision_windows``,
``window_rows`` and ``image_tokens``).
Sequences are stored as
tuples; sidecar tensors travel as raw little-endian bytes with dtype and shape.
Integers on the wire are bounded so that a rank can copy them into int32/int64
device buffers without overflow.
"""

from __future__ import annotations

from runtime.transport.catalog_report import CatalogReport
from runtime.transport.completion import Completion
from runtime.transport.control import Control
from runtime.transport.frame import Frame
from runtime.transport.inspection import RankStatus
from runtime.transport.sampling import SamplingParams
from runtime.transport.tensor import Tensor

PROTOCOL_VERSION = 10

Message = SamplingParams | Frame | Tensor | Completion | CatalogReport | Control | RankStatus
MESSAGE_TYPES: dict[str, type[Message]] = {
    cls.__name__: cls
    for cls in (SamplingParams, Frame, Tensor, Completion, CatalogReport, Control, RankStatus)
}
