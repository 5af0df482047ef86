"""Incremental detokenization: exact text token by token, stop strings never leak."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from runtime.frontend.detokenizer import Delta, IncrementalDetokenizer
from runtime.frontend.tokenizer import ModelTokenizer
from runtime.ranks.model import default_model_dir

SENTENCES = [
    "héllo wörld 日本語 🙂",
    "The quick brown fox jumps over the lazy dog.",
    "日本語のテキストと絵文字 🙂🚀 が混ざっています。",
    "Grüße aus München, naïve café, crème brûlée.",
    "héllo again, wörld! 日本 🙂🙂",
]
TEXTS = [
    "héllo wörld 日本語 🙂",
    "Grüße 🚀🙂 naïve 日本語のテキスト done.",
    "plain ascii, with  two spaces\nand a newline",
    "🙂",
]
PROMPT = "Once upon a time "
TEXT = TEXTS[0]


def trained_bpe() -> ModelTokenizer:
    """A byte-level BPE learned from SENTENCES: merges inside multi-byte characters, so
    tokens end partway through UTF-8 sequences."""
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=280,  # few merges: tokens like "w\xc3" and "\xb6rld" straddle characters
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<s>", "</s>"],
        show_progress=False,
    )
    backend.train_from_iterator(SENTENCES, trainer)
    return ModelTokenizer(backend, bos_token_id=0, eos_token_ids=(1,))


@pytest.fixture(scope="module", params=["trained-bpe", "embedded-default"])
def tok(request) -> ModelTokenizer:
    if request.param == "trained-bpe":
        return trained_bpe()
    return ModelTokenizer.from_dir(default_model_dir())


@pytest.fixture(scope="module")
def bpe() -> ModelTokenizer:
    return trained_bpe()


def stream(
    tok: ModelTokenizer, text: str, stop: tuple[str, ...] = (), chunk: int = 1, **kwargs
) -> tuple[list[Delta], Delta, IncrementalDetokenizer]:
    """Push ``text``'s tokens ``chunk`` at a time after PROMPT; the deltas and finish()."""
    ids = tok.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, tok.encode(PROMPT), stop, **kwargs)
    deltas = [detok.push(ids[i : i + chunk]) for i in range(0, len(ids), chunk)]
    return deltas, detok.finish(), detok


def test_trained_tokenizer_splits_characters_across_tokens(bpe):
    pieces = [bpe.decode([i]) for i in bpe.encode(TEXTS[0], add_special_tokens=False)]
    # Tokens that hold a whole character and part of the next: the tests below mean something.
    assert any("\ufffd" in piece and piece.strip("\ufffd") for piece in pieces)
    assert len(pieces) > len(TEXTS[0].split())


@pytest.mark.parametrize("chunk", [1, 2, 3, 100])
@pytest.mark.parametrize("text", TEXTS)
def test_streaming_reproduces_the_decoded_text_exactly(tok, text, chunk):
    ids = tok.encode(text, add_special_tokens=False)
    deltas, final, _ = stream(tok, text, chunk=chunk)
    assert "".join(d.text for d in deltas) + final.text == tok.decode(ids) == text
    assert all("\ufffd" not in d.text for d in deltas)  # never half a character
    assert sum(d.num_tokens for d in deltas) == len(ids)
    assert final.text == "" and not final.stopped  # complete text needs no flush


def test_prompt_context_keeps_the_first_word_boundary():
    """A Metaspace (SentencePiece-style) decoder drops the leading space of a text's first
    word: decoded after the prompt tail, the first output word keeps its space."""
    backend = Tokenizer(models.BPE(unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>"], show_progress=False)
    backend.train_from_iterator([*SENTENCES, PROMPT], trainer)
    tok = ModelTokenizer(backend)
    deltas, final, _ = stream(tok, TEXT)
    assert tok.decode(tok.encode(TEXT)) == TEXT  # alone, no leading space
    assert "".join(d.text for d in deltas) + final.text == " " + TEXT


def test_incomplete_character_is_held_until_complete_or_finish(bpe):
    # "🙂" is F0 9F 99 82: one byte token each, in ByteLevel's printable alphabet.
    byte_ids = [bpe.backend.token_to_id(c) for c in "ðŁĻĤ"]
    detok = IncrementalDetokenizer(bpe, bpe.encode(PROMPT))
    assert [detok.push([i]).text for i in byte_ids] == ["", "", "", "🙂"]
    partial = IncrementalDetokenizer(bpe, bpe.encode(PROMPT))
    assert partial.push(byte_ids[:2]) == Delta("", num_tokens=2)
    assert partial.finish() == Delta("\ufffd")


def test_special_tokens_are_skipped_unless_asked(bpe):
    eos = bpe.backend.token_to_id("</s>")
    ids = [*bpe.encode("done", add_special_tokens=False), eos]
    skipped = IncrementalDetokenizer(bpe, [])
    assert skipped.push(ids).text + skipped.finish().text == "done"
    kept = IncrementalDetokenizer(bpe, [], skip_special_tokens=False)
    assert kept.push(ids).text + kept.finish().text == "done</s>"


# -- stop strings --------------------------------------------------------------------------


def test_multi_token_stop_is_never_partially_emitted(tok):
    deltas, final, detok = stream(tok, TEXT, stop=("wörld",))
    emitted, seen = "", []
    for delta in deltas:
        emitted += delta.text
        seen.append(emitted)
        if delta.stopped:
            break
    assert all("héllo ".startswith(s) for s in seen)  # never any part of "wörld"
    assert emitted == "héllo "
    stop_at = next(i for i, d in enumerate(deltas) if d.stopped)
    assert deltas[stop_at] == Delta("", True, "wörld", 1)
    held = [d for d in deltas[:stop_at] if d.text == ""]
    assert len(held) >= 1  # the stop string spans several tokens: some were held back
    assert detok.stop_reason == "wörld"
    assert final == Delta("", True, "wörld")
    assert deltas[-1] == Delta("", True, "wörld", 0)  # pushes after the stop consume nothing


def test_stop_in_a_batch_reports_the_tokens_consumed(tok):
    ids = tok.encode(TEXT, add_special_tokens=False)
    one_by_one, _, _ = stream(tok, TEXT, stop=("wörld",))
    completing = next(i for i, d in enumerate(one_by_one) if d.stopped)
    detok = IncrementalDetokenizer(tok, tok.encode(PROMPT), ("wörld",))
    delta = detok.push(ids)
    assert delta == Delta("héllo ", True, "wörld", completing + 1)
    assert completing + 1 < len(ids)


def test_text_before_the_stop_is_emitted_and_the_earliest_stop_wins(tok):
    deltas, _, _ = stream(tok, TEXT, stop=("🙂", "日本"))
    assert "".join(d.text for d in deltas) == "héllo wörld "
    assert deltas[-1].stop_reason == "日本"
    # Completed by the same token, the stop that starts first wins.
    deltas, _, _ = stream(tok, TEXT, stop=("rld", "wörld"))
    assert "".join(d.text for d in deltas) == "héllo "
    assert next(d for d in deltas if d.stopped).stop_reason == "wörld"
    # Overlapping stops: the one completed first ends the request.
    deltas, _, _ = stream(tok, TEXT, stop=("wörld 日本語", "ld"))
    assert "".join(d.text for d in deltas) == "héllo wör"
    assert next(d for d in deltas if d.stopped).stop_reason == "ld"


def test_finish_flushes_held_text(tok):
    deltas, final, _ = stream(tok, "héllo wörld", stop=("wörld!",))
    assert "".join(d.text for d in deltas) == "héllo "  # "wörld" could become "wörld!"
    assert final == Delta("wörld")


def test_held_text_is_released_once_it_cannot_become_a_stop(tok):
    deltas, final, _ = stream(tok, TEXT, stop=("wörlds", "日本人"))
    assert "".join(d.text for d in deltas) == TEXT
    assert final == Delta("")


def test_stop_at_the_very_start_emits_nothing(tok):
    deltas, final, _ = stream(tok, TEXT, stop=("h",))
    assert deltas[0] == Delta("", True, "h", 1)
    assert final == Delta("", True, "h")


def test_min_tokens_delays_stop_strings(tok):
    ids = tok.encode(TEXT, add_special_tokens=False)
    deltas, final, _ = stream(tok, TEXT, stop=("héllo",), min_tokens=len(ids))
    assert "".join(d.text for d in deltas) + final.text == TEXT
    assert not any(d.stopped for d in deltas) and not final.stopped
    deltas, _, _ = stream(tok, TEXT, stop=("🙂",), min_tokens=1)
    assert "".join(d.text for d in deltas) == "héllo wörld 日本語 "


@pytest.mark.parametrize("chunk", [1, 3])
def test_a_stop_string_completed_by_token_number_min_tokens_stops_there(tok, chunk):
    """vLLM's gate: stop strings count once the output has min_tokens tokens, so the
    one that token number min_tokens completes stops the request (and one completed by
    token min_tokens - 1 does not)."""
    text = "Grüße aus München, naïve café, crème brûlée."
    ids = tok.encode(text, add_special_tokens=False)
    checked = 0
    for k in range(2, len(ids)):
        before, upto = tok.decode(ids[: k - 1]), tok.decode(ids[:k])
        if "\ufffd" in upto or len(upto) <= len(before):
            continue  # token k ends partway through a character, or adds no text
        stop = before[-1:] + upto[len(before) :][:1]  # straddles tokens k - 1 and k
        if not stop.strip() or stop in before or upto.find(stop) != len(before) - 1:
            continue
        for min_tokens, stops_at in ((k, k), (k + 1, None)):
            detok = IncrementalDetokenizer(tok, tok.encode(PROMPT), (stop,), min_tokens=min_tokens)
            consumed, shown, stopped = 0, "", False
            for i in range(0, len(ids), chunk):
                delta = detok.push(ids[i : i + chunk])
                consumed += delta.num_tokens
                shown += delta.text
                if delta.stopped:
                    stopped = True
                    break
            if stops_at is None:  # min_tokens + 1: token k's completion is too early
                assert not stopped or consumed > k, (k, stop)
            else:
                assert stopped and consumed == k, (k, stop, consumed)
                assert shown == before[:-1]  # everything before the stop string
        checked += 1
    assert checked >= 3


def test_empty_stop_string_is_refused(bpe):
    with pytest.raises(ValueError, match="non-empty"):
        IncrementalDetokenizer(bpe, [], ("ok", ""))
