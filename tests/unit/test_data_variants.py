"""What the pretraining recipe and its held-out grids are built from: the `digits` reading task, the
`easy-alt` variants (the easy tasks drawn in a style the pretraining never shows; answers still match
what is drawn) and the task mixture (`make_data.py mix`)."""

import json
import math
import random

import numpy as np
import pytest

from launch import make_data
from ntil_ds.data.drawing import COLOURS, OTHER_COLOURS
from ntil_ds.data.mixture import parse_parts, write_mixture
from ntil_ds.data.synthetic import (
    EASY_CLOCK_SIZE,
    OTHER_SHAPES,
    SHAPES,
    generate,
    make_chart_horizontal,
)
from ntil_ds.scoring import parse_box, parse_clock


def test_alt_clock_hands_point_at_the_answer_on_a_dark_dial():
    samples = generate("clock", 60, seed=1, difficulty="easy-alt")
    easy = generate("clock", 60, seed=1, difficulty="easy")
    c, r = EASY_CLOCK_SIZE / 2, EASY_CLOCK_SIZE / 2 - 1
    for sample in samples:
        minutes = parse_clock(sample.answer) % 60
        assert minutes in (0, 15, 30, 45), sample.answer
        # the light minute hand at 0.6 r (past the hour wedge), the dark dial at the opposite point
        image = sample.image.convert("L")
        angle = math.radians(minutes * 6)
        x, y = c + 0.6 * r * math.sin(angle), c - 0.6 * r * math.cos(angle)
        assert (
            image.getpixel((round(x), round(y))) > 150 > image.getpixel((round(2 * c - x), round(2 * c - y)))
        )
    assert len({s.answer for s in samples}) > 20
    # not the easy style: the easy dial's face is light where the alt one is dark (a point off the hands)
    off_hands = (round(c + 0.3 * r), round(c + 0.75 * r))
    assert all(s.image.convert("L").getpixel(off_hands) < 80 for s in samples[:10])
    assert all(s.image.convert("L").getpixel(off_hands) > 150 for s in easy[:10])


def test_alt_boxes_name_and_draw_only_held_out_colours_and_shapes_at_the_answer():
    checked = 0
    for sample in generate("boxes", 30, seed=0, difficulty="easy-alt"):
        colour, shape = sample.question.split("the ")[1].split("?")[0].split()
        assert colour in OTHER_COLOURS and colour not in COLOURS
        assert shape in OTHER_SHAPES and shape not in SHAPES
        x1, y1, x2, y2 = (int(v) for v in parse_box(sample.answer))
        assert x2 - x1 + 1 >= 24 and y2 - y1 + 1 >= 24
        kinds = sample.key[1]  # (background, kinds, boxes, target)
        if sum(c == colour for c, _ in kinds) > 1:  # two shapes of one colour: their pixels span both
            continue
        # the named shape's colour reaches all four sides of the box and nothing of it lies outside
        ys, xs = np.nonzero((np.asarray(sample.image) == OTHER_COLOURS[colour]).all(axis=2))
        assert (xs.min(), ys.min(), xs.max(), ys.max()) == (x1, y1, x2, y2), sample.answer
        checked += 1
    assert checked >= 20, checked  # most samples have one shape of the named colour


def test_horizontal_chart_bar_ends_at_its_value():
    for i in range(20):
        sample = make_chart_horizontal(random.Random(i))
        values, colour, target = sample.key[1], sample.key[2], sample.key[3]
        assert sample.answer == str(values[target]) and int(sample.answer) % 10 == 0
        image = sample.image
        left, right, top, bottom, n = 12, image.width - 10, 4, image.height - 14, len(values)
        for k, value in enumerate(values):
            y = round(top + (k + 0.5) * (bottom - top) / n)
            coloured = [x for x in range(image.width) if image.getpixel((x, y)) == colour]
            if value == 0:
                assert len(coloured) <= 2
            else:  # the bar runs from the axis to the value's x (within the rounding of a pixel)
                assert abs(max(coloured) - (left + (right - left) * value / 100)) <= 1


@pytest.mark.parametrize("difficulty", ["easy", "standard"])
def test_digits_write_the_answer(difficulty):
    samples = generate("digits", 50, seed=0, difficulty=difficulty)
    top = 99 if difficulty == "easy" else 999
    assert all(0 <= int(s.answer) <= top for s in samples)
    assert len({s.answer for s in samples}) > 30
    for sample in samples:
        ink = sample.key[3]
        # ink-coloured pixels exist, and more for more digits (a sanity check that the number is drawn)
        distance = np.abs(np.asarray(sample.image, dtype=int) - np.array(ink)).sum(axis=2)
        drawn = int((distance < 60).sum())
        assert drawn > 10 * len(sample.answer)


def test_a_variant_a_task_does_not_have_is_a_clear_error():
    with pytest.raises(
        ValueError, match="task digits has no 'easy-alt' variant; easy-alt exists for clock, boxes, chart"
    ):
        generate("digits", 2, seed=0, difficulty="easy-alt")


@pytest.mark.parametrize(
    "text, message",
    [
        ("clock:easy", "must be TASK:DIFFICULTY:N"),
        ("clock:easy:many", "must be TASK:DIFFICULTY:N"),
        ("dials:easy:10", "task one of clock, boxes, chart, digits, arithmetic"),
        ("clock:hard:10", "difficulty one of standard, easy, easy-alt"),
        ("clock:easy:10,clock:easy:20", "distinct TASK:DIFFICULTY parts"),
        ("", "distinct TASK:DIFFICULTY parts"),
    ],
)
def test_bad_mixture_parts_say_what_to_write(text, message):
    with pytest.raises(ValueError, match=message):
        parse_parts(text)


def test_mixture_holds_every_part_once_shuffled_and_is_the_same_bytes_twice(tmp_path, capsys):
    spec = "clock:easy:20,digits:standard:10,arithmetic:easy:10"
    make_data.main(["mix", "--parts", spec, "--out", str(tmp_path / "a"), "--seed", "3"])
    assert "40 samples of 3 parts" in capsys.readouterr().out
    write_mixture(parse_parts(spec), tmp_path / "b", seed=3)
    for split, size in {"train": 32, "val": 4, "test": 4}.items():
        lines = (tmp_path / "a" / f"{split}.jsonl").read_text().splitlines()
        assert lines == (tmp_path / "b" / f"{split}.jsonl").read_text().splitlines()
        assert len(lines) == size
        rows = [json.loads(line) for line in lines]
        # each part's own split, every line once, its task kept, its image path valid from the mixture
        for task, folder in [
            ("clock", "clock-easy"),
            ("digits", "digits-standard"),
            ("arithmetic", "arithmetic-easy"),
        ]:
            part = (tmp_path / "a" / folder / f"{split}.jsonl").read_text().splitlines()
            mine = [r for r in rows if r["task"] == task]
            assert len(mine) == len(part)
        for row in rows:
            for item in row["messages"][0]["content"]:
                if item["type"] == "image":
                    assert (tmp_path / "a" / item["image"]).is_file()
    train_tasks = [
        json.loads(line)["task"] for line in (tmp_path / "a" / "train.jsonl").read_text().splitlines()
    ]
    assert train_tasks != sorted(train_tasks, key=["clock", "digits", "arithmetic"].index)  # shuffled
    meta = json.loads((tmp_path / "a" / "meta.json").read_text())
    assert meta["train"] == 32 and [p["task"] for p in meta["parts"]] == ["clock", "digits", "arithmetic"]


def test_make_data_mix_arguments_are_checked(capsys):
    with pytest.raises(SystemExit):
        make_data.main(["mix", "--n", "10", "--out", "x", "--parts", "clock:easy:10"])
    assert "mix takes --parts" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        make_data.main(["clock", "--out", "x"])
    assert "clock takes --n" in capsys.readouterr().err
