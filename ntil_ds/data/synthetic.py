"""Synthetic numeric tasks drawn with Pillow: a fresh clone can train and score with no download.

- `clock`: analog clock faces (sizes, colours, hand styles vary) -> "HH:MM" (12-hour dial, 01..12).
- `boxes`: coloured shapes on a 112x112 canvas -> "[x1, y1, x2, y2]" of the named one, in pixels.
- `chart`: a bar chart with lettered bars on a 0-100 grid -> the integer value of the named bar.
- `digits`: a number written in the image -> the number (a reading task for pretraining a vision tower).
- `arithmetic`: text-only multi-digit +, -, x problems -> the number.

Each task has a `standard` difficulty (the above) and an `easy` one, small enough for a tiny model
trained for minutes on a CPU to learn (the small recipes in configs/train/ and `make demo` use them):

- `clock` easy: one large plain dial (56 px, 2x2 patches per quadrant of a Qwen-VL model), thick black
  hands of clearly different lengths, 12 ticks, times on the quarter hour (48 answers);
- `arithmetic` easy: a + b with a, b in 0..99 (answers 0..198, 3 digits at most);
- `boxes` easy: one or two large shapes; `chart` easy: 3 bars with values on multiples of 10;
- `digits` easy: 0..99 centred on a 56 px square (standard: 0..999 anywhere on 112x56, sizes vary).

The image tasks also have `easy-alt`: the easy task's size and answers drawn in a style that neither
`standard` nor `easy` ever shows, the held-out variants the image grids fine-tune a pretrained base on
(configs/train/tiny_qwen2vl_pretrain.yaml pretrains on standard and easy only):

- `clock` easy-alt: a dark dial on a grey square, light hands (a wedge for the hour, a thin line with a
  round tip for the minutes), four dots instead of 12 ticks; quarter hours (the same 48 answers);
- `boxes` easy-alt: one or two large diamonds, crosses or rings in four other colours (cyan, pink,
  brown, gray) on a darker background;
- `chart` easy-alt: 3 horizontal bars (values on multiples of 10 along the x axis).

Every sample is drawn from its own random generator seeded by (task, difficulty, seed, index), so a
dataset is the same bytes on every run, and no two samples share their parameters (identical image and
question), so the train, val and test splits never overlap.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable
from pathlib import Path

from PIL import Image, ImageDraw, ImageFont

from ntil_ds.data.drawing import COLOURS, OTHER_COLOURS, Sample, default_font, draw_shape, overlap, polar
from ntil_ds.data.progress import progress

TASKS = ("clock", "boxes", "chart", "digits", "arithmetic")
DIFFICULTIES = ("standard", "easy", "easy-alt")
SPLITS = {"train": 0.8, "val": 0.1, "test": 0.1}

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
            draw.line(polar(c, angle, inner, r * 0.96), fill=rim, width=2 if major else 1)
    hour_angle = math.radians((hour % 12 + minute / 60) * 30)
    draw.line(polar(c, hour_angle, 0, r * 0.5), fill=hand, width=hour_width)
    draw.line(polar(c, math.radians(minute * 6), 0, r * 0.8), fill=hand, width=minute_width)
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
        draw.line(polar(c, math.radians(k * 30), r * 0.8, r), fill=rim, width=2)
    hour_angle = math.radians((hour % 12 + minute / 60) * 30)
    draw.line(polar(c, hour_angle, 0, r * 0.5), fill=hand, width=5)
    draw.line(polar(c, math.radians(minute * 6), 0, r * 0.9), fill=hand, width=3)
    key = ("easy", hour, minute, face, rim, hand)
    return Sample("What time does the clock show? Answer as HH:MM.", f"{hour:02d}:{minute:02d}", image, key)


def make_clock_alt(rng: random.Random) -> Sample:
    """The easy clock's size and quarter hours in a style the pretraining never shows: a dark dial on a
    grey square, light hands (a wedge for the hour, a thin line with a round tip for the minutes), and
    four dots at 12, 3, 6 and 9 instead of ticks."""
    size = EASY_CLOCK_SIZE
    hour, minute = rng.randint(1, 12), rng.choice((0, 15, 30, 45))
    grey = rng.randint(140, 190)
    face = tuple(rng.randint(0, 60) for _ in range(3))
    light = tuple(rng.randint(200, 255) for _ in range(3))
    image = Image.new("RGB", (size, size), (grey, grey, grey))
    draw = ImageDraw.Draw(image)
    c, r = size / 2, size / 2 - 1
    draw.ellipse([c - r, c - r, c + r, c + r], fill=face)
    for k in range(4):
        (x, y), _ = polar(c, math.radians(k * 90), r * 0.88, r)
        draw.ellipse([x - 2, y - 2, x + 2, y + 2], fill=light)
    hour_angle = math.radians((hour % 12 + minute / 60) * 30)
    (tip, _), (left, right) = polar(c, hour_angle, r * 0.55, 0), polar(c, hour_angle + math.pi / 2, 4, -4)
    draw.polygon([tip, left, right], fill=light)
    (end, _) = polar(c, math.radians(minute * 6), r * 0.72, 0)
    draw.line([(c, c), end], fill=light, width=2)
    draw.ellipse([end[0] - 3, end[1] - 3, end[0] + 3, end[1] + 3], fill=light)
    key = ("easy-alt", hour, minute, grey, face, light)
    return Sample("What time does the clock show? Answer as HH:MM.", f"{hour:02d}:{minute:02d}", image, key)


# ----------------------------------------------------------------------------------------------------
# boxes

BOXES_CANVAS = 112  # a multiple of 28: Qwen-VL keeps the size, so pixel answers mean the same to it
SHAPES = ("square", "circle", "triangle")
OTHER_SHAPES = ("diamond", "cross", "ring")  # the held-out variant's (easy-alt)


def make_boxes(
    rng: random.Random,
    max_shapes: int = 4,
    min_side: int = 12,
    colours: dict[str, tuple[int, int, int]] = COLOURS,
    shapes: tuple[str, ...] = SHAPES,
    background_range: tuple[int, int] = (200, 255),
) -> Sample:
    background = tuple(rng.randint(*background_range) for _ in range(3))
    image = Image.new("RGB", (BOXES_CANVAS, BOXES_CANVAS), background)
    draw = ImageDraw.Draw(image)
    kinds = rng.sample([(c, s) for c in colours for s in shapes], rng.randint(min(2, max_shapes), max_shapes))
    boxes: list[tuple[int, int, int, int]] = []
    for colour, shape in kinds:
        for _ in range(100):  # place without overlap (with a 2 px gap)
            side = rng.randint(min_side, 36)
            x1, y1 = rng.randint(0, BOXES_CANVAS - side), rng.randint(0, BOXES_CANVAS - side)
            box = (x1, y1, x1 + side - 1, y1 + side - 1)
            if not any(overlap(box, other, gap=2) for other in boxes):
                break
        else:
            raise RuntimeError("could not place shapes without overlap")  # cannot happen at these sizes
        boxes.append(box)
        draw_shape(draw, shape, box, colours[colour])
    target = rng.randrange(len(kinds))
    colour, shape = kinds[target]
    x1, y1, x2, y2 = boxes[target]
    question = f"Where is the {colour} {shape}? Answer with its box [x1, y1, x2, y2] in pixels."
    key = (background, tuple(kinds), tuple(boxes), target)
    return Sample(question, f"[{x1}, {y1}, {x2}, {y2}]", image, key)


# ----------------------------------------------------------------------------------------------------
# chart

CHART_SIZE = (168, 112)


def _blank_chart() -> tuple[Image.Image, ImageDraw.ImageDraw, ImageFont.ImageFont | ImageFont.FreeTypeFont]:
    image = Image.new("RGB", CHART_SIZE, (255, 255, 255))
    return image, ImageDraw.Draw(image), default_font()


def make_chart(rng: random.Random, n_bars: int | None = None, step: int = 1) -> Sample:
    width, height = CHART_SIZE
    n_bars = n_bars or rng.randint(3, 6)
    values = [rng.randrange(0, 101, step) for _ in range(n_bars)]
    labels = "ABCDEF"[:n_bars]
    image, draw, font = _blank_chart()
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


def make_chart_horizontal(rng: random.Random, n_bars: int = 3, step: int = 10) -> Sample:
    """The easy chart turned on its side: lettered bars from the left, values along the x axis."""
    width, height = CHART_SIZE
    values = [rng.randrange(0, 101, step) for _ in range(n_bars)]
    labels = "ABCDEF"[:n_bars]
    image, draw, font = _blank_chart()
    left, right, top, bottom = 12, width - 10, 4, height - 14
    for tick in range(0, 101, 20):  # grid lines with their values below
        x = left + (right - left) * tick / 100
        draw.line([(x, top), (x, bottom)], fill=(210, 210, 210))
        draw.text((x - 5, bottom + 2), str(tick), fill=(0, 0, 0), font=font)
    draw.line([(left, top), (left, bottom), (right, bottom)], fill=(0, 0, 0))
    slot = (bottom - top) / n_bars
    colour = rng.choice(list(COLOURS.values()))
    for i, (label, value) in enumerate(zip(labels, values, strict=True)):
        y1, y2 = top + i * slot + slot * 0.2, top + (i + 1) * slot - slot * 0.2
        draw.rectangle([left, y1, left + (right - left) * value / 100, y2], fill=colour)
        draw.text((1, (y1 + y2) / 2 - 5), label, fill=(0, 0, 0), font=font)
    target = rng.randrange(n_bars)
    question = f"What is the value of bar {labels[target]} in the chart? Answer with a number."
    key = ("horizontal", tuple(values), colour, target)
    return Sample(question, str(values[target]), image, key)


# ----------------------------------------------------------------------------------------------------
# digits


def make_digits(rng: random.Random, easy: bool = False) -> Sample:
    """A number written in the image, dark on light. Easy: 0..99 near the centre of a 56 px square in a
    28 px font; standard: 0..999 anywhere on 112x56, 18-32 px, the shades vary."""
    number = rng.randint(0, 99 if easy else 999)
    width, height = (EASY_CLOCK_SIZE, EASY_CLOCK_SIZE) if easy else (112, 56)
    size = 28 if easy else rng.randint(18, 32)
    ink = tuple(rng.randint(0, 70) for _ in range(3))
    paper = tuple(rng.randint(190, 255) for _ in range(3))
    font = default_font(size)
    x1, y1, x2, y2 = font.getbbox(str(number))
    room_x, room_y = width - (x2 - x1), height - (y2 - y1)
    if easy:  # centred, a few pixels of jitter
        x, y = room_x // 2 + rng.randint(-3, 3), room_y // 2 + rng.randint(-3, 3)
    else:
        x, y = rng.randint(0, room_x), rng.randint(0, room_y)
    image = Image.new("RGB", (width, height), paper)
    ImageDraw.Draw(image).text((x - x1, y - y1), str(number), fill=ink, font=font)
    key = (easy, number, size, ink, paper, x, y)
    return Sample("What number is written in the image? Answer with the number.", str(number), image, key)


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
    "digits": make_digits,
    "arithmetic": make_arithmetic,
}
EASY_MAKERS: dict[str, Callable[[random.Random], Sample]] = {
    "clock": make_clock_easy,
    "boxes": lambda rng: make_boxes(rng, max_shapes=2, min_side=24),
    "chart": lambda rng: make_chart(rng, n_bars=3, step=10),
    "digits": lambda rng: make_digits(rng, easy=True),
    "arithmetic": make_arithmetic_easy,
}
EASY_ALT_MAKERS: dict[str, Callable[[random.Random], Sample]] = {
    "clock": make_clock_alt,
    "boxes": lambda rng: make_boxes(
        rng,
        max_shapes=2,
        min_side=24,
        colours=OTHER_COLOURS,
        shapes=OTHER_SHAPES,
        background_range=(150, 200),
    ),
    "chart": make_chart_horizontal,
}
MAKERS_BY_DIFFICULTY = {"standard": MAKERS, "easy": EASY_MAKERS, "easy-alt": EASY_ALT_MAKERS}


# ----------------------------------------------------------------------------------------------------
# writing a dataset


def generate(task: str, n: int, seed: int, difficulty: str = "standard") -> list[Sample]:
    """`n` distinct samples of `task`, the same for the same (task, n, seed, difficulty)."""
    if task not in MAKERS:
        raise ValueError(f"unknown task {task!r}; choose one of {', '.join(TASKS)}")
    if difficulty not in DIFFICULTIES:
        raise ValueError(f"unknown difficulty {difficulty!r}; choose one of {', '.join(DIFFICULTIES)}")
    makers = MAKERS_BY_DIFFICULTY[difficulty]
    if task not in makers:
        raise ValueError(
            f"task {task} has no {difficulty!r} variant; {difficulty} exists for {', '.join(makers)}"
        )
    make = makers[task]
    # The standard streams keep their seeds (same bytes as before difficulties existed).
    stream = task if difficulty == "standard" else f"{task}-{difficulty}"
    seen: set[tuple] = set()
    samples = []
    for index in progress(range(n), desc=f"drawing {task} ({difficulty})", unit="sample"):
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
