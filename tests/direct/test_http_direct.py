"""``flare run --direct`` over the OpenAI HTTP API: the same greedy tokens as the
normal scheduler.

Three servers run the embedded model on CPU with the same flags: the normal
scheduler at TP=1, and ``--direct`` at TP=1 and TP=2 (the ranks' greedy tokens
do not depend on the tensor-parallel size: tests/integration checks both against
transformers).  A small prefill capacity makes longer prompts go in chunks.
Prompts are sent concurrently, so each scheduler forms its own batches (the
ranks' results are batch invariant, so greedy tokens must agree).
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.support.server import Server, words

pytestmark = pytest.mark.process

FLAGS = ("--max-prefill-tokens", "64")  # after the harness's own flags: this one wins
PROMPTS = [words(3), words(40, seed=1), words(120, seed=2), "Hello", words(9, seed=5)]
MAX_TOKENS = 12


def completions(server: Server) -> list[tuple[str, list[str], dict]]:
    def one(prompt: str) -> tuple[str, list[str], dict]:
        response = server.post(
            "/v1/completions",
            {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
             "ignore_eos": True, "logprobs": 0},
        )  # fmt: skip
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        return choice["text"], choice["logprobs"]["tokens"], response.json()["usage"]

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        return list(pool.map(one, PROMPTS))


@pytest.fixture(scope="module")
def servers() -> Iterator[dict[str, Server]]:
    flags = {
        "normal": FLAGS,
        "direct-tp1": (*FLAGS, "--direct"),
        "direct-tp2": (*FLAGS, "--direct", "--tensor-parallel-size", "2"),
    }
    with ThreadPoolExecutor(len(flags)) as pool:  # start them at once
        starts = {name: pool.submit(Server, *extra) for name, extra in flags.items()}
        started = {}
        try:
            for name, start in starts.items():
                started[name] = start.result()
        except BaseException:
            for other in starts.values():
                if other.exception() is None:
                    other.result().stop()
            raise
    yield started
    assert [server.stop() for server in started.values()] == [0, 0, 0]


@pytest.fixture(scope="module")
def reference(servers: dict[str, Server]) -> list[tuple[str, list[str], dict]]:
    return completions(servers["normal"])


@pytest.mark.parametrize("name", ["direct-tp1", "direct-tp2"])
def test_direct_mode_serves_the_same_greedy_tokens_as_the_scheduler(
    servers: dict[str, Server], reference: list, name: str
) -> None:
    direct = servers[name]
    assert "direct mode: the diagnostic scheduler" in direct.output()
    assert "direct mode" not in servers["normal"].output()
    got = completions(direct)
    assert got == reference
    assert all(usage["completion_tokens"] == MAX_TOKENS for _, _, usage in got)
    assert any(usage["prompt_tokens"] > 64 for _, _, usage in got)  # chunked prefill
    metrics = httpx.get(f"{direct.base}/metrics").text
    assert 'flare_scheduler_executions_total{class="ordinary"}' in metrics
    assert 'flare_scheduler_executions_total{class="timing-refresh"} 0.0' in metrics
