"""The metrics as the paper reads them from generated answers, on hand-computed cases: parse rate for
every task, box coordinate MAE, and the per-task error means with unparsed answers in the mix."""

import math

import pytest

from ntil_ds.scoring import score


def test_parse_rate_for_every_task():
    cases = {
        "clock": (["03:15", "quarter past", "10:00", ""], ["03:15", "03:15", "09:00", "01:00"]),
        "boxes": (["[1, 2, 3, 4]", "[1, 2]", "x", "[0, 0, 5, 5]"], ["[1, 2, 3, 4]"] * 4),
        "chart": (["40", "forty", "", "7"], ["40", "41", "42", "43"]),
        "arithmetic": (["12", "-3", "n/a", "100"], ["12", "3", "5", "99"]),
    }
    expected = {"clock": 0.5, "boxes": 0.5, "chart": 0.5, "arithmetic": 0.75}
    for task, (predictions, references) in cases.items():
        result = score(task, predictions, references)
        assert result["parse_rate"] == expected[task], task
        assert result["parsed"] + result["unparsed"] == result["n"] == 4


def test_box_coordinate_mae_over_parsed_answers():
    # errors per coordinate: (0,0,0,0) and (2,1,0,3); the unparsed answer adds none
    result = score(
        "boxes",
        ["[10, 20, 30, 40]", "[12, 21, 30, 43]", "no box"],
        ["[10, 20, 30, 40]", "[10, 20, 30, 40]", "[10, 20, 30, 40]"],
    )
    assert result["coord_mae"] == pytest.approx((0 + 0 + 0 + 0 + 2 + 1 + 0 + 3) / 8)
    # IoU of the second: intersection [12,21]-[30,40] = 18*19 = 342; union 400 + 18*22 - 342 = 454
    assert result["iou"] == pytest.approx((1 + 342 / 454 + 0) / 3)
    assert result["acc@0.5"] == pytest.approx(2 / 3)
    assert result["exact_match"] == pytest.approx(1 / 3)


def test_clock_deviation_mean_and_exact_match():
    # deviations: 0, 45 (03:15 vs 04:00), 4 (11:58 vs 00:02 the short way), 360 (opposite); one unparsed
    result = score(
        "clock",
        ["03:15", "04:00", "11:58", "09:00", "soon"],
        ["03:15", "03:15", "12:02", "03:00", "03:00"],
    )
    assert result["clock_dev_minutes"] == pytest.approx((0 + 45 + 4 + 360) / 4)
    assert result["clock_acc"] == pytest.approx(1 / 5) and result["exact_match"] == pytest.approx(1 / 5)
    assert result["parse_rate"] == pytest.approx(4 / 5)


def test_chart_and_arithmetic_errors():
    result = score("chart", ["50", "45", "0", "bar"], ["50", "40", "4", "10"])
    assert result["exact_match"] == 0.25
    assert result["abs_error"] == pytest.approx((0 + 5 + 4) / 3)
    assert result["rel_error"] == pytest.approx((0 + 5 / 40 + 4 / 4) / 3)
    none_parsed = score("arithmetic", ["?", "?"], ["1", "2"])
    assert none_parsed["parse_rate"] == 0.0 and math.isnan(none_parsed["abs_error"])
