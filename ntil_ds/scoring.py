"""Scoring generated answers (pure functions): the paper's box Acc@0.5, clock accuracy and deviation,
exact match and the error of numbers, and accuracy per digit position; and, per task, which of these
scores a comparison shows (:data:`TASK_METRICS`) and which way is better (:data:`HIGHER_IS_BETTER`).

An answer that cannot be parsed counts as wrong in every accuracy and is counted (`unparsed`); error
means (absolute, relative, minutes) are over the parsed answers only, with `parsed` saying how many.
A reference that cannot be parsed is an error in the data and raises.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

NUMBER = re.compile(r"[-+]?\d+(?:\.\d+)?")
CLOCK = re.compile(r"(\d{1,2})\s*:\s*(\d{2})")
MINUTES_ON_DIAL = 12 * 60

# Scores shown per task, the first one the numeric error a comparison is about (lower is better unless
# listed in HIGHER_IS_BETTER). Any other task name is scored and shown as a number task.
TASK_METRICS = {
    "clock": ("clock_dev_minutes", "clock_acc", "parse_rate"),
    "boxes": ("coord_mae", "acc@0.5", "iou", "parse_rate"),
    "chart": ("abs_error", "rel_error", "exact_match", "parse_rate"),
    "arithmetic": ("abs_error", "rel_error", "exact_match", "parse_rate"),
}
HIGHER_IS_BETTER = {"clock_acc", "acc@0.5", "iou", "exact_match", "parse_rate", "digit_acc"}


def metrics_shown(task: str) -> tuple[str, ...]:
    return TASK_METRICS.get(task, TASK_METRICS["arithmetic"])


def normalize(text: str) -> str:
    """Whitespace-trimmed, inner whitespace collapsed: what exact match compares."""
    return " ".join(text.split())


def exact_match(prediction: str, reference: str) -> bool:
    return normalize(prediction) == normalize(reference)


def parse_number(text: str) -> float | None:
    """The first number in `text` ("The answer is -12.5." -> -12.5), or None."""
    match = NUMBER.search(text)
    return float(match.group()) if match else None


def absolute_error(prediction: float, reference: float) -> float:
    return abs(prediction - reference)


def relative_error(prediction: float, reference: float) -> float:
    """|p - r| / max(|r|, 1): relative for large references, absolute below 1 (no division by ~0)."""
    return abs(prediction - reference) / max(abs(reference), 1.0)


def digits_by_position(number: float) -> list[int]:
    """Digits of the integer part, units first: 5198 -> [8, 9, 1, 5]."""
    return [int(d) for d in reversed(str(int(abs(number))))]


def digit_position_hits(prediction: float | None, reference: float) -> list[bool]:
    """Per digit position of the reference (units first): does the prediction have the same digit there?
    A missing or unparsed prediction misses every position."""
    ref = digits_by_position(reference)
    pred = digits_by_position(prediction) if prediction is not None else []
    return [i < len(pred) and pred[i] == digit for i, digit in enumerate(ref)]


def parse_box(text: str) -> tuple[float, float, float, float] | None:
    """The first four numbers of "[x1, y1, x2, y2]", or None when there are not four."""
    numbers = NUMBER.findall(text)
    if len(numbers) < 4:
        return None
    x1, y1, x2, y2 = (float(n) for n in numbers[:4])
    return x1, y1, x2, y2


def box_iou(a: Sequence[float], b: Sequence[float]) -> float:
    """Intersection over union of two (x1, y1, x2, y2) boxes; a box with x2 < x1 or y2 < y1 is empty."""

    def area(box: Sequence[float]) -> float:
        return max(0.0, box[2] - box[0]) * max(0.0, box[3] - box[1])

    inter = area((max(a[0], b[0]), max(a[1], b[1]), min(a[2], b[2]), min(a[3], b[3])))
    union = area(a) + area(b) - inter
    return inter / union if union > 0 else 0.0


def parse_clock(text: str) -> int | None:
    """Minutes past 12 o'clock on a 12-hour dial ("10:42" -> 642, "00:02" and "12:02" -> 2), or None."""
    match = CLOCK.search(text)
    if not match:
        return None
    hours, minutes = int(match.group(1)), int(match.group(2))
    if hours > 24 or minutes > 59:
        return None
    return (hours % 12) * 60 + minutes


def clock_deviation(prediction_minutes: int, reference_minutes: int) -> int:
    """Minutes between two dial readings, the short way round (11:58 vs 00:02 -> 4)."""
    difference = abs(prediction_minutes - reference_minutes) % MINUTES_ON_DIAL
    return min(difference, MINUTES_ON_DIAL - difference)


# ----------------------------------------------------------------------------------------------------
# aggregate scores per task


def score(task: str, predictions: Sequence[str], references: Sequence[str]) -> dict[str, float]:
    """Scores of one task's predictions against references (equal-length lists of answer strings).

    Every task: `n`, `exact_match`, `parsed`, `unparsed`, `parse_rate` (parsed / n). Then by task: number
    tasks (`arithmetic`, `chart`, and any other task name) add `abs_error` (MAE), `rel_error` (mean
    relative error), `digit_acc` and `digit_acc_pos<i>` (units = 0); `boxes` adds `iou` (mean IoU, an
    unparsed answer counts 0), `acc@0.5` (share with IoU >= 0.5) and `coord_mae` (mean absolute error of
    the four coordinates, over parsed answers); `clock` adds `clock_acc` (exact time) and
    `clock_dev_minutes` (mean deviation on the 12-hour dial, over parsed answers).
    """
    if len(predictions) != len(references):
        raise ValueError(f"{len(predictions)} predictions for {len(references)} references")
    if not references:
        raise ValueError("no references to score")
    scorer = {"boxes": _score_boxes, "clock": _score_clock}.get(task, _score_numbers)
    result = {
        "n": len(references),
        "exact_match": _mean(exact_match(p, r) for p, r in zip(predictions, references, strict=True)),
    }
    result.update(scorer(predictions, references))
    result["unparsed"] = result["n"] - result["parsed"]
    result["parse_rate"] = result["parsed"] / result["n"]
    return result


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values) if values else math.nan


def _reference(parser, text: str):
    value = parser(text)
    if value is None:
        raise ValueError(f"reference answer {text!r} cannot be parsed; check the data")
    return value


def _score_numbers(predictions, references) -> dict[str, float]:
    refs = [_reference(parse_number, r) for r in references]
    preds = [parse_number(p) for p in predictions]
    parsed = [(p, r) for p, r in zip(preds, refs, strict=True) if p is not None]
    hits = [digit_position_hits(p, r) for p, r in zip(preds, refs, strict=True)]
    result = {
        "parsed": len(parsed),
        "abs_error": _mean(absolute_error(p, r) for p, r in parsed),
        "rel_error": _mean(relative_error(p, r) for p, r in parsed),
        "digit_acc": _mean(hit for row in hits for hit in row),
    }
    for position in range(max(len(row) for row in hits)):
        result[f"digit_acc_pos{position}"] = _mean(row[position] for row in hits if position < len(row))
    return result


def _score_boxes(predictions, references) -> dict[str, float]:
    refs = [_reference(parse_box, r) for r in references]
    preds = [parse_box(p) for p in predictions]
    ious = [box_iou(p, r) if p is not None else 0.0 for p, r in zip(preds, refs, strict=True)]
    coordinate_errors = [
        abs(a - b)
        for p, r in zip(preds, refs, strict=True)
        if p is not None
        for a, b in zip(p, r, strict=True)
    ]
    return {
        "parsed": sum(p is not None for p in preds),
        "iou": _mean(ious),
        "acc@0.5": _mean(iou >= 0.5 for iou in ious),
        "coord_mae": _mean(coordinate_errors),
    }


def _score_clock(predictions, references) -> dict[str, float]:
    refs = [_reference(parse_clock, r) for r in references]
    preds = [parse_clock(p) for p in predictions]
    deviations = [clock_deviation(p, r) for p, r in zip(preds, refs, strict=True) if p is not None]
    return {
        "parsed": len(deviations),
        "clock_acc": _mean(
            p is not None and clock_deviation(p, r) == 0 for p, r in zip(preds, refs, strict=True)
        ),
        "clock_dev_minutes": _mean(deviations),
    }


def item_scores(
    task: str, metric: str, predictions: Sequence[str], references: Sequence[str]
) -> tuple[list[float], list[float]]:
    """Per test item, (value, weight) of one of :func:`score`'s means: the score is sum(value * weight) /
    sum(weight), weight 0 for an item the mean leaves out (an unparsed answer of a mean error). What a
    bootstrap over test items resamples; `digit_acc` (a mean over digit positions) has none."""
    parsers = {"boxes": parse_box, "clock": parse_clock}
    parser = parsers.get(task, parse_number)
    refs = [_reference(parser, r) for r in references]
    preds = [parser(p) for p in predictions]
    parsed = [float(p is not None) for p in preds]
    if metric == "exact_match":
        return [float(exact_match(p, r)) for p, r in zip(predictions, references, strict=True)], [1.0] * len(
            refs
        )
    if metric == "parse_rate":
        return parsed, [1.0] * len(refs)
    per_item = {
        ("boxes", "iou"): lambda p, r: box_iou(p, r),
        ("boxes", "acc@0.5"): lambda p, r: float(box_iou(p, r) >= 0.5),
        ("boxes", "coord_mae"): lambda p, r: sum(abs(a - b) for a, b in zip(p, r, strict=True)) / 4,
        ("clock", "clock_acc"): lambda p, r: float(clock_deviation(p, r) == 0),
        ("clock", "clock_dev_minutes"): lambda p, r: float(clock_deviation(p, r)),
        ("number", "abs_error"): absolute_error,
        ("number", "rel_error"): relative_error,
    }
    function = per_item.get((task if task in parsers else "number", metric))
    if function is None:
        raise ValueError(f"no per-item score for {metric!r} of task {task!r}")
    values = [function(p, r) if p is not None else 0.0 for p, r in zip(preds, refs, strict=True)]
    # accuracies and IoU count an unparsed answer as a miss (weight 1, value 0); mean errors skip it
    counts_unparsed = metric in ("iou", "acc@0.5", "clock_acc")
    return values, [1.0] * len(refs) if counts_unparsed else parsed
