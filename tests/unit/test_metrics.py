"""Metrics on hand-computed cases."""

import math

import pytest

from ntil_ds.scoring import (
    box_iou,
    clock_deviation,
    digit_position_hits,
    exact_match,
    parse_box,
    parse_clock,
    parse_number,
    relative_error,
    score,
)


def test_exact_match_and_number_parsing():
    assert exact_match(" 10:42 ", "10:42") and not exact_match("10:43", "10:42")
    assert parse_number("The answer is -12.5.") == -12.5
    assert parse_number("5198") == 5198 and parse_number("no digits") is None
    assert relative_error(110, 100) == pytest.approx(0.1)
    assert relative_error(0.5, 0) == 0.5  # below 1 the error is absolute


def test_digit_positions_count_from_the_units():
    assert digit_position_hits(5188, 5198) == [True, False, True, True]
    assert digit_position_hits(198, 5198) == [True, True, True, False]  # missing thousands digit
    assert digit_position_hits(None, 42) == [False, False]


def test_box_iou_by_hand():
    assert box_iou((0, 0, 10, 10), (0, 0, 10, 10)) == 1.0
    assert box_iou((0, 0, 10, 10), (5, 0, 15, 10)) == pytest.approx(50 / 150)
    assert box_iou((0, 0, 10, 10), (20, 20, 30, 30)) == 0.0
    assert box_iou((10, 10, 0, 0), (0, 0, 10, 10)) == 0.0  # inverted box is empty
    assert parse_box("[1, 2, 30, 40]") == (1, 2, 30, 40) and parse_box("[1, 2]") is None


def test_clock_on_a_twelve_hour_dial():
    assert parse_clock("11:58") == 718 and parse_clock("00:02") == 2 and parse_clock("12:02") == 2
    assert clock_deviation(parse_clock("11:58"), parse_clock("00:02")) == 4
    assert clock_deviation(parse_clock("03:00"), parse_clock("09:00")) == 360
    assert clock_deviation(parse_clock("13:15"), parse_clock("01:15")) == 0  # 24-hour answers fold
    assert parse_clock("10:75") is None and parse_clock("ten to two") is None


def test_score_numbers_counts_unparsed_as_wrong():
    result = score("arithmetic", ["5198", "5188", "I don't know", "12"], ["5198", "5198", "42", "10"])
    assert result["n"] == 4 and result["parsed"] == 3 and result["unparsed"] == 1
    assert result["exact_match"] == 0.25
    assert result["abs_error"] == pytest.approx((0 + 10 + 2) / 3)
    assert result["rel_error"] == pytest.approx((0 + 10 / 5198 + 2 / 10) / 3)
    # units: hit, hit, miss (unparsed), miss (2 vs 0); tens: hit, miss, miss, hit; then 2 of 2 each
    assert result["digit_acc_pos0"] == 0.5 and result["digit_acc_pos1"] == 0.5
    assert result["digit_acc_pos2"] == 1.0 and result["digit_acc_pos3"] == 1.0
    assert result["digit_acc"] == pytest.approx(8 / 12)


def test_score_boxes_and_clock():
    boxes = score("boxes", ["[0, 0, 10, 10]", "[5, 0, 15, 10]", "nothing"], ["[0, 0, 10, 10]"] * 3)
    assert boxes["iou"] == pytest.approx((1 + 1 / 3 + 0) / 3)
    assert boxes["acc@0.5"] == pytest.approx(1 / 3) and boxes["unparsed"] == 1
    clock = score("clock", ["11:58", "10:42", "?"], ["00:02", "10:42", "03:30"])
    assert clock["clock_acc"] == pytest.approx(1 / 3)
    assert clock["clock_dev_minutes"] == 2.0 and clock["parsed"] == 2 and clock["unparsed"] == 1


@pytest.mark.parametrize("task", ["arithmetic", "chart", "boxes", "clock"])
def test_perfect_predictions_score_perfectly(task):
    references = {"boxes": ["[1, 2, 30, 40]"], "clock": ["12:00"]}.get(task, ["7", "123"])
    result = score(task, references, references)
    assert result["exact_match"] == 1.0 and result["unparsed"] == 0
    for key in ("digit_acc", "acc@0.5", "clock_acc", "iou"):
        if key in result:
            assert result[key] == 1.0
    for key in ("abs_error", "rel_error", "clock_dev_minutes"):
        if key in result:
            assert result[key] == 0.0


def test_bad_references_and_lengths_raise():
    with pytest.raises(ValueError, match="reference answer 'abc' cannot be parsed"):
        score("chart", ["1"], ["abc"])
    with pytest.raises(ValueError, match="2 predictions for 1 references"):
        score("chart", ["1", "2"], ["1"])
    assert math.isnan(score("chart", ["x"], ["3"])["abs_error"])  # nothing parsed: no error mean
