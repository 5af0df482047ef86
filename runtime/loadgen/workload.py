"""Seeded request generation: what each request asks for and when it is sent.

Everything derives from one seed, so two runs with the same flags send the same
prompts on the same schedule, which is what makes two servers comparable.
Prompts and arrivals draw from separate random streams, so changing the request
rate leaves the prompts unchanged.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Literal

# Common English words.  A prompt of N words is N * (tokens per word) tokens, and
# that ratio is the tokenizer's: measured, 2.46 with the embedded default model's
# 512-token vocabulary (EMBEDDED_TOKENS_PER_WORD; tests/loadgen re-measures it).
# Use token-id prompts for exact lengths.
WORDS: tuple[str, ...] = (
    "the", "of", "and", "to", "in", "is", "that", "it", "was", "for", "on", "are", "as", "with",
    "his", "they", "at", "be", "this", "from", "have", "or", "by", "one", "had", "not", "but",
    "what", "all", "were", "when", "we", "there", "can", "an", "your", "which", "their", "said",
    "if", "do", "will", "each", "about", "how", "up", "out", "them", "then", "she", "many",
    "some", "so", "these", "would", "other", "into", "has", "more", "her", "two", "like", "him",
    "see", "time", "could", "no", "make", "than", "first", "been", "its", "who", "now",
    "people", "my", "made", "over", "did", "down", "only", "way", "find", "use", "may", "water",
    "long", "little", "very", "after", "words", "called", "just", "where", "most", "know",
    "get", "through", "back", "much", "before", "go", "good", "new", "write", "our", "used",
    "me", "man", "too", "any", "day", "same", "right", "look", "think", "also", "around",
    "another", "came", "come", "work", "three", "word", "must", "because", "does", "part",
)  # fmt: skip

EMBEDDED_TOKENS_PER_WORD = 2.46  # 200 seeded 128-word prompts, embedded default model

# Token ids drawn for token-id prompts when the vocabulary is unknown: clear of the
# low ids that tokenizers use for special tokens, inside every common vocabulary
# (32k and up).  When it is known, token_id_range_for(vocab_size) instead.
TOKEN_ID_RANGE = (1000, 30000)


def token_id_range_for(vocab_size: int) -> tuple[int, int]:
    """Token ids [lo, hi) for token-id prompts against a vocabulary of ``vocab_size``:
    clear of the lowest tenth (at most 1000 ids: byte and control tokens) and of the
    top tenth, where vocabularies keep their special tokens (the embedded model's
    512 give 51:460)."""
    if type(vocab_size) is not int or vocab_size < 2:
        raise ValueError(f"vocab_size must be an integer >= 2, got {vocab_size!r}")
    lo = min(1000, vocab_size // 10)
    hi = max(lo + 1, vocab_size * 9 // 10)
    return lo, hi


PromptKind = Literal["words", "token-ids"]


@dataclass(frozen=True)
class Distribution:
    """A length distribution over positive ints.

    ``fixed``: always ``a``.  ``uniform``: an int in [a, b].  ``normal``: mean
    ``a``, deviation ``b``, rounded and clamped to [low, high] (high None: no cap).
    """

    kind: Literal["fixed", "uniform", "normal"]
    a: float
    b: float = 0.0
    low: int = 1
    high: int | None = None

    def sample(self, rng: random.Random) -> int:
        if self.kind == "fixed":
            return int(self.a)
        if self.kind == "uniform":
            return rng.randint(int(self.a), int(self.b))
        value = max(self.low, round(rng.gauss(self.a, self.b)))
        return value if self.high is None else min(self.high, value)

    def __str__(self) -> str:
        """The flag text that parses back to this distribution."""
        if self.kind == "fixed":
            return str(int(self.a))
        if self.kind == "uniform":
            return f"uniform:{int(self.a)}:{int(self.b)}"
        clamp = "" if self.high is None else f":{self.low}:{self.high}"
        return f"normal:{self.a:g}:{self.b:g}{clamp}"


def parse_distribution(text: str) -> Distribution:
    """Parse ``N``, ``uniform:LO:HI`` or ``normal:MEAN:STD[:LO:HI]``; raise
    ValueError saying what is wrong."""
    kind, *fields = text.strip().split(":")

    def number(field: str, convert: type[int] | type[float] = int) -> float:
        try:
            value = convert(field)
        except ValueError:
            raise ValueError(f"{field!r} is not a number in {text!r}") from None
        if not math.isfinite(value):
            raise ValueError(f"{field!r} is not finite in {text!r}")
        return value

    if not fields:
        value = number(kind)
        if value < 1:
            raise ValueError(f"a length must be >= 1, got {text!r}")
        return Distribution("fixed", value)
    if kind == "uniform" and len(fields) == 2:
        lo, hi = number(fields[0]), number(fields[1])
        if not 1 <= lo <= hi:
            raise ValueError(f"uniform needs 1 <= LO <= HI, got {text!r}")
        return Distribution("uniform", lo, hi)
    if kind == "normal" and len(fields) in (2, 4):
        mean, std = number(fields[0], float), number(fields[1], float)
        lo, hi = (number(fields[2]), number(fields[3])) if len(fields) == 4 else (1, None)
        if mean < 1 or std < 0:
            raise ValueError(f"normal needs MEAN >= 1 and STD >= 0, got {text!r}")
        if lo < 1 or (hi is not None and hi < lo):
            raise ValueError(f"normal clamp needs 1 <= LO <= HI, got {text!r}")
        return Distribution("normal", mean, std, int(lo), None if hi is None else int(hi))
    raise ValueError(f"expected N, uniform:LO:HI or normal:MEAN:STD[:LO:HI], got {text!r}")


@dataclass(frozen=True)
class WorkRequest:
    """One request to send.  ``prompt_len`` counts the words or token ids sent; the
    server's usage figure replaces it in the report when the server gives one."""

    index: int
    prompt: str | tuple[int, ...]
    prompt_len: int
    output_len: int


@dataclass(frozen=True)
class WorkloadSpec:
    """What to send.  ``prompts``, when given, are used in order (cycled) instead of
    generated prompts; output lengths are still drawn from ``output_len``."""

    num_requests: int
    prompt_len: Distribution
    output_len: Distribution
    prompt_kind: PromptKind = "words"
    prompts: tuple[str, ...] = ()
    seed: int = 0
    token_id_range: tuple[int, int] = TOKEN_ID_RANGE  # [lo, hi) for token-id prompts

    def __post_init__(self) -> None:
        if self.num_requests < 1:
            raise ValueError(f"num_requests must be >= 1, got {self.num_requests}")
        lo, hi = self.token_id_range
        if not 0 <= lo < hi:
            raise ValueError(f"token_id_range must satisfy 0 <= lo < hi, got {lo}:{hi}")


def build_requests(spec: WorkloadSpec) -> list[WorkRequest]:
    """The requests of ``spec``, identical for identical specs."""
    rng = random.Random(f"{spec.seed}:prompts")
    requests = []
    for index in range(spec.num_requests):
        prompt: str | tuple[int, ...]
        if spec.prompts:
            prompt = spec.prompts[index % len(spec.prompts)]
            length = len(prompt.split())
        elif spec.prompt_kind == "token-ids":
            length = spec.prompt_len.sample(rng)
            prompt = tuple(rng.randrange(*spec.token_id_range) for _ in range(length))
        else:
            length = spec.prompt_len.sample(rng)
            prompt = " ".join(rng.choices(WORDS, k=length))
        requests.append(WorkRequest(index, prompt, length, spec.output_len.sample(rng)))
    return requests


def arrival_offsets(num_requests: int, rate: float, seed: int = 0) -> list[float]:
    """Send times in seconds from the start for a Poisson process of ``rate``
    requests/s: the first at 0, then exponential gaps of mean 1/rate.  An infinite
    rate sends everything at once (also the schedule of fixed-concurrency runs)."""
    if not rate > 0:
        raise ValueError(f"rate must be > 0, got {rate}")
    if math.isinf(rate):
        return [0.0] * num_requests
    rng = random.Random(f"{seed}:arrivals")
    offsets, now = [], 0.0
    for _ in range(num_requests):
        offsets.append(now)
        now += rng.expovariate(rate)
    return offsets
