"""Drawn pictures and their captions for the embedded default vision model
(scripts/train_vision_default.py): shapes, colours, counts, positions; Pillow at twice
the size, downsampled with antialiasing."""

from __future__ import annotations

import math
import random
import re

import numpy as np
from PIL import Image, ImageDraw

IMAGE_SIZE = 32
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
COLOURS = {"red": (220, 30, 30), "green": (30, 170, 50), "blue": (40, 70, 225),
           "yellow": (240, 215, 25), "purple": (145, 45, 185)}  # fmt: skip
SHAPES = {"circle": "circles", "square": "squares", "triangle": "triangles",
          "star": "stars", "cross": "crosses"}  # fmt: skip
COUNTS = {1: "a", 2: "two", 3: "three"}
POSITIONS = {"on the left": (0.25, 0.5), "on the right": (0.75, 0.5), "at the top": (0.5, 0.25),
             "at the bottom": (0.5, 0.75), "in the centre": (0.5, 0.5)}  # fmt: skip
QUESTIONS = ("What is in this picture?", "Describe the image.", "What do you see?",
             "What does this image show?", "Describe this picture briefly.",
             "What is shown here?")  # fmt: skip
SCALE = 2  # drawn at 2x, then downsampled with antialiasing


def shape_points(shape: str, cx: float, cy: float, r: float, turn: float) -> list:
    if shape == "triangle":
        angles = [turn - math.pi / 2 + k * 2 * math.pi / 3 for k in range(3)]
        return [(cx + r * math.cos(a), cy + r * math.sin(a)) for a in angles]
    if shape == "star":
        angles, rr = [turn - math.pi / 2 + k * math.pi / 5 for k in range(10)], (r, r * 0.42)
        return [(cx + rr[k % 2] * math.cos(a), cy + rr[k % 2] * math.sin(a))
                for k, a in enumerate(angles)]  # fmt: skip
    if shape == "cross":
        w = r * 0.36
        return [(cx - w, cy - r), (cx + w, cy - r), (cx + w, cy - w), (cx + r, cy - w),
                (cx + r, cy + w), (cx + w, cy + w), (cx + w, cy + r), (cx - w, cy + r),
                (cx - w, cy + w), (cx - r, cy + w), (cx - r, cy - w), (cx - w, cy - w)]  # fmt: skip
    r *= 0.85  # square
    return [(cx - r, cy - r), (cx + r, cy - r), (cx + r, cy + r), (cx - r, cy + r)]


def background(rng: random.Random, fg: tuple[int, int, int]) -> tuple[int, int, int]:
    """A low-saturation colour far from the shape's colour."""
    while True:
        grey = rng.randint(0, 255)
        bg = tuple(max(0, min(255, grey + rng.randint(-28, 28))) for _ in range(3))
        if sum((a - b) ** 2 for a, b in zip(bg, fg)) >= 110**2:
            return bg


def centres(rng: random.Random, count: int, position: str | None) -> list[tuple]:
    if position is not None:
        fx, fy = POSITIONS[position]
        r = rng.uniform(0.20, 0.26)
        return [(fx + rng.uniform(-0.04, 0.04), fy + rng.uniform(-0.04, 0.04), r)]
    while True:
        r = rng.uniform(0.14, 0.17)
        pts = [(rng.uniform(r + 0.03, 0.97 - r), rng.uniform(r + 0.03, 0.97 - r), r)
               for _ in range(count)]  # fmt: skip
        if all(math.dist(a[:2], b[:2]) > 2 * r + 0.05 for i, a in enumerate(pts)
               for b in pts[i + 1:]):  # fmt: skip
            return pts


def draw_picture(rng: random.Random) -> tuple[Image.Image, dict]:
    """One picture and its facts: shape, colour, count, position (count 1 only)."""
    shape, colour = rng.choice(list(SHAPES)), rng.choice(list(COLOURS))
    count = rng.choice((1, 1, 2, 3))
    position = rng.choice(list(POSITIONS)) if count == 1 else None
    fg = tuple(max(0, min(255, c + rng.randint(-18, 18))) for c in COLOURS[colour])
    size = IMAGE_SIZE * SCALE
    img = Image.new("RGB", (size, size), background(rng, fg))
    draw = ImageDraw.Draw(img)
    for fx, fy, fr in centres(rng, count, position):
        cx, cy, r = fx * size, fy * size, fr * size
        if shape == "circle":
            draw.ellipse((cx - r, cy - r, cx + r, cy + r), fill=fg)
        else:
            turn = rng.uniform(-0.25, 0.25) if shape != "square" else 0.0
            draw.polygon(shape_points(shape, cx, cy, r, turn), fill=fg)
    img = img.resize((IMAGE_SIZE, IMAGE_SIZE), Image.Resampling.LANCZOS)
    return img, {"shape": shape, "colour": colour, "count": count, "position": position}


def caption(facts: dict) -> str:
    if facts["count"] == 1:
        return f"a {facts['colour']} {facts['shape']} {facts['position']}."
    return f"{COUNTS[facts['count']]} {facts['colour']} {SHAPES[facts['shape']]}."


def pixels(img: Image.Image) -> np.ndarray:
    """CLIPImageProcessor's output for an IMAGE_SIZE picture (no resize, no crop)."""
    a = np.asarray(img, dtype=np.float32) / 255.0
    a = (a - np.array(CLIP_MEAN, dtype=np.float32)) / np.array(CLIP_STD, dtype=np.float32)
    return a.transpose(2, 0, 1)


def judge(answer: str, facts: dict) -> dict[str, bool]:
    """Whether the answer names the shape, colour (and no other), count, position."""
    words = re.findall(r"[a-z]+", answer.lower())
    shapes = {s for s, p in SHAPES.items() if s in words or p in words}
    colours = {c for c in COLOURS if c in words}
    count = COUNTS[facts["count"]]
    shape_ok = shapes == {facts["shape"]}
    colour_ok = colours == {facts["colour"]}
    return {"shape": shape_ok, "colour": colour_ok, "both": shape_ok and colour_ok,
            "count": bool(words) and words[0] == count,
            "position": facts["position"] is None or facts["position"] in answer,
            "exact": answer.strip() == caption(facts)}  # fmt: skip
