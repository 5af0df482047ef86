"""Valid example messages shared by the transport tests."""

from __future__ import annotations

from runtime.catalog import GraphDescriptor, GraphKind
from runtime.transport.catalog_report import CatalogReport
from runtime.transport.columns import column
from runtime.transport.completion import Completion, LaneResult
from runtime.transport.control import Control
from runtime.transport.frame import Frame
from runtime.transport.frame_lane import FrameLane
from runtime.transport.inspection import RankStatus
from runtime.transport.sampling import SamplingParams
from runtime.transport.tensor import Tensor

MIXED = GraphDescriptor(GraphKind.MIXED, batch_capacity=4, token_capacity=1, prompt_capacity=64)
DECODE = GraphDescriptor(GraphKind.DECODE, batch_capacity=4)


def sampling() -> SamplingParams:
    return SamplingParams(
        temperature=0.7, top_p=0.9, top_k=40, seed=2**63 - 1, min_tokens=3, logprobs=5
    )


def prefill_lane(slot: int = 3) -> FrameLane:
    return FrameLane(
        slot=slot,
        generation=2,
        phase="prefill",
        prompt_start=0,
        prompt_tokens=(1, 2, 3, 151_643),
        position=0,
        pages=(5, 6),
        commits=1,
        sampling=sampling(),
    )


def decode_lane(slot: int = 4) -> FrameLane:
    """A decode lane that appends two pages (a table growing while it decodes)."""
    return FrameLane(
        slot=slot,
        generation=1,
        phase="decode",
        prompt_start=7,
        prompt_tokens=(),
        position=17,
        pages=(7, 0),
        commits=1,
    )


def frame() -> Frame:
    """Mixed B=4, C=64: lane 0 prefills slot 3 (4 tokens, pages 5 6), lane 1 decodes slot 4."""
    return Frame.from_lanes(
        fence=9,
        program=MIXED,
        lanes=(prefill_lane(), decode_lane()),
        prompt_row=0,
        release_slots=(1, 2),
        expected_ns=5_000_000,
    )


def decode_frame(lanes: int = 64) -> Frame:
    """A decode frame of ``lanes`` lanes (slots 0..lanes-1) with no pages: the hot path."""
    program = GraphDescriptor(GraphKind.DECODE, batch_capacity=64)
    return Frame(
        fence=11,
        program=program,
        slot=column(range(lanes)),
        generation=column([3] * lanes),
        phase=column([0] * lanes),
        position=column(range(100, 100 + lanes)),
        query_len=column([1] * lanes),
        commits=column([1] * lanes),
        prompt_start=column([20] * lanes),
        page_count=column([0] * lanes),
        expected_ns=1_500_000,
    )


def confidence() -> Tensor:
    """FP32 [2, 3, 4], values -1.0, -0.75, ... in row-major order."""
    return Tensor.from_values("float32", (2, 3, 4), [i * 0.25 - 1.0 for i in range(24)])


def lane_result() -> LaneResult:
    return LaneResult(slot=3, generation=2, tokens=(42,), finish_reason="stop")


def completion() -> Completion:
    return Completion.from_results(
        fence=9,
        rank=0,
        world_size=2,
        device_ns=1_234_567,
        readiness_delay_ns=10,
        lanes=(lane_result(), LaneResult(slot=4, generation=1, tokens=(7,))),
        sidecars={"confidence": confidence()},
    )


def catalog_report() -> CatalogReport:
    return CatalogReport(
        rank=1,
        world_size=2,
        descriptors=(DECODE, MIXED, GraphDescriptor(GraphKind.PREFILL, 1, prompt_capacity=128)),
        vocab_size=151_936,
        max_context=4096,
        page_size=16,
        num_pages=1024,
        model_name="tiny-llama",
        kv_page_bytes=65_536,
        dtype="bfloat16",
        device_type="cuda",
        protocol_version=8,
        code_version="0.1.0+src.0123456789abcdef",
        config_digest="1" * 64,
        tokenizer_digest="2" * 64,
        weights_digest="3" * 64,
        weights_full_digest="",
        draft_digest="4" * 64,
    )


def control() -> Control:
    return Control("ready", rank=1, nonce=12345)


def rank_status() -> RankStatus:
    return RankStatus(
        rank=1, world_size=2, nonce=9, device="cpu", frames=12, last_fence=40,
        rss_bytes=1 << 28, device_allocated_bytes=0, device_reserved_bytes=0,
        kv_cache_bytes=1 << 20, programs=("decode B=2", "prefill B=1 C=64"), captured=[0, 0],
        slot=[3, 4], generation=[1, 2], next_position=[17, 5], page_count=[2, 1],
        pending=[1, 0], step=[9, 0],
    )  # fmt: skip


ALL = {
    "SamplingParams": sampling,
    "Frame": frame,
    "Tensor": confidence,
    "Completion": completion,
    "CatalogReport": catalog_report,
    "Control": control,
    "RankStatus": rank_status,
}
