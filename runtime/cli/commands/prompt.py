"""``flare run --prompt TEXT``: one completion in this process, printed apart from
the prompt, with the run's figures."""

from __future__ import annotations

import argparse
import logging
import sys
import time
from collections.abc import Sequence

from runtime.catalog import describe_counts
from runtime.cli.flags.debugging import trace_options
from runtime.deploy.config import DeploymentConfig
from runtime.deploy.local import LocalDeployment
from runtime.transport.images import SubmitImage

log = logging.getLogger("runtime.cli")


def completion_text(tokenizer, prompt_ids: list[int], out: list[int]) -> str:
    """The completion's text as it continues the prompt: decoded together with the
    prompt and cut after it (a token's leading space survives), else on its own."""
    prefix = tokenizer.decode(prompt_ids)
    whole = tokenizer.decode(prompt_ids + out)
    return whole[len(prefix) :] if whole.startswith(prefix) else tokenizer.decode(out)


def _ms(ns: float) -> str:
    return f"{ns / 1e6:.1f} ms"


def describe_summary(summary: dict) -> str:
    """The engine's frame figures (``EngineStats.summary``) in words, one line."""
    frames = summary.get("frames", 0)
    parts = [f"{frames} frame{'s' if frames != 1 else ''}"]
    if "mean_device_ns" in summary:
        parts[0] += f", {_ms(summary['mean_device_ns'])} of device time each"
    overhead = []
    if "host_overhead_ratio" in summary:
        alone = f"host {100 * (summary['host_overhead_ratio'] - 1):.1f}% per frame"
        if "round_trip_ns" in summary:
            alone += f" ({_ms(summary['round_trip_ns'])} round trip)"
        overhead.append(alone)
    if "busy_overhead_ratio" in summary:
        overhead.append(f"{100 * (summary['busy_overhead_ratio'] - 1):.1f}% over the busy span")
    if overhead:
        parts.append("overhead over device time: " + ", ".join(overhead))
    return "; ".join(parts)


def describe_prompt(ids: list[int], args: argparse.Namespace) -> str:
    """``N tokens``, and with ``--image`` ``, K images: FILE, ...``."""
    paths = getattr(args, "image", None) or []
    if not paths:
        return f"{len(ids)} tokens"
    return f"{len(ids)} tokens, {len(paths)} image{'s' if len(paths) != 1 else ''}: " + ", ".join(
        paths
    )


# --prompt prints labelled blocks: the labels, the prompt and the figures on
# stderr, the completion alone on stdout (so `> FILE` keeps only the completion).
LABEL = "==>"


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def generate_once(
    args: argparse.Namespace,
    config: DeploymentConfig,
    sampling,
    tokenizer,
    ids: list[int],
    images: Sequence[SubmitImage] = (),
) -> int:
    """``--prompt``: one completion in this process, printed apart from the prompt.
    ``images``: ``--image``'s, in the prompt ``ids`` (commands/image_prompt.py).

    On stderr the start-up summary, ``==> prompt (N tokens)`` (``N tokens, K images:
    FILE, ...`` with ``--image``) and the prompt, then
    ``==> completion (N generated tokens in T ms, finish: REASON)``; on stdout the
    completion alone; last, on stderr, ``==> figures: ...`` (:func:`describe_summary`).
    """
    started = time.monotonic()
    deployment = LocalDeployment(config)
    tracing = trace_options(args)
    if tracing is not None:
        deployment.engine.enable_trace(tracing)
    try:
        deployment.start()
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # a rank died, a timeout: one line, the ranks said why
        print(f"flare: start-up failed: {exc}", file=sys.stderr)
        return 1
    try:
        engine = deployment.engine
        facts = engine.facts
        log.info("coordinator at %s", engine.endpoints.frames)
        _say(
            f"flare: serving {facts.model_name} with TP={config.tensor_parallel_size}, "
            f"catalog of {describe_counts(facts.descriptors)}, "
            f"ready in {time.monotonic() - started:.1f} s"
        )
        t0 = time.monotonic()
        stream = engine.submit(ids, args.max_tokens, sampling, images=tuple(images))
        out: list[int] = []
        for event in stream:
            out += event.token_ids
        seconds = time.monotonic() - t0
        _say(f"{LABEL} prompt ({describe_prompt(ids, args)})")
        _say(args.prompt)
        _say(
            f"{LABEL} completion ({len(out)} generated tokens in {seconds * 1e3:.0f} ms, "
            f"finish: {stream.finish_reason})"
        )
        print(completion_text(tokenizer, ids, out), flush=True)
        summary = engine.stats.summary()
    finally:
        deployment.stop()
    trace = deployment.engine.trace
    if trace is not None:
        counters = trace.counters()
        _say(
            f"trace: {counters['trace_lines']} frames written to {args.trace} "
            f"({counters['trace_dropped']} dropped)"
        )
    _say(f"{LABEL} figures: {describe_summary(summary)}")
    if stream.finish_reason == "error":  # the engine failed: the log above says why
        print(f"flare: the engine failed: {stream.error}", file=sys.stderr)
        return 1
    return 0
