"""Request preparation in process (runtime/frontend/preprocess/): each size limit's
400 naming it, a truncated prompt past the context, requests crossing the workers'
wire unchanged and a bad answer from a worker refused, and a worker over its time
limit replaced.  Against a real server: test_hostile_clients.py."""

from __future__ import annotations

import asyncio
import json

import pytest
from fastapi.testclient import TestClient

from runtime.frontend.chat import load_chat_template
from runtime.frontend.defaults import GenerationDefaults
from runtime.frontend.metrics import ServingMetrics
from runtime.frontend.preprocess.limits import check_sizes
from runtime.frontend.preprocess.pool import PreprocessPool
from runtime.frontend.preprocess.wire import WireError, requests_from_wire, requests_to_wire
from runtime.frontend.protocol.errors import RequestError
from runtime.frontend.protocol.requests import GenerationRequest, ServingLimits
from runtime.frontend.server.app import create_app
from runtime.frontend.server.state import Frontend
from runtime.frontend.tokenizer import ModelTokenizer
from runtime.ranks.model import default_model_dir
from tests.support.scripted_client import MODEL, ScriptedClient


@pytest.fixture(scope="module")
def tokenizer() -> ModelTokenizer:
    return ModelTokenizer.from_dir(default_model_dir())


def frontend(tokenizer: ModelTokenizer) -> TestClient:
    template = load_chat_template(default_model_dir(), tokenizer)
    fe = Frontend(
        ScriptedClient([]),
        tokenizer,
        template,
        ServingLimits(MODEL, 512, 4096),
        ServingMetrics(MODEL),
    )
    return TestClient(create_app(fe))


@pytest.mark.parametrize(
    ("path", "body", "param", "words"),
    [
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}] * 5000},
            "messages",
            "at most 4096",
        ),
        (
            "/tokenize",
            {"messages": [{"role": "user", "content": "x"}] * 5000},
            "messages",
            "at most 4096",
        ),
        ("/v1/completions", {"prompt": [1] * 5000}, "prompt", "maximum context of 4096"),
        ("/v1/completions", {"prompt": [[1, 2], [1] * 5000]}, "prompt[1]", "5000 token ids"),
        ("/tokenize", {"prompt": "x" * 300_000}, "prompt", "/tokenize's limit"),
        ("/tokenize", {"prompt": "<|eos|>" * 17000}, "prompt", "counts at most 16384"),
        ("/detokenize", {"tokens": [1] * 20000}, "tokens", "takes at most 16384"),
    ],
)
def test_each_limit_is_a_400_naming_it(tokenizer, path, body, param, words):
    with frontend(tokenizer) as http:
        r = http.post(path, json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and words in error["message"], error


def test_a_truncated_prompt_may_be_longer_than_the_context():
    limits = ServingLimits(MODEL, 512, 4096)
    check_sizes("completions", {"prompt": [1] * 5000, "truncate_prompt_tokens": 10}, limits, 16)
    check_sizes("completions", {"prompt": "x" * 90_000, "truncate_prompt_tokens": -1}, limits, 16)
    with pytest.raises(RequestError):
        check_sizes("completions", {"prompt": "x" * 90_000}, limits, 16)


def full_request() -> GenerationRequest:
    """A request with every field away from its default."""
    return GenerationRequest(
        model=MODEL,
        prompt_token_ids=(1, 2, 3, 511),
        prompt="text",
        max_tokens=7,
        temperature=0.5,
        top_p=0.9,
        top_k=5,
        seed=2**62,
        n=2,
        stop=("a", "b"),
        stop_token_ids=(3, 4),
        logprobs=2,
        stream=True,
        include_usage=True,
        ignore_eos=True,
        min_tokens=1,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        repetition_penalty=1.1,
        logit_bias=((5, 1.5), (6, -2.0)),
        message_endpoints=(2, 4),
        cache_salt="salt",
        include_stop_str_in_output=True,
        skip_special_tokens=False,
        return_tokens_as_token_ids=True,
        truncate_prompt_tokens=4,
    )


def test_requests_cross_the_wire_unchanged():
    import msgpack

    limits = ServingLimits(MODEL, 512, 4096)
    req = full_request()
    wire = msgpack.unpackb(msgpack.packb(requests_to_wire([req, req])), raw=False)
    assert requests_from_wire(wire, limits) == [req, req]
    # Every field of GenerationRequest (a new one too) has a wire form.
    assert set(wire[0]) == {f for f in GenerationRequest.__dataclass_fields__}


@pytest.mark.parametrize(
    "change",
    [
        {"max_tokens": "7"},
        {"seed": 1.5},
        {"stream": 1},
        {"prompt_token_ids": [1, 2]},
        {"prompt_token_ids": b"\x01\x02"},
        {"stop": "ab"},
        {"logit_bias": [[5]]},
        {"unknown": 1},
    ],
)
def test_a_bad_worker_answer_is_refused(change):
    limits = ServingLimits(MODEL, 512, 4096)
    wire = {**requests_to_wire([full_request()])[0], **change}
    with pytest.raises(WireError):
        requests_from_wire([wire], limits)


def test_ids_outside_the_vocabulary_from_a_worker_are_refused():
    from array import array

    wire = requests_to_wire([full_request()])[0]
    wire["prompt_token_ids"] = array("q", [1, 512]).tobytes()
    with pytest.raises(WireError):
        requests_from_wire([wire], ServingLimits(MODEL, 512, 4096))


@pytest.mark.process  # the pool's worker processes
def test_a_worker_over_its_time_limit_is_replaced(tokenizer):
    """A job over the pool's time limit is a 413 naming it; the worker is killed and
    replaced, and the next job is served."""
    template = load_chat_template(default_model_dir(), tokenizer)
    limits = ServingLimits(MODEL, 512, 4096)

    async def run():
        pool = PreprocessPool(
            limits, template, GenerationDefaults(), str(default_model_dir()), 1, timeout_s=0.3
        )
        await pool.start()
        try:
            (first,) = pool.pids()
            slow = ("{" + ",".join(f'"k{i}":0' for i in range(1_500_000)) + "}").encode()
            with pytest.raises(RequestError) as info:
                await pool.prepare("completions", slow)
            assert info.value.status == 413 and "more than 0.3 s" in info.value.message
            pool.timeout_s = 30.0
            body = json.dumps({"prompt": "alpha " * 2000}).encode()
            answer = json.loads(await pool.prepare("tokenize", body))
            assert answer["count"] > 1000
            assert pool.pids() != [first] and pool.replaced == 1
        finally:
            await pool.close()

    asyncio.run(run())
