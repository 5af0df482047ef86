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
* **a text-only request beside them**: its TTFT and inter-token gaps p50/p99
  alone, then while image requests run at 4 concurrent.

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


def image_load(engine, requests: Requests, concurrency: int, total: int, args, rng) -> dict:
    """``total`` one-image requests kept ``concurrency`` in flight."""
    timed: list[Timed] = []
    lock = threading.Lock()
    queue = [requests.prepare(QUESTION, drawn_image(rng), args.max_tokens) for _ in range(total)]

    def worker() -> None:
        while True:
            with lock:
                if not queue:
                    return
                ids, images = queue.pop()
                t = Timed()
                timed.append(t)
            engine.submit(ids, args.max_tokens, listener=t.listener, images=images)
            t.done.wait(600)

    start = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    seconds = time.perf_counter() - start
    ttft = [t.ttft_ms for t in timed]
    return {
        "images_per_s": total / seconds,
        "ttft_ms_p50": pct(ttft, 50),
        "ttft_ms_p99": pct(ttft, 99),
        "tokens": sum(len(t.times) for t in timed),
    }


def text_stream(engine, requests: Requests, args) -> Timed:
    ids, _ = requests.prepare("Describe a blue circle in detail.", None, args.text_tokens)
    t = Timed()
    engine.submit(ids, args.text_tokens, ignore_eos=True, listener=t.listener)
    t.done.wait(600)
    return t


def text_figures(t: Timed) -> dict:
    gaps = t.gaps_ms()
    return {"ttft_ms": t.ttft_ms, "gap_ms_p50": pct(gaps, 50), "gap_ms_p99": pct(gaps, 99)}


def text_beside_images(engine, requests: Requests, args, rng) -> dict:
    """The text stream while image requests run at 4 concurrent."""
    box: dict = {}
    load = threading.Thread(
        target=lambda: box.update(image_load(engine, requests, 4, 4 * args.rounds, args, rng))
    )
    load.start()
    time.sleep(args.text_delay_s)  # the image requests are running
    t = text_stream(engine, requests, args)
    load.join()
    return text_figures(t)


def run(args: argparse.Namespace) -> dict:
    from runtime.ranks.model.config import ModelConfig

    model = ModelConfig.from_dir(args.model)
    config = DeploymentConfig(
        model=args.model, tensor_parallel_size=1, device="cpu", max_concurrency=16,
        max_prefill_tokens=args.max_prefill_tokens, startup_timeout_s=300,
    )  # fmt: skip
    rng = random.Random(args.seed)
    out: dict = {}
    with LocalDeployment(config) as d:
        engine = d.engine
        requests = Requests(args.model, model.vocab_size, engine.facts.max_context)
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
    print(f"{'text-only request':<22} {'TTFT ms':>8} {'gap p50 ms':>11} {'gap p99 ms':>11}")
    for name in ("text_alone", "text_with_images"):
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
    parser.add_argument("--text-delay-s", type=float, default=0.2)
    parser.add_argument("--max-prefill-tokens", type=int, default=512)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    if not Path(args.model, "config.json").is_file():
        parser.error(f"--model {args.model}: no config.json (a LLaVA directory is needed)")
    out = run(args)
    report(out, args)
    print(json.dumps(out, sort_keys=True))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
