"""Synthetic tasks: same seed -> identical bytes, splits that never overlap, answers that match what is
drawn, and `make_data` output that the loader reads for every task."""

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

from ntil_ds.data import IGNORE_INDEX, Collator, ConversationDataset, load_processor, tokenizer_of
from ntil_ds.data.synthetic import TASKS, generate, make_boxes, split_sizes, write_dataset
from ntil_ds.scoring import parse_box, parse_clock
from ntil_ds.tiny import build_tiny_model_folder

REPO = Path(__file__).resolve().parents[2]


def _tree_digest(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


@pytest.mark.parametrize("task", TASKS)
def test_same_seed_same_bytes_other_seed_other_data(tmp_path, task):
    first = _tree_digest(Path(write_dataset(task, 12, tmp_path / "a", seed=3)["train"]).parent)
    again = _tree_digest(Path(write_dataset(task, 12, tmp_path / "b", seed=3)["train"]).parent)
    other = _tree_digest(Path(write_dataset(task, 12, tmp_path / "c", seed=4)["train"]).parent)
    assert first == again
    assert first["train.jsonl"] != other["train.jsonl"]


@pytest.mark.parametrize("task", TASKS)
def test_splits_do_not_overlap(task):
    samples = generate(task, 200, seed=0)
    assert len({s.key for s in samples}) == 200
    sizes = split_sizes(200)
    assert sizes == {"train": 160, "val": 20, "test": 20}
    # what a model sees: the same image and question in two splits would be an overlap
    seen = set()
    for s in samples:
        image = hashlib.sha256(s.image.tobytes()).hexdigest() if s.image is not None else None
        assert (image, s.question, s.answer) not in seen
        seen.add((image, s.question, s.answer))


def test_clock_hands_point_at_the_answer():
    # The minute hand's tip is the darkest pixel far from the centre at the answer's angle.
    import math

    for sample in generate("clock", 20, seed=5):
        image = sample.image.convert("L")
        size = image.width
        minutes = parse_clock(sample.answer) % 60
        angle = math.radians(minutes * 6)
        r = (size / 2 - 3) * 0.7
        x, y = size / 2 + r * math.sin(angle), size / 2 - r * math.cos(angle)
        around = [image.getpixel((round(x) + dx, round(y) + dy)) for dx in (-1, 0, 1) for dy in (-1, 0, 1)]
        opposite = image.getpixel((round(size - x), round(size - y)))
        assert min(around) < opposite, sample.answer


def test_boxes_answer_is_the_shapes_bounding_box():
    import random

    for i in range(20):
        sample = make_boxes(random.Random(i))
        x1, y1, x2, y2 = (int(v) for v in parse_box(sample.answer))
        background = sample.image.getpixel((0, 0)) if x1 > 0 or y1 > 0 else sample.image.getpixel((111, 111))
        crop = sample.image.crop((x1, y1, x2 + 1, y2 + 1))
        box = Image.new("RGB", crop.size, background)
        # the shape touches all four sides of its box and nothing of it lies outside
        diff = [
            [crop.getpixel((x, y)) != box.getpixel((x, y)) for x in range(crop.width)]
            for y in range(crop.height)
        ]
        assert any(diff[0]) and any(diff[-1]) and any(row[0] for row in diff) and any(row[-1] for row in diff)


@pytest.mark.parametrize("task", TASKS)
def test_make_data_output_loads_and_collates(tmp_path_factory, task):
    out = tmp_path_factory.mktemp(task)
    paths = write_dataset(task, 10, out, seed=0)
    assert json.loads((out / "meta.json").read_text())["task"] == task
    kind = "qwen2" if task == "arithmetic" else "qwen2_vl"
    processor = load_processor(build_tiny_model_folder(kind, tmp_path_factory.mktemp("model")))
    for split, path in paths.items():
        dataset = ConversationDataset(path, processor, max_seq_len=256)
        assert len(dataset) == split_sizes(10)[split] and dataset.report.num_skipped == 0
    dataset = ConversationDataset(paths["train"], processor, max_seq_len=256)
    batch = Collator(processor)([dataset[0], dataset[1]])
    targets = batch["targets"][0]
    answer = dataset.conversations[0].answers()[0]
    assert tokenizer_of(processor).decode(targets[targets != IGNORE_INDEX]) == answer + "<|im_end|>"
    if task != "arithmetic":
        assert batch["image_grid_thw"].shape[0] == 2


@pytest.mark.timeout(120)
def test_make_data_command(tmp_path):
    result = subprocess.run(
        [
            sys.executable,
            "launch/make_data.py",
            "boxes",
            "--n",
            "20",
            "--out",
            str(tmp_path / "boxes"),
            "--seed",
            "1",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=110,
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
    )
    assert result.returncode == 0, result.stderr
    assert "samples/s" in result.stdout
    rows = (tmp_path / "boxes" / "test.jsonl").read_text().splitlines()
    assert len(rows) == 2 and (tmp_path / "boxes" / "images" / "test" / "000001.png").is_file()
