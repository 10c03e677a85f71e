"""Controls beside every comparison: does a model read its input, or has it learned the answers' spread?

- Answer-ignoring constants, from the train split: the best constant of the task's error (the median
  number; the median box, coordinate by coordinate; for clocks the dial time with the least mean
  deviation from the train answers, the median on a circle) and the most common answer, each scored
  on the test split with the task's own metrics. A model no better than these has not read anything.
- A shuffled-input check (image tasks): the test split's first N items, each shown another item's
  images (a fixed, seeded permutation, one cycle, so no item keeps its own) with its own question, and
  scored against its own answer. A model that reads falls to chance there, the same permutation's
  answers scored against the true answers (:func:`shuffled_chance`); one that guesses does not move.
"""

from __future__ import annotations

import itertools
import json
import math
import statistics
from collections import Counter
from pathlib import Path

import numpy as np

from ntil_ds.data import BadSample, Conversation, split_last_answer
from ntil_ds.data.sources import read_samples
from ntil_ds.scoring import (
    MINUTES_ON_DIAL,
    clock_deviation,
    normalize,
    parse_box,
    parse_clock,
    parse_number,
    score,
)

SHUFFLE_SEED = 0
SHUFFLED_FILE = "shuffled_test.jsonl"  # written under the comparison's folder


def conversations(split: Path) -> list[Conversation]:
    """The split's usable lines (a bad line is left out, as the scoring's reader would refuse it)."""
    return [c for c in read_samples(split) if not isinstance(c, BadSample)]


def answers(split: Path) -> list[str]:
    return [split_last_answer(c)[2] for c in conversations(split)]


def _number_text(value: float, integral: bool) -> str:
    return str(round(value)) if integral else f"{value:g}"


def best_constant(task: str, train_answers: list[str]) -> str:
    """The answer-ignoring constant that minimises the task's error on ``train_answers``."""
    if task == "clock":
        minutes = np.array([m for a in train_answers if (m := parse_clock(a)) is not None])
        if not len(minutes):
            raise ValueError("no train answer parses as a clock time")
        candidates = np.arange(MINUTES_ON_DIAL)[:, None]
        difference = np.abs(candidates - minutes[None, :]) % MINUTES_ON_DIAL
        best = int(np.minimum(difference, MINUTES_ON_DIAL - difference).mean(1).argmin())
        assert clock_deviation(best, best) == 0  # the same dial arithmetic as the scoring
        return f"{best // 60 or 12:02d}:{best % 60:02d}"
    if task == "boxes":
        boxes = [b for a in train_answers if (b := parse_box(a)) is not None]
        if not boxes:
            raise ValueError("no train answer parses as a box")
        integral = all(float(v).is_integer() for b in boxes for v in b)
        median = [statistics.median(b[k] for b in boxes) for k in range(4)]
        return "[" + ", ".join(_number_text(v, integral) for v in median) + "]"
    numbers = [n for a in train_answers if (n := parse_number(a)) is not None]
    if not numbers:
        raise ValueError("no train answer parses as a number")
    return _number_text(statistics.median(numbers), all(float(n).is_integer() for n in numbers))


def control_scores(task: str, trains: list[Path], test: Path) -> dict:
    """{"train_split", "constants": {name: {"answer", "metrics"}}}: each constant, made from the answers
    of every training split (a data.mixture has several), scored on ``test``."""
    train_answers, test_answers = [a for train in trains for a in answers(train)], answers(test)
    train = ", ".join(str(train) for train in trains)
    if not train_answers or not test_answers:
        raise ValueError(f"controls need answers in both {train} and {test}")
    constants = {
        "best constant (train median)": best_constant(task, train_answers),
        "most common train answer": Counter(normalize(a) for a in train_answers).most_common(1)[0][0],
    }
    return {
        "train_split": train,
        "constants": {
            name: {
                "answer": answer,
                "metrics": _nan_as_none(score(task, [answer] * len(test_answers), test_answers)),
            }
            for name, answer in constants.items()
        },
    }


def _nan_as_none(metrics: dict) -> dict:
    """Strict JSON: a mean over nothing parsed is None, not NaN."""
    return {k: None if isinstance(v, float) and math.isnan(v) else v for k, v in metrics.items()}


def one_cycle(n: int, seed: int = SHUFFLE_SEED) -> list[int]:
    """A seeded permutation of range(n) with no fixed point (n >= 2): a random order read as one cycle."""
    if n < 2:
        raise ValueError("a shuffled check needs at least 2 items")
    order = np.random.default_rng(seed).permutation(n)
    permutation = [0] * n
    for k in range(n):
        permutation[int(order[k])] = int(order[(k + 1) % n])
    return permutation


def _image_file(image, out: Path, count) -> str:
    """An image's absolute path; an image inside a table row (a Parquet / Arrow split) written to a file
    beside ``out`` first, since a JSONL line names files."""
    if isinstance(image, Path):
        return str(image.resolve())
    folder = out.parent / f"{out.stem}_images"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{next(count):06d}.img"  # PIL reads the format from the bytes, not the name
    path.write_bytes(image.read_bytes())
    return str(path.resolve())


def write_shuffled_split(test: Path, out: Path, n: int, seed: int = SHUFFLE_SEED) -> dict | None:
    """The first ``n`` test items, item i shown item permutation[i]'s images (absolute paths) with its
    own question and answer, written to ``out``; returns {"path", "n", "seed", "permutation"}, or None
    when the split shows no images (nothing to shuffle) or the items' image counts differ."""
    items = conversations(test)[:n]
    if len(items) < 2 or not all(c.images for c in items):
        return None
    if len({len(c.images) for c in items}) != 1:
        return None
    permutation = one_cycle(len(items), seed)
    lines, count = [], itertools.count()
    for item, source in zip(items, (items[p] for p in permutation), strict=True):
        images = iter(source.images)
        messages = [
            {
                "role": m["role"],
                "content": [
                    {"type": "image", "image": _image_file(next(images), out, count)}
                    if part["type"] == "image"
                    else part
                    for part in m["content"]
                ],
            }
            for m in item.messages
        ]
        lines.append(json.dumps({"messages": messages}) + "\n")
    out.write_text("".join(lines))
    return {"path": str(out), "n": len(items), "seed": seed, "permutation": permutation}


def shuffled_chance(task: str, test: Path, shuffled: dict) -> dict:
    """Chance on the shuffled check: each item's permuted partner's true answer scored against its own
    (what a model that reads the image it is shown and nothing else would score)."""
    truth = answers(test)[: shuffled["n"]]
    return _nan_as_none(score(task, [truth[p] for p in shuffled["permutation"]], truth))


def controls_markdown(controls: dict | None, runs: list, summary: dict, metrics: tuple[str, ...]) -> str:
    """table.md's controls: the constants' scores, and each loss on the shuffled check beside chance."""
    if not controls:
        return ""
    lines = [
        f"Controls: answer-ignoring constants from the train split ({controls['train_split']}), scored on the "
        "test split with the same metrics:",
        "",
        "| control | answer | " + " | ".join(metrics) + " |",
        "|" + "---|" * (len(metrics) + 2),
    ]
    for name, constant in controls["constants"].items():
        cells = [_cell(constant["metrics"].get(m)) for m in metrics]
        lines.append(f"| {name} | {constant['answer']} | " + " | ".join(cells) + " |")
    shuffled = controls.get("shuffled")
    if shuffled:
        primary = metrics[0]
        lines += [
            "",
            f"Shuffled-input check: the test split's first {shuffled['n']} items, each shown another item's "
            f"images (one fixed permutation, seed {shuffled['seed']}) and scored against its own answer. A "
            "model that reads falls to chance (the permutation's answers against the true ones); one that "
            "guesses stays where it was.",
            "",
            f"| loss | {primary} shuffled | {primary} on the test split | chance |",
            "|---|---|---|---|",
        ]
        for label in summary:
            values = [
                r.shuffled[primary]
                for r in runs
                if r.label == label and isinstance(r.shuffled.get(primary), float)
            ]
            shown = (
                "n/a"
                if not values
                else f"{statistics.fmean(values):.4g}"
                + (f" ± {statistics.stdev(values):.2g}" if len(values) > 1 else "")
                + f" ({len(values)} runs)"
            )
            test = summary[label].get(primary)
            chance = _cell(shuffled["chance"].get(primary))
            lines.append(f"| {label} | {shown} | {_cell(test and test['mean'])} | {chance} |")
    return "\n".join(lines) + "\n"


def _cell(value) -> str:
    return "n/a" if value is None else f"{value:.4g}"


def controls_metrics(controls: dict | None) -> dict[str, float]:
    """Flat metrics for the MLflow parent run: ``controls/<constant>/<metric>`` and
    ``controls/shuffled_chance/<metric>`` (each loss's shuffled scores are in its own child run)."""
    flat: dict[str, float] = {}
    for name, constant in (controls or {}).get("constants", {}).items():
        key = "best_constant" if name.startswith("best") else "most_common"
        flat |= {
            f"controls/{key}/{m}": v for m, v in constant["metrics"].items() if isinstance(v, int | float)
        }
    chance = ((controls or {}).get("shuffled") or {}).get("chance", {})
    flat |= {f"controls/shuffled_chance/{m}": v for m, v in chance.items() if isinstance(v, int | float)}
    return flat
