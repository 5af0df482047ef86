"""Incremental detokenization of one request's output, with stop strings.

Decoding each new token on its own is wrong for byte-level and SentencePiece
tokenizers: a character may span tokens, and how a token decodes can depend on the one
before it. So, as vLLM does, the detokenizer keeps two offsets into the token ids
(prompt included): ``prefix_offset`` starts a short window of already emitted tokens that
gives the decoder its context, and ``read_offset`` is where the emitted tokens end. After
each token it decodes ``ids[prefix_offset:read_offset]`` and ``ids[prefix_offset:]``; the
difference is the new text, emitted only once the decode no longer ends in U+FFFD (an
incomplete UTF-8 sequence waiting for its next bytes). Then both offsets move forward.

Stop strings: new text is appended to a pending buffer. A stop string found in it ends
the request: the text before it is emitted, the stop string and everything after it
never are. Otherwise the longest end of the buffer that could still grow into a stop
string is held back and the rest is emitted, so the client never sees part of a stop
string. ``finish()`` (length, EOS, cancellation) decodes what is left, incomplete bytes
included, and flushes the held text. Stop token ids are the caller's business.

With ``include_stop`` (vLLM's ``include_stop_str_in_output``) the stop string is part of
the text: nothing is held back, since a stop string's beginning is shown either way, and
the text ends where the stop string does. The last characters already emitted are kept
for the search, so a stop string split across pushes is still found.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

__all__ = ["Decoder", "Delta", "IncrementalDetokenizer"]

# Prompt tokens decoded before the first output token, for context (vLLM uses 5 too).
_CONTEXT_TOKENS = 5
_REPLACEMENT = "\ufffd"


class Decoder(Protocol):
    """What the detokenizer needs of a tokenizer (``ModelTokenizer`` is one)."""

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = True) -> str: ...


@dataclass(frozen=True)
class Delta:
    """The result of one ``push`` or ``finish``.

    ``text``: new text for the client (may be empty). ``stopped``: a stop string ended the
    request; ``stop_reason`` is that string. ``num_tokens``: how many of the pushed ids were
    consumed; fewer than pushed when a stop string ended the request partway through.
    """

    text: str
    stopped: bool = False
    stop_reason: str | None = None
    num_tokens: int = 0


class IncrementalDetokenizer:
    """Turns one request's output token ids into text deltas; see the module docstring.

    ``stop``: stop strings (empty strings are not allowed). ``min_tokens``: stop strings
    completed by the first ``min_tokens`` output tokens do not stop the request (vLLM's
    meaning). ``include_stop``: the stop string that ends the request is emitted too.
    After a stop or ``finish()``, ``push`` and ``finish`` return an empty delta
    (``stopped`` still set after a stop) and consume nothing.
    """

    def __init__(
        self,
        tokenizer: Decoder,
        prompt_token_ids: Sequence[int],
        stop: Sequence[str] = (),
        *,
        skip_special_tokens: bool = True,
        min_tokens: int = 0,
        include_stop: bool = False,
    ) -> None:
        if any(not s for s in stop):
            raise ValueError("stop strings must be non-empty")
        self._tokenizer = tokenizer
        self._stop = tuple(stop)
        self._skip_special_tokens = skip_special_tokens
        self._min_tokens = min_tokens
        self._ids = list(prompt_token_ids)
        self._prefix_offset = max(len(self._ids) - _CONTEXT_TOKENS, 0)
        self._read_offset = len(self._ids)
        self._pending = ""  # decoded, not yet emitted: a possible stop string's start
        self._include_stop = include_stop
        self._tail = ""  # include_stop: emitted text a split stop string may begin in
        self._tail_chars = max((len(s) for s in self._stop), default=1) - 1
        self._num_output = 0
        self._done = False
        self._stop_reason: str | None = None

    @property
    def stop_reason(self) -> str | None:
        """The stop string that ended the request, or None."""
        return self._stop_reason

    def push(self, token_ids: Sequence[int]) -> Delta:
        """Add output tokens; return the text that is now safe to show."""
        if self._done:
            return self._ended()
        parts: list[str] = []
        for consumed, token in enumerate(token_ids, start=1):
            self._ids.append(token)
            self._num_output += 1
            self._pending += self._decode_new(final=False)
            parts.append(self._release())
            if self._done:
                return Delta("".join(parts), True, self._stop_reason, consumed)
        return Delta("".join(parts), num_tokens=len(token_ids))

    def finish(self) -> Delta:
        """The request ended for another reason: decode the rest, incomplete bytes included,
        and flush the held text (up to a stop string, should the rest complete one)."""
        if self._done:
            return self._ended()
        self._pending += self._decode_new(final=True)
        text = self._release(final=True)
        self._done = True
        return Delta(text, self._stop_reason is not None, self._stop_reason)

    def _ended(self) -> Delta:
        return Delta("", self._stop_reason is not None, self._stop_reason)

    def _decode_new(self, *, final: bool) -> str:
        """Text of the tokens past ``read_offset``, or "" while it is incomplete."""
        window = self._ids[self._prefix_offset :]
        split = self._read_offset - self._prefix_offset
        skip = self._skip_special_tokens
        prefix_text = self._tokenizer.decode(window[:split], skip_special_tokens=skip)
        full_text = self._tokenizer.decode(window, skip_special_tokens=skip)
        if len(full_text) <= len(prefix_text):
            return ""  # e.g. a skipped special token: nothing new yet
        if full_text.endswith(_REPLACEMENT) and not final:
            return ""  # wait for the rest of the character
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return full_text[len(prefix_text) :]

    def _release(self, *, final: bool = False) -> str:
        """Take the emittable text out of the pending buffer, detecting stop strings."""
        if self._include_stop:
            return self._release_through_stop()
        pending = self._pending
        if self._num_output >= self._min_tokens:
            hits = [(i, s) for s in self._stop if (i := pending.find(s)) >= 0]
            if hits:
                index, self._stop_reason = min(hits, key=lambda hit: hit[0])
                self._pending = ""
                self._done = True
                return pending[:index]
        held = 0 if final else max((_partial_stop(pending, s) for s in self._stop), default=0)
        self._pending = pending[len(pending) - held :]
        return pending[: len(pending) - held]

    def _release_through_stop(self) -> str:
        """``_release`` for ``include_stop``: emit everything, up to the end of the first
        stop string that ends in the new text."""
        new, self._pending = self._pending, ""
        window, start = self._tail + new, len(self._tail)
        if self._num_output >= self._min_tokens:
            # Only occurrences that end in the new text: older ones were seen (or were
            # completed before min_tokens) already.
            hits = [
                (i, s) for s in self._stop if (i := window.find(s, max(start - len(s) + 1, 0))) >= 0
            ]
            if hits:
                index, self._stop_reason = min(hits, key=lambda hit: hit[0])
                self._done = True
                return window[start : index + len(self._stop_reason)]
        keep = self._tail_chars
        self._tail = window[len(window) - keep :] if keep else ""
        return new


def _partial_stop(text: str, stop: str) -> int:
    """Length of the longest end of ``text`` that is a proper beginning of ``stop``."""
    for k in range(min(len(stop) - 1, len(text)), 0, -1):
        if text.endswith(stop[:k]):
            return k
    return 0
