"""What the synthetic tasks (ntil_ds/data/synthetic.py) draw with: the sample record, the named colours,
and Pillow primitives (radial segments, shapes in a box, the built-in fonts)."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from PIL import Image, ImageDraw, ImageFont


@dataclass(frozen=True)
class Sample:
    """One generated sample: the question, the answer, the image (None for text tasks), and a key
    identifying its parameters (equal keys would be equal samples)."""

    question: str
    answer: str
    image: Image.Image | None
    key: tuple


COLOURS = {
    "red": (220, 40, 40),
    "green": (40, 170, 60),
    "blue": (40, 80, 220),
    "yellow": (230, 200, 30),
    "purple": (140, 60, 180),
    "orange": (240, 140, 30),
}
# Colours none of the tasks above uses: the held-out box variant names and draws only these.
OTHER_COLOURS = {
    "cyan": (0, 190, 200),
    "pink": (240, 110, 180),
    "brown": (130, 80, 30),
    "gray": (110, 110, 110),
}


def polar(center: float, angle: float, r0: float, r1: float) -> list[tuple[float, float]]:
    """A radial segment at `angle` (clockwise from 12 o'clock) from radius r0 to r1."""
    dx, dy = math.sin(angle), -math.cos(angle)
    return [(center + r0 * dx, center + r0 * dy), (center + r1 * dx, center + r1 * dy)]


def overlap(a, b, gap: int) -> bool:
    """Whether boxes a and b (x1, y1, x2, y2) come closer than `gap` pixels."""
    return not (a[2] + gap < b[0] or b[2] + gap < a[0] or a[3] + gap < b[1] or b[3] + gap < a[1])


def draw_shape(draw: ImageDraw.ImageDraw, shape: str, box, colour) -> None:
    """A filled shape whose bounding box is `box` (inclusive pixel coordinates)."""
    x1, y1, x2, y2 = box
    cx, cy = (x1 + x2) / 2, (y1 + y2) / 2
    if shape == "square":
        draw.rectangle(box, fill=colour)
    elif shape == "circle":
        draw.ellipse(box, fill=colour)
    elif shape == "triangle":  # apex at top centre
        draw.polygon([(cx, y1), (x2, y2), (x1, y2)], fill=colour)
    elif shape == "diamond":
        draw.polygon([(cx, y1), (x2, cy), (cx, y2), (x1, cy)], fill=colour)
    elif shape == "cross":  # a plus sign, arms a third of the side wide
        arm = (x2 - x1 + 1) / 3
        draw.rectangle([x1 + arm, y1, x2 - arm, y2], fill=colour)
        draw.rectangle([x1, y1 + arm, x2, y2 - arm], fill=colour)
    elif shape == "ring":  # a hollow circle
        draw.ellipse(box, outline=colour, width=max(3, (x2 - x1) // 6))
    else:
        raise ValueError(f"unknown shape {shape!r}")


@functools.cache
def default_font(size: int | None = None) -> ImageFont.ImageFont | ImageFont.FreeTypeFont:
    """Pillow's built-in font (the bitmap one, or at `size` px its embedded FreeType one): the same
    glyphs everywhere, no font files."""
    return ImageFont.load_default() if size is None else ImageFont.load_default(size=size)
