"""Log probabilities in the responses' shapes: the legacy completions map and the
chat ``content`` list, tokens named by text or (vLLM's
``return_tokens_as_token_ids``) by id."""

from __future__ import annotations

import math
from typing import Any

from runtime.frontend.server.generation import Piece
from runtime.frontend.server.state import Frontend
from runtime.transport.api import TokenLogprobs

MIN_LOGPROB = -9999.0  # JSON has no -inf (vLLM clamps the same way)


def _lp(value: float) -> float:
    return max(value, MIN_LOGPROB) if not math.isnan(value) else MIN_LOGPROB


def _token_text(fe: Frontend, token: int, as_id: bool = False) -> str:
    """A token as logprobs name it: its text, or with vLLM's
    ``return_tokens_as_token_ids`` ``"token_id:{id}"`` (any token, JSON-safe)."""
    if as_id:
        return f"token_id:{token}"
    return fe.tokenizer.decode([token], skip_special_tokens=False)


def completion_logprobs(
    fe: Frontend, piece: Piece, offset: int, as_ids: bool = False
) -> dict[str, Any]:
    """``text_offset`` counts the tokens' text, also when they are named by id."""
    texts = [_token_text(fe, t) for t in piece.token_ids]
    offsets = []
    for text in texts:
        offsets.append(offset)
        offset += len(text)
    return {
        "tokens": [_token_text(fe, t, True) for t in piece.token_ids] if as_ids else texts,
        "token_logprobs": [_lp(item.logprob) for item in piece.logprobs],
        "top_logprobs": [_top_by_text(fe, item, as_ids) for item in piece.logprobs],
        "text_offset": offsets,
    }


def _top_by_text(fe: Frontend, item: TokenLogprobs, as_ids: bool = False) -> dict[str, float]:
    """The legacy completions map, text -> logprob; tokens decoding to the same
    text (byte pieces) keep the best entry, so the map stays best-first.  With
    ``as_ids`` the keys are ``"token_id:{id}"``, one per alternative."""
    top: dict[str, float] = {}
    for token, value in zip(item.top_token_ids, item.top_logprobs):
        top.setdefault(_token_text(fe, token, as_ids), _lp(value))
    return top


def chat_logprobs(fe: Frontend, piece: Piece, as_ids: bool = False) -> list[dict[str, Any]]:
    """With ``as_ids`` tokens are ``"token_id:{id}"``; as in vLLM, the sampled token's
    ``bytes`` stay its text's and an alternative's are those of its ``token`` string."""

    def entry(token: int, value: float, sampled: bool = False) -> dict[str, Any]:
        name = _token_text(fe, token, as_ids)
        text = _token_text(fe, token) if sampled and as_ids else name
        return {"token": name, "logprob": _lp(value), "bytes": list(text.encode())}

    return [
        {
            **entry(token, item.logprob, sampled=True),
            "top_logprobs": [entry(t, v) for t, v in zip(item.top_token_ids, item.top_logprobs)],
        }
        for token, item in zip(piece.token_ids, piece.logprobs)
    ]


def merge_completion_logprobs(into: dict[str, Any] | None, more: dict[str, Any]) -> dict:
    if into is None:
        return more
    for key in into:
        into[key].extend(more[key])
    return into


def echo_logprobs(fe: Frontend, req: Any, piece: Piece, as_ids: bool = False) -> dict[str, Any]:
    """The legacy completions map of an echoed prompt (``echo`` with ``logprobs``):
    every prompt token, the first one's log probability and alternatives null
    (it has no context), then each next token's from the scored prompt;
    ``text_offset`` from 0."""
    ids = req.prompt_token_ids
    entries = piece.prompt_logprobs
    texts = [_token_text(fe, t) for t in ids]
    offsets, offset = [], 0
    for text in texts:
        offsets.append(offset)
        offset += len(text)
    k = req.logprobs or 0
    return {
        "tokens": [_token_text(fe, t, True) for t in ids] if as_ids else texts,
        "token_logprobs": [None, *(_lp(item.logprob) for item in entries)],
        "top_logprobs": [None, *(_top_by_text(fe, _first(item, k), as_ids) for item in entries)],
        "text_offset": offsets,
    }


def _first(item: TokenLogprobs, k: int) -> TokenLogprobs:
    """``item`` with its first ``k`` alternatives (the prompt may be scored wider)."""
    return TokenLogprobs(item.logprob, item.top_token_ids[:k], item.top_logprobs[:k])


def vllm_prompt_logprobs(fe: Frontend, req: Any, piece: Piece) -> list[dict[str, Any] | None]:
    """vLLM's ``prompt_logprobs`` of a choice: None for the first prompt token, then
    per token ``{token_id: {logprob, rank, decoded_token}}`` for the prompt token
    and its top ``prompt_logprobs`` alternatives (rank: 1-based among the
    alternatives; the prompt token's is null when it is not among them: the
    ranks return the top-k, not every rank)."""
    k = req.prompt_logprobs or 0
    out: list[dict[str, Any] | None] = [None]
    for token, item in zip(req.prompt_token_ids[1:], piece.prompt_logprobs):
        ranked: dict[str, Any] = {}
        top = list(zip(item.top_token_ids[:k], item.top_logprobs[:k]))
        rank = next((i + 1 for i, (t, _) in enumerate(top) if t == token), None)
        ranked[str(token)] = {
            "logprob": _lp(item.logprob), "rank": rank, "decoded_token": _token_text(fe, token)
        }  # fmt: skip
        for i, (t, value) in enumerate(top):
            ranked.setdefault(
                str(t), {"logprob": _lp(value), "rank": i + 1, "decoded_token": _token_text(fe, t)}
            )
        out.append(ranked)
    return out
