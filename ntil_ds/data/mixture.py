"""A mixture of synthetic tasks as one dataset: what the pretraining recipe trains on.

    write_mixture(parse_parts("clock:easy:2000,boxes:standard:1000"), "data/pretrain", seed=0)

Each part is an ordinary synthetic dataset in its own folder (``<out>/<task>-<difficulty>/``, its own
train/val/test splits, so each task can be scored alone on its test split); ``<out>/{train,val,test}.jsonl``
hold every part's lines of that split, image paths pointing into the parts' folders, shuffled once
with the mixture's seed. Every line keeps its ``task`` key.
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass
from pathlib import Path

from ntil_ds.data.synthetic import DIFFICULTIES, TASKS, write_dataset


@dataclass(frozen=True)
class Part:
    task: str
    difficulty: str
    n: int

    @property
    def folder(self) -> str:
        return f"{self.task}-{self.difficulty}"


def parse_parts(text: str) -> list[Part]:
    """ "clock:easy:2000,boxes:standard:1000" -> the parts, checked."""
    parts = []
    for spec in (s.strip() for s in text.split(",")):
        if not spec:
            continue
        fields = spec.split(":")
        if len(fields) != 3 or not fields[2].isdigit():
            raise ValueError(f"mixture part {spec!r} must be TASK:DIFFICULTY:N, e.g. clock:easy:2000")
        task, difficulty, n = fields[0], fields[1], int(fields[2])
        if task not in TASKS or difficulty not in DIFFICULTIES:
            raise ValueError(
                f"mixture part {spec!r}: task one of {', '.join(TASKS)}, difficulty one of "
                f"{', '.join(DIFFICULTIES)}"
            )
        parts.append(Part(task, difficulty, n))
    folders = [p.folder for p in parts]
    if not parts or len(set(folders)) != len(folders):
        raise ValueError(f"a mixture needs distinct TASK:DIFFICULTY parts, got {text!r}")
    return parts


def write_mixture(parts: list[Part], out_dir: str | Path, seed: int = 0) -> dict[str, Path]:
    """Write every part under ``out_dir`` and the mixed ``{train,val,test}.jsonl``; return their paths."""
    out = Path(out_dir)
    splits: dict[str, list[str]] = {"train": [], "val": [], "test": []}
    for part in parts:
        paths = write_dataset(part.task, part.n, out / part.folder, seed=seed, difficulty=part.difficulty)
        for split, path in paths.items():
            splits[split] += [_moved(line, part.folder) for line in path.read_text().splitlines()]
    mixed = {}
    for split, lines in splits.items():
        random.Random(f"mixture:{seed}:{split}").shuffle(lines)
        mixed[split] = out / f"{split}.jsonl"
        mixed[split].write_text("".join(line + "\n" for line in lines))
    meta = {"parts": [asdict(p) for p in parts], "seed": seed, **{s: len(v) for s, v in splits.items()}}
    (out / "meta.json").write_text(json.dumps(meta) + "\n")
    return mixed


def _moved(line: str, folder: str) -> str:
    """A part's JSONL line as seen from the mixture's folder: image paths prefixed with the part's."""
    row = json.loads(line)
    for message in row["messages"]:
        if isinstance(message["content"], list):
            for part in message["content"]:
                if part.get("type") == "image":
                    part["image"] = f"{folder}/{part['image']}"
    return json.dumps(row)
