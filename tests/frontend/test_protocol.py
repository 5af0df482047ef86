"""Request validation: every refusal names its field; valid bodies give the right values."""

from __future__ import annotations

import math

import pytest

from runtime.frontend.chat import ChatTemplate
from runtime.frontend.protocol.chat_completions import parse_chat
from runtime.frontend.protocol.completions import parse_completion
from runtime.frontend.protocol.errors import RequestError
from runtime.frontend.protocol.requests import GenerationRequest, ServingLimits
from runtime.frontend.tokenizer import ModelTokenizer
from runtime.ranks.model import default_model_dir

MODEL = "flare-tiny"
LIMITS = ServingLimits(model_name=MODEL, vocab_size=512, max_context=64)
FALLBACK = ChatTemplate()
USER = [{"role": "user", "content": "Hello"}]


@pytest.fixture(scope="module")
def tok() -> ModelTokenizer:
    return ModelTokenizer.from_dir(default_model_dir())


def completion(tok: ModelTokenizer, limits: ServingLimits = LIMITS, **fields) -> GenerationRequest:
    return parse_completion({"prompt": "Hello world", **fields}, limits, tok)


def chat(tok: ModelTokenizer, limits: ServingLimits = LIMITS, **fields) -> GenerationRequest:
    return parse_chat({"messages": USER, **fields}, limits, tok, FALLBACK)


def refusal(call, *args, **kwargs) -> RequestError:
    with pytest.raises(RequestError) as info:
        call(*args, **kwargs)
    return info.value


# -- refusals shared by both endpoints ------------------------------------------------------

SHARED_INVALID = [
    ({"model": 7}, "model"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": -3}, "max_tokens"),
    ({"max_tokens": True}, "max_tokens"),
    ({"max_tokens": 2.0}, "max_tokens"),
    ({"max_tokens": "8"}, "max_tokens"),
    ({"temperature": math.nan}, "temperature"),
    ({"temperature": math.inf}, "temperature"),
    ({"temperature": -0.1}, "temperature"),
    ({"temperature": True}, "temperature"),
    ({"temperature": "1"}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1.01}, "top_p"),
    ({"top_p": -0.5}, "top_p"),
    ({"top_p": math.nan}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"top_k": True}, "top_k"),
    ({"top_k": 4.0}, "top_k"),
    ({"seed": -1}, "seed"),
    ({"seed": 2**63}, "seed"),
    ({"seed": False}, "seed"),
    ({"seed": 1.5}, "seed"),
    ({"n": 0}, "n"),
    ({"n": 17}, "n"),
    ({"n": True}, "n"),
    ({"stop": ""}, "stop"),
    ({"stop": ["end", ""]}, "stop"),
    ({"stop": ["s"] * 17}, "stop"),
    ({"stop": 5}, "stop"),
    ({"stop": ["ok", 1]}, "stop"),
    ({"stop_token_ids": [512]}, "stop_token_ids"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"stop_token_ids": [True]}, "stop_token_ids"),
    ({"stop_token_ids": 3}, "stop_token_ids"),
    ({"stream": "yes"}, "stream"),
    ({"stream": 1}, "stream"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"stream": True, "stream_options": [True]}, "stream_options"),
    ({"stream": True, "stream_options": {"include_usage": 1}}, "stream_options.include_usage"),
    ({"ignore_eos": 1}, "ignore_eos"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": True}, "min_tokens"),
    ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
    ({"echo": "no"}, "echo"),
    ({"prompt_logprobs": 21}, "prompt_logprobs"),
    ({"prompt_logprobs": -1}, "prompt_logprobs"),
    ({"max_tokens": 0}, "max_tokens"),  # only with echo or prompt_logprobs
]


@pytest.mark.parametrize(("fields", "param"), SHARED_INVALID)
@pytest.mark.parametrize("endpoint", [completion, chat])
def test_invalid_field_is_a_400_naming_it(tok, endpoint, fields, param):
    error = refusal(endpoint, tok, **fields)
    assert (error.status, error.param, error.type) == (400, param, "invalid_request_error")
    assert param.split(".")[0] in error.message


@pytest.mark.parametrize("endpoint", [completion, chat])
def test_unknown_model_is_a_404_model_not_found(tok, endpoint):
    error = refusal(endpoint, tok, model="gpt-4")
    assert (error.status, error.param, error.code) == (404, "model", "model_not_found")
    assert "gpt-4" in error.message and MODEL in error.message


@pytest.mark.parametrize("body", [[], "prompt", None, 3, [{"prompt": "x"}]])
def test_body_that_is_not_an_object_names_no_param(tok, body):
    for call in (
        lambda: parse_completion(body, LIMITS, tok),
        lambda: parse_chat(body, LIMITS, tok, FALLBACK),
    ):
        error = refusal(call)
        assert (error.status, error.param) == (400, None)
        assert error.message == "body must be a JSON object"


def test_error_json_has_the_openai_shape(tok):
    error = refusal(completion, tok, model="other")
    assert error.to_json() == {
        "error": {
            "message": error.message,
            "type": "invalid_request_error",
            "param": "model",
            "code": "model_not_found",
        }
    }
    plain = RequestError(400, "bad", None)
    assert plain.to_json() == {
        "error": {"message": "bad", "type": "invalid_request_error", "param": None, "code": None}
    }


# -- completions -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "prompt",
    [None, "", [], ["a", "b"], [[1, 2]], [1, True], [1, 2.0], [512], [-1], 5, {"text": "x"}],
)
def test_invalid_prompt_names_prompt(tok, prompt):
    body = {} if prompt is None else {"prompt": prompt}
    error = refusal(parse_completion, body, LIMITS, tok)
    assert (error.status, error.param) == (400, "prompt")


@pytest.mark.parametrize("logprobs", [21, -1, True, 1.0])
def test_invalid_completion_logprobs(tok, logprobs):
    error = refusal(completion, tok, logprobs=logprobs)
    assert (error.status, error.param) == (400, "logprobs")


def test_prompt_that_fills_the_context_names_prompt(tok):
    error = refusal(parse_completion, {"prompt": list(range(64))}, LIMITS, tok)
    assert (error.status, error.param, error.code) == (400, "prompt", "context_length_exceeded")
    assert "64" in error.message


def test_prompt_plus_max_tokens_over_the_context_names_max_tokens(tok):
    body = {"prompt": list(range(10)), "max_tokens": 55}
    error = refusal(parse_completion, body, LIMITS, tok)
    assert (error.status, error.param, error.code) == (400, "max_tokens", "context_length_exceeded")
    assert parse_completion({**body, "max_tokens": 54}, LIMITS, tok).max_tokens == 54


def test_completion_defaults(tok):
    req = completion(tok)
    ids = tuple(tok.encode("Hello world"))
    assert req == GenerationRequest(
        model=MODEL, prompt_token_ids=ids, prompt="Hello world", max_tokens=64 - len(ids)
    )
    assert (req.temperature, req.top_p, req.top_k, req.seed, req.n) == (1.0, 1.0, -1, None, 1)
    assert (req.stop, req.logprobs, req.stream, req.include_usage) == ((), None, False, False)


def test_completion_with_every_field(tok):
    req = completion(
        tok,
        model=MODEL,
        max_tokens=8,
        temperature=0,
        top_p=0.5,
        top_k=7,
        seed=2**63 - 1,
        n=16,
        stop=["\n", "END"],
        stop_token_ids=[0, 511],
        logprobs=20,
        stream=True,
        stream_options={"include_usage": True},
        ignore_eos=True,
        min_tokens=8,
        echo=False,
        frequency_penalty=0.5,  # unknown to flare: ignored, as OpenAI ignores extras
        user="someone",
    )
    assert req.temperature == 0.0 and isinstance(req.temperature, float)
    assert (req.max_tokens, req.top_p, req.top_k, req.seed, req.n) == (8, 0.5, 7, 2**63 - 1, 16)
    assert (req.stop, req.stop_token_ids, req.logprobs) == (("\n", "END"), (0, 511), 20)
    assert (req.stream, req.include_usage, req.ignore_eos, req.min_tokens) == (True, True, True, 8)


def test_top_k_zero_means_disabled(tok):
    assert completion(tok, top_k=0).top_k == -1
    assert completion(tok, top_k=-1).top_k == -1


def test_single_stop_string_and_nulls(tok):
    req = completion(tok, stop="###", seed=None, n=None, top_p=None, stream_options=None)
    assert (req.stop, req.seed, req.n, req.top_p) == (("###",), None, 1, 1.0)
    assert completion(tok, stream=True, stream_options={}).include_usage is False


def test_token_id_prompt_and_list_of_one_string(tok):
    req = parse_completion({"prompt": [0, 5, 511]}, LIMITS, tok)
    assert (req.prompt_token_ids, req.prompt) == ((0, 5, 511), None)
    listed = parse_completion({"prompt": ["Hello world"]}, LIMITS, tok)
    assert listed.prompt_token_ids == completion(tok).prompt_token_ids


def test_default_max_tokens_policy_caps_at_the_rest_of_the_context(tok):
    capped = ServingLimits(MODEL, 512, 64, default_max_tokens=16)
    assert parse_completion({"prompt": [1, 2, 3]}, capped, tok).max_tokens == 16
    assert parse_completion({"prompt": list(range(60))}, capped, tok).max_tokens == 4
    assert parse_completion({"prompt": list(range(60))}, LIMITS, tok).max_tokens == 4


@pytest.mark.parametrize(
    "kwargs",
    [
        {"model_name": ""},
        {"vocab_size": 0},
        {"max_context": True},
        {"default_max_tokens": 0},
    ],
)
def test_serving_limits_refuse_nonsense(kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        ServingLimits(**{"model_name": MODEL, "vocab_size": 8, "max_context": 8, **kwargs})


# -- chat --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("messages", "param"),
    [
        (None, "messages"),
        ([], "messages"),
        ("Hello", "messages"),
        ([1], "messages[0]"),
        ([{"role": "tool", "content": "x"}], "messages[0].role"),
        ([{"content": "x"}], "messages[0].role"),
        ([{"role": "user"}], "messages[0].content"),
        ([{"role": "user", "content": []}], "messages[0].content"),
        ([{"role": "user", "content": 5}], "messages[0].content"),
        (
            [
                {"role": "user", "content": "ok"},
                {"role": "user", "content": [{"type": "image_url", "image_url": {}}]},
            ],
            "messages[1].content[0].image_url.url",
        ),
        (
            [{"role": "user", "content": [{"type": "image_url", "image_url": 5}]}],
            "messages[0].content[0].image_url",
        ),
        ([{"role": "user", "content": [{"type": "input_audio"}]}], "messages[0].content[0].type"),
        ([{"role": "user", "content": ["text"]}], "messages[0].content[0].type"),
        ([{"role": "user", "content": [{"type": "text"}]}], "messages[0].content[0].text"),
    ],
)
def test_invalid_messages_name_the_field(tok, messages, param):
    body = {} if messages is None else {"messages": messages}
    error = refusal(parse_chat, body, LIMITS, tok, FALLBACK)
    assert (error.status, error.param) == (400, param)


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"max_completion_tokens": 0}, "max_completion_tokens"),
        ({"max_completion_tokens": True}, "max_completion_tokens"),
        ({"logprobs": 1}, "logprobs"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": True}, "top_logprobs"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"logprobs": False, "top_logprobs": 2}, "top_logprobs"),
    ],
)
def test_invalid_chat_fields(tok, fields, param):
    error = refusal(chat, tok, **fields)
    assert (error.status, error.param) == (400, param)


def test_chat_context_errors_name_messages_and_the_max_tokens_field(tok):
    long = [{"role": "user", "content": "word " * 80}]
    error = refusal(parse_chat, {"messages": long}, LIMITS, tok, FALLBACK)
    assert (error.status, error.param, error.code) == (400, "messages", "context_length_exceeded")
    for field in ("max_tokens", "max_completion_tokens"):
        error = refusal(chat, tok, **{field: 64})
        assert (error.status, error.param) == (400, field)


def test_chat_renders_the_template_and_encodes_it(tok):
    messages = [
        {"role": "system", "content": "Be brief."},
        {
            "role": "user",
            "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "!"}],
        },
    ]
    req = parse_chat({"messages": messages, "max_tokens": 5}, LIMITS, tok, FALLBACK)
    assert req.prompt == "<|system|>\nBe brief.\n<|user|>\nHi\n!\n<|assistant|>\n"
    assert req.prompt_token_ids == tuple(tok.encode(req.prompt))
    assert req.max_tokens == 5


def test_chat_max_completion_tokens_wins_and_logprobs_map(tok):
    req = chat(tok, max_tokens=3, max_completion_tokens=9, logprobs=True)
    assert (req.max_tokens, req.logprobs) == (9, 0)
    assert chat(tok, logprobs=True, top_logprobs=5).logprobs == 5
    assert chat(tok, logprobs=False).logprobs is None
    req = chat(tok)
    assert req.max_tokens == 64 - len(req.prompt_token_ids)


class RecordingEncoder:
    """Records how the prompt was encoded."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, bool]] = []

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        self.calls.append((text, add_special_tokens))
        return [1, 2, 3]


def test_model_template_prompt_is_encoded_without_special_tokens():
    encoder = RecordingEncoder()
    template = ChatTemplate("{{ bos_token }}{{ messages[0]['content'] }}", bos_token="<s>")
    req = parse_chat({"messages": USER}, LIMITS, encoder, template)
    # The prompt, then the conversation through each message (its token endpoint),
    # encoded the same way.
    assert encoder.calls == [("<s>Hello", False), ("<s>Hello", False)]
    assert req.prompt_token_ids == (1, 2, 3)
    encoder.calls.clear()
    parse_chat({"messages": USER}, LIMITS, encoder, FALLBACK)
    assert encoder.calls == [
        ("<|user|>\nHello\n<|assistant|>\n", True),
        ("<|user|>\nHello\n", True),
    ]


def test_template_refusal_is_a_400_naming_messages(tok):
    template = ChatTemplate("{{ raise_exception('roles must alternate') }}")
    error = refusal(parse_chat, {"messages": USER}, LIMITS, tok, template)
    assert (error.status, error.param) == (400, "messages")
    assert "roles must alternate" in error.message


def test_batched_completion_prompts_give_one_request_each():
    from runtime.frontend.protocol.completions import parse_completions

    limits = ServingLimits("m", 512, 64)
    tok = _BatchTokenizer()
    reqs = parse_completions({"prompt": ["ab", "cde"], "max_tokens": 3, "n": 2}, limits, tok)
    assert [r.prompt_token_ids for r in reqs] == [(97, 98), (99, 100, 101)]
    assert all(r.n == 2 and r.max_tokens == 3 for r in reqs)
    ids = parse_completions({"prompt": [[1, 2], [3]], "max_tokens": 2}, limits, tok)
    assert [r.prompt_token_ids for r in ids] == [(1, 2), (3,)]
    single = parse_completions({"prompt": ["only"], "max_tokens": 2}, limits, tok)
    assert len(single) == 1 and single[0].prompt == "only"
    assert len(parse_completions({"prompt": [5, 6], "max_tokens": 2}, limits, tok)) == 1
    with pytest.raises(RequestError) as raised:
        parse_completions({"prompt": ["ok", ""], "max_tokens": 2}, limits, tok)
    assert raised.value.param == "prompt[1]" and raised.value.status == 400
    with pytest.raises(RequestError) as raised:
        parse_completions({"prompt": [[1], [999]], "max_tokens": 2}, limits, tok)
    assert raised.value.param == "prompt[1]"
    with pytest.raises(RequestError) as raised:
        parse_completions({"prompt": ["x"] * 65}, limits, tok)
    assert raised.value.param == "prompt"


class _BatchTokenizer:
    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) for c in text]
