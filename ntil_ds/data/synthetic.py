"""Synthetic numeric tasks drawn with Pillow: a fresh clone can train and score with no download.

- `clock`: analog clock faces (sizes, colours, hand styles vary) -> "HH:MM" (12-hour dial, 01..12).
- `boxes`: coloured shapes on a 112x112 canvas -> "[x1, y1, x2, y2]" of the named one, in pixels.
- `chart`: a bar chart with lettered bars on a 0-100 grid -> the integer value of the named bar.
- `arithmetic`: text-only multi-digit +, -, x problems -> the number.

Each task has a `standard` difficulty (the above) and an `easy` one, small enough for a tiny model
trained for minutes on a CPU to learn (the small recipes in configs/train/ and `make demo` use them):

- `clock` easy: one large plain dial (56 px, 2x2 patches per quadrant of a Qwen-VL model), thick black
  hands of clearly different lengths, 12 ticks, times on the quarter hour (48 answers);
- `arithmetic` easy: a + b with a, b in 0..99 (answers 0..198, 3 digits at most);
- `boxes` easy: one or two large shapes; `chart` easy: 3 bars with values on multiples of 10.

Every sample is drawn from its own random generator seeded by (task, seed, index), so a dataset is the
same bytes on every run, and no two samples share their parameters (identical image and question),
so the train, val and test splits never overlap.
"""

from __future__ import annotations

import functools
import json
import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from PIL import Image, ImageDraw, ImageFont
from tqdm import tqdm

TASKS = ("clock", "boxes", "chart", "arithmetic")
DIFFICULTIES = ("standard", "easy")
SPLITS = {"train": 0.8, "val": 0.1, "test": 0.1}

COLOURS = {
    "red": (220, 40, 40),
    "green": (40, 170, 60),
    "blue": (40, 80, 220),
    "yellow": (230, 200, 30),
    "purple": (140, 60, 180),
    "orange": (240, 140, 30),
}


@dataclass(frozen=True)
class Sample:
    """One generated sample: the question, the answer, the image (None for text tasks), and a key
    identifying its parameters (equal keys would be equal samples)."""

    question: str
    answer: str
    image: Image.Image | None
    key: tuple


# ----------------------------------------------------------------------------------------------------
# clock


def make_clock(rng: random.Random) -> Sample:
    size = rng.randrange(64, 161, 8)
    hour, minute = rng.randint(1, 12), rng.randint(0, 59)
    face = tuple(rng.randint(200, 255) for _ in range(3))
    rim = tuple(rng.randint(0, 120) for _ in range(3))
    hand = tuple(rng.randint(0, 90) for _ in range(3))
    hour_width = rng.randint(2, 5)
    minute_width = rng.randint(1, max(1, hour_width - 1))
    ticks = rng.choice(("12", "60", "none"))

    image = Image.new("RGB", (size, size), tuple(rng.randint(150, 255) for _ in range(3)))
    draw = ImageDraw.Draw(image)
    c, r = size / 2, size / 2 - 3
    draw.ellipse([c - r, c - r, c + r, c + r], fill=face, outline=rim, width=max(2, size // 40))
    if ticks != "none":
        for k in range(60 if ticks == "60" else 12):
            major = ticks == "12" or k % 5 == 0
            angle = math.radians(k * (6 if ticks == "60" else 30))
            inner = r * (0.82 if major else 0.9)
            draw.line(_polar(c, angle, inner, r * 0.96), fill=rim, width=2 if major else 1)
    hour_angle = math.radians((hour % 12 + minute / 60) * 30)
    draw.line(_polar(c, hour_angle, 0, r * 0.5), fill=hand, width=hour_width)
    draw.line(_polar(c, math.radians(minute * 6), 0, r * 0.8), fill=hand, width=minute_width)
    draw.ellipse([c - 2, c - 2, c + 2, c + 2], fill=hand)
    key = (size, hour, minute, face, rim, hand, hour_width, minute_width, ticks)
    return Sample("What time does the clock show? Answer as HH:MM.", f"{hour:02d}:{minute:02d}", image, key)


EASY_CLOCK_SIZE = 56  # a multiple of 28: the tiny Qwen-VL processor keeps it (4x4 patches, 4 image tokens)


def make_clock_easy(rng: random.Random) -> Sample:
    """A clock a tiny vision tower can read: fixed size, 12 ticks, quarter hours, thick dark hands; only
    the shades of face, rim and hands vary (so samples stay distinct)."""
    size = EASY_CLOCK_SIZE
    hour, minute = rng.randint(1, 12), rng.choice((0, 15, 30, 45))
    face = tuple(rng.randint(225, 255) for _ in range(3))
    rim = tuple(rng.randint(0, 60) for _ in range(3))
    hand = tuple(rng.randint(0, 40) for _ in range(3))
    image = Image.new("RGB", (size, size), face)
    draw = ImageDraw.Draw(image)
    c, r = size / 2, size / 2 - 1
    draw.ellipse([c - r, c - r, c + r, c + r], fill=face, outline=rim, width=2)
    for k in range(12):
        draw.line(_polar(c, math.radians(k * 30), r * 0.8, r), fill=rim, width=2)
    hour_angle = math.radians((hour % 12 + minute / 60) * 30)
    draw.line(_polar(c, hour_angle, 0, r * 0.5), fill=hand, width=5)
    draw.line(_polar(c, math.radians(minute * 6), 0, r * 0.9), fill=hand, width=3)
    key = ("easy", hour, minute, face, rim, hand)
    return Sample("What time does the clock show? Answer as HH:MM.", f"{hour:02d}:{minute:02d}", image, key)


def _polar(center: float, angle: float, r0: float, r1: float) -> list[tuple[float, float]]:
    """A radial segment at `angle` (clockwise from 12 o'clock) from radius r0 to r1."""
    dx, dy = math.sin(angle), -math.cos(angle)
    return [(center + r0 * dx, center + r0 * dy), (center + r1 * dx, center + r1 * dy)]


# ----------------------------------------------------------------------------------------------------
# boxes

BOXES_CANVAS = 112  # a multiple of 28: Qwen-VL keeps the size, so pixel answers mean the same to it
SHAPES = ("square", "circle", "triangle")


def make_boxes(rng: random.Random, max_shapes: int = 4, min_side: int = 12) -> Sample:
    background = tuple(rng.randint(200, 255) for _ in range(3))
    image = Image.new("RGB", (BOXES_CANVAS, BOXES_CANVAS), background)
    draw = ImageDraw.Draw(image)
    kinds = rng.sample([(c, s) for c in COLOURS for s in SHAPES], rng.randint(min(2, max_shapes), max_shapes))
    boxes: list[tuple[int, int, int, int]] = []
    for colour, shape in kinds:
        for _ in range(100):  # place without overlap (with a 2 px gap)
            side = rng.randint(min_side, 36)
            x1, y1 = rng.randint(0, BOXES_CANVAS - side), rng.randint(0, BOXES_CANVAS - side)
            box = (x1, y1, x1 + side - 1, y1 + side - 1)
            if not any(_overlap(box, other, gap=2) for other in boxes):
                break
        else:
            raise RuntimeError("could not place shapes without overlap")  # cannot happen at these sizes
        boxes.append(box)
        _draw_shape(draw, shape, box, COLOURS[colour])
    target = rng.randrange(len(kinds))
    colour, shape = kinds[target]
    x1, y1, x2, y2 = boxes[target]
    question = f"Where is the {colour} {shape}? Answer with its box [x1, y1, x2, y2] in pixels."
    key = (background, tuple(kinds), tuple(boxes), target)
    return Sample(question, f"[{x1}, {y1}, {x2}, {y2}]", image, key)


def _overlap(a, b, gap: int) -> bool:
    return not (a[2] + gap < b[0] or b[2] + gap < a[0] or a[3] + gap < b[1] or b[3] + gap < a[1])


def _draw_shape(draw: ImageDraw.ImageDraw, shape: str, box, colour) -> None:
    x1, y1, x2, y2 = box
    if shape == "square":
        draw.rectangle(box, fill=colour)
    elif shape == "circle":
        draw.ellipse(box, fill=colour)
    else:  # triangle: apex at top centre; its bounding box is the box
        draw.polygon([((x1 + x2) / 2, y1), (x2, y2), (x1, y2)], fill=colour)


# ----------------------------------------------------------------------------------------------------
# chart

CHART_SIZE = (168, 112)


@functools.cache
def _default_font() -> ImageFont.ImageFont | ImageFont.FreeTypeFont:
    return ImageFont.load_default()  # Pillow's built-in font: same glyphs everywhere, no font files


def make_chart(rng: random.Random, n_bars: int | None = None, step: int = 1) -> Sample:
    width, height = CHART_SIZE
    n_bars = n_bars or rng.randint(3, 6)
    values = [rng.randrange(0, 101, step) for _ in range(n_bars)]
    labels = "ABCDEF"[:n_bars]
    image = Image.new("RGB", (width, height), (255, 255, 255))
    draw = ImageDraw.Draw(image)
    font = _default_font()
    left, right, top, bottom = 22, width - 4, 6, height - 14
    for tick in range(0, 101, 20):  # grid lines with their values on the left
        y = bottom - (bottom - top) * tick / 100
        draw.line([(left, y), (right, y)], fill=(210, 210, 210))
        draw.text((1, y - 5), str(tick), fill=(0, 0, 0), font=font)
    draw.line([(left, top), (left, bottom), (right, bottom)], fill=(0, 0, 0))
    slot = (right - left) / n_bars
    colour = rng.choice(list(COLOURS.values()))
    for i, (label, value) in enumerate(zip(labels, values, strict=True)):
        x1 = left + i * slot + slot * 0.2
        x2 = left + (i + 1) * slot - slot * 0.2
        y = bottom - (bottom - top) * value / 100
        draw.rectangle([x1, y, x2, bottom], fill=colour)
        draw.text(((x1 + x2) / 2 - 3, bottom + 1), label, fill=(0, 0, 0), font=font)
    target = rng.randrange(n_bars)
    question = f"What is the value of bar {labels[target]} in the chart? Answer with a number."
    key = (tuple(values), colour, target)
    return Sample(question, str(values[target]), image, key)


# ----------------------------------------------------------------------------------------------------
# arithmetic


def make_arithmetic(rng: random.Random) -> Sample:
    op = rng.choice("+-*")
    if op == "*":
        a, b = rng.randint(2, 999), rng.randint(2, 999)
    else:
        a, b = rng.randint(10, 99999), rng.randint(10, 99999)
        if op == "-" and b > a:
            a, b = b, a
    result = {"+": a + b, "-": a - b, "*": a * b}[op]
    symbol = {"+": "+", "-": "-", "*": "x"}[op]
    return Sample(f"What is {a} {symbol} {b}? Answer with the number.", str(result), None, (a, op, b))


def make_arithmetic_easy(rng: random.Random) -> Sample:
    a, b = rng.randint(0, 99), rng.randint(0, 99)
    return Sample(f"What is {a} + {b}? Answer with the number.", str(a + b), None, ("easy", a, b))


MAKERS: dict[str, Callable[[random.Random], Sample]] = {
    "clock": make_clock,
    "boxes": make_boxes,
    "chart": make_chart,
    "arithmetic": make_arithmetic,
}
EASY_MAKERS: dict[str, Callable[[random.Random], Sample]] = {
    "clock": make_clock_easy,
    "boxes": lambda rng: make_boxes(rng, max_shapes=2, min_side=24),
    "chart": lambda rng: make_chart(rng, n_bars=3, step=10),
    "arithmetic": make_arithmetic_easy,
}


# ----------------------------------------------------------------------------------------------------
# writing a dataset


def generate(task: str, n: int, seed: int, difficulty: str = "standard") -> list[Sample]:
    """`n` distinct samples of `task`, the same for the same (task, n, seed, difficulty)."""
    if task not in MAKERS:
        raise ValueError(f"unknown task {task!r}; choose one of {', '.join(TASKS)}")
    if difficulty not in DIFFICULTIES:
        raise ValueError(f"unknown difficulty {difficulty!r}; choose one of {', '.join(DIFFICULTIES)}")
    make = MAKERS[task] if difficulty == "standard" else EASY_MAKERS[task]
    # The standard streams keep their seeds (same bytes as before difficulties existed).
    stream = task if difficulty == "standard" else f"{task}-{difficulty}"
    seen: set[tuple] = set()
    samples = []
    for index in tqdm(range(n), desc=f"drawing {task} ({difficulty})", unit="sample"):
        for attempt in range(1000):  # redraw a sample that repeats an earlier one
            sample = make(random.Random(f"{stream}:{seed}:{index}:{attempt}"))
            if sample.key not in seen:
                break
        else:
            raise ValueError(f"task {task} has too few distinct samples for n={n}")
        seen.add(sample.key)
        samples.append(sample)
    return samples


def split_sizes(n: int) -> dict[str, int]:
    """Samples per split (80/10/10; val and test get at least one each when n >= 3)."""
    if n < 3:
        raise ValueError(f"need at least 3 samples for train/val/test splits, got n={n}")
    val = max(1, round(n * SPLITS["val"]))
    test = max(1, round(n * SPLITS["test"]))
    return {"train": n - val - test, "val": val, "test": test}


def write_dataset(
    task: str, n: int, out_dir: str | Path, seed: int = 0, difficulty: str = "standard"
) -> dict[str, Path]:
    """Write `out_dir/{train,val,test}.jsonl` (+ `images/<split>/*.png`); return the JSONL paths."""
    out = Path(out_dir)
    samples = generate(task, n, seed, difficulty)
    paths, start = {}, 0
    for split, size in split_sizes(n).items():
        rows = []
        for offset, sample in enumerate(samples[start : start + size]):
            content: list[dict] = []
            if sample.image is not None:
                relative = Path("images") / split / f"{offset:06d}.png"
                (out / relative).parent.mkdir(parents=True, exist_ok=True)
                sample.image.save(out / relative, format="PNG")
                content.append({"type": "image", "image": relative.as_posix()})
            content.append({"type": "text", "text": sample.question})
            messages = [{"role": "user", "content": content}, {"role": "assistant", "content": sample.answer}]
            rows.append(json.dumps({"messages": messages, "task": task}))
        out.mkdir(parents=True, exist_ok=True)
        paths[split] = out / f"{split}.jsonl"
        paths[split].write_text("".join(row + "\n" for row in rows))
        start += size
    meta = {"task": task, "n": n, "seed": seed, "difficulty": difficulty, **split_sizes(n)}
    (out / "meta.json").write_text(json.dumps(meta) + "\n")
    return paths
