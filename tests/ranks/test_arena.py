"""Persistent arenas: many frames without memory growth, and a 128k-position
model packing and running short contexts like a 4k one."""

from __future__ import annotations

import dataclasses
import gc

import psutil
import pytest

from runtime.catalog import GraphKind
from runtime.ranks.capacity import CapacityConfig
from runtime.ranks.model import load_model
from runtime.ranks.model.default import DEFAULT_CONFIG, write_random_checkpoint
from runtime.ranks.worker import RankWorker
from runtime.transport.frame import Frame
from runtime.transport.sampling import SamplingParams

PAGE = 16
LANES = 8
PROMPT = 24


def small_config(positions: int):
    return dataclasses.replace(
        DEFAULT_CONFIG,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        head_dim=16,
        max_position_embeddings=positions,
    )


def worker_for(tmp_path, positions: int) -> RankWorker:
    path = write_random_checkpoint(tmp_path / f"p{positions}", small_config(positions), seed=2)
    capacity = CapacityConfig(max_concurrency=LANES, min_prefill_tokens=64, max_prefill_tokens=64)
    return RankWorker(load_model(path), capacity, num_pages=LANES * 80, page_size=PAGE)


class Driver:
    def __init__(self, worker: RankWorker) -> None:
        self.w = worker
        self.fence = 0
        kinds = {(d.kind, d.batch_capacity, d.prompt_capacity): d for d in worker.catalog}
        self.prefill = kinds[(GraphKind.PREFILL, 1, 64)]
        self.decode = kinds[(GraphKind.DECODE, LANES, 0)]
        self.positions = [PROMPT] * LANES

    def fill(self) -> list[int]:
        first = []
        for s in range(LANES):
            self.fence += 1
            prompt = [(5 * s + j) % 200 for j in range(PROMPT)]
            pages = list(range(s * 80, (s + 1) * 80))
            c = self.w.execute(
                Frame(
                    self.fence, self.prefill, slot=[s], generation=[1], phase=[1], position=[0],
                    query_len=[PROMPT], commits=[1], prompt_start=[0], prompt_tokens=prompt,
                    page_count=[80], pages=pages, sampling=((0, SamplingParams()),),
                )
            )  # fmt: skip
            first.append(c.tokens[0])
        return first

    def step(self) -> list[int]:
        self.fence += 1
        c = self.w.execute(
            Frame(
                self.fence, self.decode, slot=list(range(LANES)), generation=[1] * LANES,
                phase=[0] * LANES, position=self.positions, query_len=[1] * LANES,
                commits=[1] * LANES, prompt_start=[0] * LANES, page_count=[0] * LANES,
            )
        )  # fmt: skip
        self.positions = [p + 1 for p in self.positions]
        return list(c.tokens)


def test_many_frames_do_not_grow_memory(tmp_path):
    driver = Driver(worker_for(tmp_path, 4096))
    driver.fill()
    for _ in range(50):  # warm-up: allocator pools, lazy init
        driver.step()
    gc.collect()
    process = psutil.Process()
    before = process.memory_info().rss
    for _ in range(600):
        driver.step()
    gc.collect()
    grown = process.memory_info().rss - before
    assert grown < 8 << 20, f"RSS grew by {grown / 2**20:.1f} MiB over 600 frames"
    assert len(driver.w.stages) == 600 + 50 + LANES  # every frame's stage times kept


@pytest.mark.parametrize("positions", [131072])
def test_long_max_context_gives_the_same_tokens_and_a_narrow_page_table(tmp_path, positions):
    short, long = Driver(worker_for(tmp_path, 4096)), Driver(worker_for(tmp_path, positions))
    assert long.w.max_context == positions
    assert long.fill() == short.fill()
    for _ in range(4):
        assert long.step() == short.step()
    # The host packs a handful of numbers per lane whatever the maximum context,
    # and the CPU program reads only the page-table columns the frame needs.
    program = long.w.programs[long.decode.key]
    _, checked = long.w.check(
        Frame(
            999, long.decode, slot=list(range(LANES)), generation=[1] * LANES,
            phase=[0] * LANES, position=long.positions, query_len=[1] * LANES,
            commits=[1] * LANES, prompt_start=[0] * LANES, page_count=[0] * LANES,
        )
    )  # fmt: skip
    _, array = long.w.staging.take()
    used, width = program.pack(checked, array)
    # decode: every lane field, no token (decode lanes read their pending tokens on
    # the device), no page table
    assert used == program.int_size - program.shape.tokens
    assert width == -(-(PROMPT + 5) // PAGE)
    assert long.w.arena.page_tables.shape[1] == positions // PAGE
