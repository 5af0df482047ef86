"""Images through a deployment (issue 27): ``python scripts/bench_vision.py``.

On the CPU default (the embedded vision model, runtime/ranks/model/weights/vision;
``--model DIR`` for another LLaVA directory), TP=1:

* **image requests** at 1, 4 and 16 concurrent: each a chat request with one
  drawn image (a coloured shape, as the embedded model was trained on) prepared
  exactly as the chat route prepares it (runtime.frontend's Preparer: decoding,
  ``preprocessor_config.json``, the chat template, ``<image>`` expanded), kept at
  that concurrency (closed loop) for ``--requests`` requests; images per second
  and TTFT p50/p99 (submission to first token);
* **vision frames' share of device time** over those runs (the engine's
  per-kind device time);
* **text-only requests beside them** (``--text-repeats``, one at a time):
  their median TTFT and their inter-token gaps' p50/p99, alone, then while
  image requests run at 4 concurrent, then while their
  *text twins* run (the same prompts with each image's tokens replaced by
  text: the same lengths and prefill work, no vision), to separate what the
  images cost from what any arriving prompt costs (``--trace FILE`` writes
  the run's plan trace; ``--mixed-prefill`` also captures mixed programs).

Prints a table; the last line is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import threading
import time
from io import BytesIO
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from runtime.deploy.config import DeploymentConfig
from runtime.deploy.local import LocalDeployment

DEFAULT_MODEL = Path(__file__).resolve().parent.parent / "runtime/ranks/model/weights/vision"
COLOURS = {"red": (220, 30, 30), "green": (30, 170, 40), "blue": (30, 60, 220),
           "yellow": (230, 210, 20)}  # fmt: skip
QUESTION = "What is in this picture?"


def drawn_image(rng: random.Random, size: int = 64) -> bytes:
    """A PNG of one coloured shape on a light background."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (size, size), tuple(rng.randint(200, 255) for _ in range(3)))
    draw = ImageDraw.Draw(image)
    colour = COLOURS[rng.choice(sorted(COLOURS))]
    r = size // 4
    x, y = rng.randint(r, size - r), rng.randint(r, size - r)
    box = (x - r, y - r, x + r, y + r)
    shape = rng.choice(("circle", "square", "triangle"))
    if shape == "circle":
        draw.ellipse(box, fill=colour)
    elif shape == "square":
        draw.rectangle(box, fill=colour)
    else:
        draw.polygon([(x, y - r), (x - r, y + r), (x + r, y + r)], fill=colour)
    out = BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


class Requests:
    """Chat requests prepared as the chat route prepares them (the model's tokenizer,
    template, preprocessor and image tokens)."""

    def __init__(self, model_dir: str, vocab: int, context: int) -> None:
        from runtime.frontend.chat import load_chat_template
        from runtime.frontend.defaults import load_generation_defaults
        from runtime.frontend.preprocess.image_tokens import load_vision
        from runtime.frontend.preprocess.preparer import Preparer
        from runtime.frontend.protocol.images import ImageLimits
        from runtime.frontend.protocol.requests import ServingLimits
        from runtime.frontend.tokenizer import ModelTokenizer

        tokenizer = ModelTokenizer.from_dir(model_dir)
        vision = load_vision(model_dir)
        if vision is None:
            raise SystemExit(f"bench_vision: {model_dir} does not accept images")
        limits = ServingLimits(
            os.path.basename(os.path.normpath(model_dir)), vocab, context,
            images=ImageLimits(), accepts_images=True, image_tokens=vision[0],
        )  # fmt: skip
        template = load_chat_template(model_dir, tokenizer, None)
        defaults = load_generation_defaults(model_dir, tokenizer.eos_token_ids)
        self.preparer = Preparer(limits, tokenizer, template, defaults, vision[1])

    def prepare(self, text: str, png: bytes | None, max_tokens: int):
        """(prompt ids, the images as the engine takes them)."""
        import base64

        from runtime.frontend.server.generation import submit_images

        parts: list[dict] = []
        if png is not None:
            uri = "data:image/png;base64," + base64.b64encode(png).decode("ascii")
            parts.append({"type": "image_url", "image_url": {"url": uri}})
        parts.append({"type": "text", "text": text})
        body = {"messages": [{"role": "user", "content": parts}], "max_tokens": max_tokens}
        (request,) = self.preparer.run("chat", body)
        return list(request.prompt_token_ids), submit_images(request)


class Timed:
    """One request's submission time and its events' times (engine thread)."""

    def __init__(self) -> None:
        self.submitted = time.monotonic_ns()
        self.times: list[int] = []
        self.done = threading.Event()

    def listener(self, _stream, event) -> None:
        if event.token_ids:
            self.times += [event.at_ns] * len(event.token_ids)
        if event.finished:
            self.done.set()

    @property
    def ttft_ms(self) -> float:
        return (self.times[0] - self.submitted) / 1e6 if self.times else float("nan")

    def gaps_ms(self) -> list[float]:
        return [(b - a) / 1e6 for a, b in zip(self.times, self.times[1:]) if b > a]


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, round(q / 100 * (len(values) - 1)))]


def text_twin(ids: list[int], images, rng: random.Random) -> tuple[list[int], tuple]:
    """The same prompt with each image's tokens replaced by text tokens (drawn
    from the prompt's own text tokens, so twins share no more of the prefix
    cache than the images did): the same length, no vision work."""
    ids = list(ids)
    inside = {i for image in images for i in range(image.start, image.start + image.length)}
    words = sorted({t for i, t in enumerate(ids) if i not in inside})
    for image in images:
        ids[image.start : image.start + image.length] = rng.choices(words, k=image.length)
    return ids, ()


def prepared(requests: Requests, total: int, args, rng, text_only: bool = False) -> list:
    """``total`` one-image requests, prepared (``text_only``: their text twins)."""
    queue = [requests.prepare(QUESTION, drawn_image(rng), args.max_tokens) for _ in range(total)]
    if text_only:
        queue = [text_twin(ids, images, rng) for ids, images in queue]
    return queue


def image_load(
    engine, requests: Requests, concurrency: int, total: int, args, rng,
    queue: list | None = None, stop: threading.Event | None = None,
) -> dict:  # fmt: skip
    """``total`` one-image requests kept ``concurrency`` in flight (``queue``:
    those already :func:`prepared`; ``stop``: no new request once set)."""
    timed: list[Timed] = []
    failures: list[BaseException] = []
    lock = threading.Lock()
    if queue is None:
        queue = prepared(requests, total, args, rng)

    def worker() -> None:
        while True:
            with lock:
                if not queue or (stop is not None and stop.is_set()):
                    return
                ids, images = queue.pop()
                t = Timed()
                timed.append(t)
            try:
                engine.submit(ids, args.max_tokens, listener=t.listener, images=images)
            except BaseException as exc:  # a refused request fails the benchmark
                failures.append(exc)
                return
            t.done.wait(600)

    start = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    seconds = time.perf_counter() - start
    if failures:
        raise RuntimeError(f"{len(failures)} request(s) failed") from failures[0]
    ttft = [t.ttft_ms for t in timed]
    return {
        "images_per_s": total / seconds,
        "ttft_ms_p50": pct(ttft, 50),
        "ttft_ms_p99": pct(ttft, 99),
        "tokens": sum(len(t.times) for t in timed),
    }


TEXT_PROMPTS = (
    "Describe a blue circle in detail.",
    "Describe a red square in detail.",
    "Describe a green triangle in detail.",
    "Describe a yellow cross in detail.",
)


def text_stream(engine, requests: Requests, args) -> list[Timed]:
    """``--text-repeats`` text-only requests of ``--text-tokens`` tokens, one
    after another (each its own prompt)."""
    out = []
    for i in range(args.text_repeats):
        text = TEXT_PROMPTS[i % len(TEXT_PROMPTS)]
        ids, _ = requests.prepare(text, None, args.text_tokens)
        t = Timed()
        engine.submit(ids, args.text_tokens, ignore_eos=True, listener=t.listener)
        t.done.wait(600)
        out.append(t)
    return out


def text_figures(timed: list[Timed]) -> dict:
    """The requests' median TTFT and their pooled gaps' p50/p99."""
    gaps = [g for t in timed for g in t.gaps_ms()]
    return {
        "ttft_ms": pct([t.ttft_ms for t in timed], 50),
        "gap_ms_p50": pct(gaps, 50),
        "gap_ms_p99": pct(gaps, 99),
    }


def text_beside_images(engine, requests: Requests, args, rng, text_only: bool = False) -> dict:
    """The text stream while image requests (``text_only``: their text twins,
    the same prompt lengths without images) run at 4 concurrent, from before
    it starts until it ends."""
    stop = threading.Event()
    queue = prepared(requests, 64, args, rng, text_only)
    box: dict = {}

    def load_run() -> None:
        try:
            image_load(engine, requests, 4, 64, args, rng, queue, stop)
        except BaseException as exc:
            box["error"] = exc

    load = threading.Thread(target=load_run)
    load.start()
    time.sleep(args.text_delay_s)  # the image requests are running
    t = text_stream(engine, requests, args)
    stop.set()
    load.join()
    if "error" in box:
        raise box["error"]
    return text_figures(t)


def run(args: argparse.Namespace) -> dict:
    from runtime.ranks.model.config import ModelConfig

    model = ModelConfig.from_dir(args.model)
    config = DeploymentConfig(
        model=args.model, tensor_parallel_size=1, device="cpu", max_concurrency=16,
        max_prefill_tokens=args.max_prefill_tokens, startup_timeout_s=300,
        mixed_prefill=args.mixed_prefill,
    )  # fmt: skip
    rng = random.Random(args.seed)
    out: dict = {}
    with LocalDeployment(config) as d:
        engine = d.engine
        requests = Requests(args.model, model.vocab_size, engine.facts.max_context)
        if args.trace:  # the whole run's plan trace (flare trace timeline FILE)
            from runtime.trace.writer import TraceOptions

            engine.enable_trace(TraceOptions(path=args.trace, max_bytes=1 << 30))
        image_load(engine, requests, 4, 8, args, rng)  # warm-up: every shape measured
        text_stream(engine, requests, args)
        before = engine.stats.by_kind()
        for c in args.concurrency:
            figures = image_load(engine, requests, c, max(args.rounds * c, 8), args, rng)
            for key, value in figures.items():
                out[f"c{c}_{key}"] = value
        after = engine.stats.by_kind()
        spent = {k: after[k][1] - before.get(k, (0, 0))[1] for k in after}
        total = sum(spent.values())
        out["vision_device_share"] = spent.get("vision", 0) / total if total else float("nan")
        out["frames_by_kind"] = {k: after[k][0] - before.get(k, (0, 0))[0] for k in after}
        for key, value in text_figures(text_stream(engine, requests, args)).items():
            out[f"text_alone_{key}"] = value
        for key, value in text_beside_images(engine, requests, args, rng).items():
            out[f"text_with_images_{key}"] = value
        for key, value in text_beside_images(engine, requests, args, rng, True).items():
            out[f"text_with_text_twins_{key}"] = value
    return out


def report(out: dict, args: argparse.Namespace) -> None:
    print(
        f"bench_vision: {args.model}, TP=1, CPU, {args.max_tokens} output tokens per image request"
    )
    print(f"{'concurrent':>10} {'images/s':>9} {'TTFT p50 ms':>12} {'TTFT p99 ms':>12}")
    for c in args.concurrency:
        print(
            f"{c:>10} {out[f'c{c}_images_per_s']:>9.2f} {out[f'c{c}_ttft_ms_p50']:>12.1f} "
            f"{out[f'c{c}_ttft_ms_p99']:>12.1f}"
        )
    print(f"vision frames' share of device time: {out['vision_device_share']:.1%}")
    print(f"frames by kind: {out['frames_by_kind']}")
    print(f"{'text-only requests':<22} {'TTFT ms':>8} {'gap p50 ms':>11} {'gap p99 ms':>11}")
    for name in ("text_alone", "text_with_images", "text_with_text_twins"):
        print(
            f"{name:<22} {out[f'{name}_ttft_ms']:>8.1f} {out[f'{name}_gap_ms_p50']:>11.1f} "
            f"{out[f'{name}_gap_ms_p99']:>11.1f}"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(DEFAULT_MODEL), help="a LLaVA directory")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--rounds", type=int, default=3, help="requests per slot of concurrency")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--text-tokens", type=int, default=48)
    parser.add_argument(
        "--text-repeats", type=int, default=3, help="text-only requests per phase, one at a time"
    )
    parser.add_argument("--text-delay-s", type=float, default=0.2)
    parser.add_argument("--max-prefill-tokens", type=int, default=512)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--mixed-prefill", action="store_true", help="also capture mixed prefill/decode programs"
    )
    parser.add_argument("--trace", help="write the plan trace of the text-beside-images phase")
    args = parser.parse_args(argv)
    if not Path(args.model, "config.json").is_file():
        parser.error(f"--model {args.model}: no config.json (a LLaVA directory is needed)")
    out = run(args)
    report(out, args)
    print(json.dumps(out, sort_keys=True))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
