"""Vision on a rank: the image-feature store and the VISION programs.

:class:`FeatureStore` is prepared storage allocated once at start-up, for a
vision model only (:class:`~runtime.ranks.capacity.VisionCapacity`):
``windows x window_rows`` feature rows of the decoder's hidden size in the
model dtype, plus one scratch row (the last) that padding writes.  The
coordinator owns its layout (which request's window holds which rows); the
rank only writes and reads the rows frames name.

:class:`VisionProgram` is one VISION descriptor (B images per frame): a
static pixel buffer (B, 3, H, W) float32 and a static (B, N) destination-row
buffer; its body runs the model's ``encode_images`` on the pixels and copies
the (B, N, hidden) features into the store at the destination rows (``index_copy_``),
padding images into the scratch row only.  A vision frame fills image ``i``'s
rows with ``image_base[i] + 0..N-1``.  CUDA: captured as a graph (with the
other programs, one memory pool) and timed with events around the replay;
CPU: the body runs eagerly over the frame's own images, timed with
``perf_counter_ns``.  A vision frame commits no tokens and changes nothing but
its destination rows (and the scratch row): the worker publishes it like a
state frame (:class:`~runtime.ranks.launch.Launch` with ``state``).

Prompt programs of a vision model read the store through their arena's
``feature_rows`` tail (:mod:`runtime.ranks.frame_packing`,
:class:`~runtime.ranks.programs.PreparedProgram`).  docs/vision.md, "Rank
programs".
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable
from typing import Protocol, cast

import numpy as np
import torch

from runtime.catalog import GraphDescriptor, GraphKind
from runtime.ranks.capacity import CapacityConfig, VisionCapacity
from runtime.ranks.checked_frame import CheckedFrame
from runtime.ranks.launch import Launch
from runtime.ranks.model.llama import LlamaForCausalLM
from runtime.ranks.model.parallel import RELEASE
from runtime.ranks.outputs import HostOutputs
from runtime.ranks.shapes import ProgramError
from runtime.transport.frame import Frame

PIXEL_DTYPE = np.dtype("<f4")  # the wire's pixels: little-endian float32, C order


class ImageEncoder(Protocol):
    """What a vision program calls of its model (a LlavaForConditionalGeneration)."""

    def encode_images(self, pixels: torch.Tensor) -> torch.Tensor: ...


def store_bytes(capacity: VisionCapacity, hidden: int, dtype_bytes: int) -> int:
    """What a :class:`FeatureStore` of ``capacity`` allocates (its scratch row too)."""
    return (capacity.rows + 1) * hidden * dtype_bytes


class FeatureStore:
    """The rank's image-feature rows (module docstring): ``features`` (rows + 1,
    hidden) in the model dtype; row ``rows`` is scratch."""

    def __init__(self, capacity: VisionCapacity, hidden: int, dtype: torch.dtype, device) -> None:
        self.capacity = capacity
        self.rows = capacity.rows
        self.scratch = capacity.rows
        self.features = torch.zeros(self.rows + 1, hidden, dtype=dtype, device=device)

    @classmethod
    def for_model(cls, model: LlamaForCausalLM, cfg: CapacityConfig) -> FeatureStore | None:
        """The store ``cfg`` sizes for ``model``; None for a text-only model."""
        vision = model.config.vision
        if vision is None:
            return None
        capacity = VisionCapacity.of(cfg, vision.image_tokens_per_image)
        device = model.model.embed_tokens.weight.device
        return cls(capacity, model.config.hidden_size, model.dtype, device)

    @property
    def nbytes(self) -> int:
        return self.features.numel() * self.features.element_size()

    def report(self) -> dict[str, int]:
        """The store's size as the catalog report's fields."""
        cap = self.capacity
        return {
            "vision_windows": cap.windows,
            "window_rows": cap.window_rows,
            "image_tokens": cap.image_tokens,
        }


def empty_checked(frame: Frame) -> CheckedFrame:
    """A frame without lanes as a :class:`CheckedFrame` (what a launch carries)."""
    none = np.zeros(0, np.int64)
    flags = np.zeros(0, bool)
    return CheckedFrame(
        frame, none, none, flags, none, none, none, flags, none, none, none, none, none, {},
        False, -1,
    )  # fmt: skip


class VisionProgram:
    """One VISION descriptor's program (module docstring)."""

    def __init__(self, desc: GraphDescriptor, model: LlamaForCausalLM, store: FeatureStore) -> None:
        if desc.kind is not GraphKind.VISION:
            raise ProgramError(f"{desc.describe()} is not a vision program")
        self.desc = desc
        self.model = model
        self.encoder = cast(ImageEncoder, model)  # a LlavaForConditionalGeneration
        self.store = store
        vision = model.config.vision
        assert vision is not None  # a store exists for vision models only
        enc = vision.encoder
        self.image_shape = (enc.num_channels, enc.image_size, enc.image_size)
        self.image_bytes = math.prod(self.image_shape) * PIXEL_DTYPE.itemsize
        self.images = desc.batch_capacity  # B
        self.tokens = store.capacity.image_tokens  # N
        self.device = store.features.device
        b, n = self.images, self.tokens
        self.pixels = torch.zeros(b, *self.image_shape, dtype=torch.float32, device=self.device)
        self.rows = torch.full((b, n), store.scratch, dtype=torch.int64, device=self.device)
        # Host staging: pinned buffers on CUDA; on CPU the program's own buffers.
        cuda = self.device.type == "cuda"
        self._host_pixels = (
            torch.zeros(b, *self.image_shape, dtype=torch.float32, pin_memory=True)
            if cuda
            else self.pixels
        )
        self._host_rows = (
            torch.zeros((b, n), dtype=torch.int64, pin_memory=True) if cuda else self.rows
        )
        self._copied: torch.cuda.Event | None = None  # the last frame's host copies done
        self.graph: torch.cuda.CUDAGraph | None = None

    @property
    def captured(self) -> bool:
        return self.graph is not None

    def _body(self, images: int = 0) -> None:
        """Encode the first ``images`` images (0: all B, as captured) into their rows."""
        images = images or self.images
        features = self.encoder.encode_images(self.pixels[:images])  # (I, N, hidden)
        rows = self.rows[:images].reshape(-1)  # (I * N,)
        store = self.store.features
        store.index_copy_(0, rows, features.reshape(rows.shape[0], -1).to(store.dtype))

    def capture(self, pool: object | None = None) -> object | None:
        """CUDA: capture the body as a graph over scratch rows (returns the memory
        pool). CPU: no-op."""
        if self.device.type != "cuda":
            return None
        self.rows.fill_(self.store.scratch)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm-up: allocator, autotuning, lazy init
                self._body()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            self._body()
        self.graph = graph
        return graph.pool()

    def check(self, frame: Frame) -> np.ndarray:
        """(I, N) the store rows of the frame's I images; ProgramError naming the
        field when the pixels are not I images of this model's size, or an
        image's rows leave the store or overlap another's.  Nothing changes."""
        images = len(frame.image_base)
        if not 1 <= images <= self.images:
            raise ProgramError(f"image_base: {images} images for {self.desc.describe()}")
        expected = images * self.image_bytes
        if len(frame.pixels) != expected:
            shape = " x ".join(map(str, self.image_shape))
            raise ProgramError(
                f"pixels: {len(frame.pixels)} bytes, but {images} float32 images of "
                f"{shape} take {expected}"
            )
        base = np.frombuffer(frame.image_base, dtype=np.int64)
        n, limit = self.tokens, self.store.rows
        over = base + n > limit
        if over.any():
            i = int(np.argmax(over))
            raise ProgramError(
                f"image_base[{i}]: rows {int(base[i])}..{int(base[i]) + n - 1} lie outside "
                f"the feature store ({limit} rows)"
            )
        order = np.argsort(base, kind="stable")
        clash = np.diff(base[order]) < n
        if clash.any():
            i = int(order[int(np.argmax(clash)) + 1])
            raise ProgramError(f"image_base[{i}]: its {n} rows overlap another image's")
        return base[:, None] + np.arange(n)  # (I, N)

    def launch(self, frame: Frame, host: HostOutputs) -> Launch:
        """Check ``frame`` (raises with nothing changed), copy its pixels and rows
        and run the program; on CPU it also runs to the end.  Stages: validate,
        pack (the host copies) and launch."""
        t0 = time.perf_counter_ns()
        rows = self.check(frame)
        images = rows.shape[0]
        t1 = time.perf_counter_ns()
        if self._copied is not None:  # the host buffers may still feed the last copy
            self._copied.synchronize()
        pixels = np.frombuffer(frame.pixels, dtype=PIXEL_DTYPE).reshape(images, *self.image_shape)
        self._host_pixels.numpy()[:images] = pixels
        host_rows = self._host_rows.numpy()
        host_rows[:images] = rows
        host_rows[images:] = self.store.scratch  # padding images write the scratch row
        t2 = time.perf_counter_ns()
        launch = Launch(empty_checked(frame), None, "vision", host, t2, state=True)
        cuda = self.device.type == "cuda"
        if not cuda:  # eager: the frame's own images (staged in place)
            RELEASE.arm()
            started = time.perf_counter_ns()
            self._body(images)
            launch.device_ns = time.perf_counter_ns() - started
            launch.launch_wait_ns = min(RELEASE.take(), launch.device_ns)
        else:
            launch.start = torch.cuda.Event(enable_timing=True)
            launch.end = torch.cuda.Event(enable_timing=True)
            launch.done = torch.cuda.Event()
            self.pixels[:images].copy_(self._host_pixels[:images], non_blocking=True)
            self.rows.copy_(self._host_rows, non_blocking=True)
            self._copied = torch.cuda.Event()
            self._copied.record()
            launch.start.record()
            if self.graph is not None:
                self.graph.replay()
            else:  # eager CUDA (capture disabled)
                self._body()
            launch.end.record()
            launch.done.record()
        t3 = time.perf_counter_ns()
        launch.stages.update(validate=t1 - t0, pack=t2 - t1, launch=t3 - t2 - launch.device_ns)
        return launch


def vision_programs(
    catalog: Iterable[GraphDescriptor], model: LlamaForCausalLM, store: FeatureStore | None
) -> dict[tuple, VisionProgram]:
    """The catalog's VISION programs over ``store`` (not captured yet); ValueError
    when the catalog has one and the model encodes no images."""
    vision = [d for d in catalog if d.kind is GraphKind.VISION]
    if vision and store is None:
        raise ValueError(
            f"{vision[0].describe()}: the model encodes no images (a text-only model "
            "has no vision programs)"
        )
    assert store is not None or not vision
    return {d.key: VisionProgram(d, model, store) for d in vision}  # type: ignore[arg-type]
