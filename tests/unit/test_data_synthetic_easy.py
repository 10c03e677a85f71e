"""The `easy` difficulty of the synthetic tasks: what each promises, and that it stays deterministic."""

import json
import math
import re

import pytest

from ntil_ds.data.synthetic import EASY_CLOCK_SIZE, TASKS, generate, write_dataset
from ntil_ds.scoring import parse_box, parse_clock


def test_easy_clock_is_quarter_hours_on_a_fixed_dial_with_hands_at_the_answer():
    samples = generate("clock", 60, seed=1, difficulty="easy")
    assert {s.image.size for s in samples} == {(EASY_CLOCK_SIZE, EASY_CLOCK_SIZE)}
    for sample in samples:
        minutes = parse_clock(sample.answer) % 60
        assert minutes in (0, 15, 30, 45), sample.answer
        # the minute hand is dark at 0.65 r (past the hour hand, inside the ticks); the opposite point is not
        image = sample.image.convert("L")
        c, r = EASY_CLOCK_SIZE / 2, EASY_CLOCK_SIZE / 2 - 1
        angle = math.radians(minutes * 6)
        x, y = c + 0.65 * r * math.sin(angle), c - 0.65 * r * math.cos(angle)
        assert (
            image.getpixel((round(x), round(y))) < 100 < image.getpixel((round(2 * c - x), round(2 * c - y)))
        )
    assert len({s.answer for s in samples}) > 20  # many of the 48 times, not a few


def test_easy_arithmetic_chart_and_boxes_ranges():
    for sample in generate("arithmetic", 100, seed=0, difficulty="easy"):
        a, b = map(int, re.findall(r"\d+", sample.question))
        assert 0 <= a <= 99 and 0 <= b <= 99 and "+" in sample.question and sample.answer == str(a + b)
    for sample in generate("chart", 30, seed=0, difficulty="easy"):
        assert int(sample.answer) % 10 == 0
    for sample in generate("boxes", 30, seed=0, difficulty="easy"):
        x1, y1, x2, y2 = parse_box(sample.answer)
        assert x2 - x1 + 1 >= 24 and y2 - y1 + 1 >= 24


@pytest.mark.parametrize("task", TASKS)
def test_easy_is_deterministic_and_differs_from_standard(task, tmp_path):
    first = [s.answer + s.question for s in generate(task, 8, seed=2, difficulty="easy")]
    again = [s.answer + s.question for s in generate(task, 8, seed=2, difficulty="easy")]
    standard = [s.answer + s.question for s in generate(task, 8, seed=2)]
    assert first == again and first != standard
    write_dataset(task, 6, tmp_path, seed=2, difficulty="easy")
    assert json.loads((tmp_path / "meta.json").read_text())["difficulty"] == "easy"


def test_unknown_difficulty_is_an_error():
    with pytest.raises(ValueError, match="unknown difficulty 'hard'; choose one of standard, easy"):
        generate("clock", 2, seed=0, difficulty="hard")
