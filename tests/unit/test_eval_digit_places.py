"""Teacher-forced digit accuracy by place value (the trainer's eval; the MLflow digit-position plot)."""

import torch

from ntil_ds.evaluation.teacher_forced import digit_accuracy_by_place

DIGIT_IDS = torch.arange(10, 20)  # token id of "d" is 10 + d
IGNORED = -100


def tokens(text: str) -> list[int]:
    """Digits -> their ids, "." -> 50, " " -> 51, "?" -> IGNORED."""
    return [10 + int(c) if c.isdigit() else {".": 50, " ": 51, "?": IGNORED}[c] for c in text]


def test_places_are_counted_from_the_units_of_each_number():
    labels = torch.tensor([tokens("?123 45?"), tokens("1234567?")])
    predicted = labels.clone()
    predicted[0, 3] = 10 + 9  # the units digit of 123 wrong
    predicted[0, 5] = 10 + 9  # the tens digit of 45 wrong
    predicted[1, 0] = 10 + 9  # place 6 of 1234567: beyond the reported places, not counted
    counts, correct = digit_accuracy_by_place(predicted, labels, DIGIT_IDS, num_places=6)
    # places:            units tens hundreds thousands 10^4 10^5
    assert counts.tolist() == [3, 3, 2, 1, 1, 1]
    assert correct.tolist() == [2, 2, 2, 1, 1, 1]


def test_a_dot_splits_numbers_as_in_the_loss_paper_mode():
    labels = torch.tensor([tokens("3.015")])
    counts, correct = digit_accuracy_by_place(labels.clone(), labels, DIGIT_IDS, num_places=4)
    assert counts.tolist() == [2, 1, 1, 0]  # "3" (units) and "015" (units, tens, hundreds)
    assert correct.tolist() == counts.tolist()
