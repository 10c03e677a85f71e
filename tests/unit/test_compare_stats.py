"""The comparison's paired statistics (ntil_ds.comparison.stats and .paired) on hand-computed cases: the
t quantile and the sign test against tabulated values, a 3-seed example with known log-ratios, a run
failed on one side, a near-zero baseline, the two-level bootstrap, and the per-item scores it resamples."""

import json
import math

import numpy as np
import pytest

from ntil_ds.comparison import stats
from ntil_ds.comparison.paired import paired_markdown, paired_metrics, paired_report
from ntil_ds.comparison.results import RunResult
from ntil_ds.scoring import item_scores, score

# Student's t 0.975 quantiles as printed in statistical tables (e.g. NIST/SEMATECH e-Handbook 1.3.6.7.2)
T_TABLE = {2: 4.302652729749464, 4: 2.776445105197793, 7: 2.364624251592785, 1: 12.70620473617471}


@pytest.mark.parametrize("df", sorted(T_TABLE))
def test_t_quantile_matches_the_table(df):
    assert stats.t_quantile(0.975, df) == pytest.approx(T_TABLE[df], rel=1e-12)
    assert stats.t_quantile(0.025, df) == pytest.approx(-T_TABLE[df], rel=1e-12)
    # the distribution function behind it: P(|T| < 1) for 2 df is 1 / sqrt(3) (closed form)
    assert stats.t_two_sided_probability(1.0, 2) == pytest.approx(1 / math.sqrt(3), rel=1e-14)


def test_t_quantile_against_scipy_where_installed():
    scipy_stats = pytest.importorskip("scipy.stats")
    for df in range(1, 40):
        for q in (0.9, 0.975, 0.995):
            assert stats.t_quantile(q, df) == pytest.approx(scipy_stats.t.ppf(q, df), rel=1e-10)


def test_sign_test_exact():
    assert stats.sign_test_p(0, 8) == 2 / 256  # both tails of "all 8 the same way"
    assert stats.sign_test_p(8, 8) == 2 / 256
    assert stats.sign_test_p(7, 8) == 2 * (1 + 8) / 256  # 0.0703: 7 of 8 is not significant at 5 %
    assert stats.sign_test_p(4, 8) == 1.0 and stats.sign_test_p(0, 0) == 1.0
    assert stats.sign_test_p(5, 5) == 2 / 32  # 0.0625: 5 seeds can never reach p < 0.05
    with pytest.raises(ValueError):
        stats.sign_test_p(9, 8)


# ce on seeds 0-2: 10, 20, 40; ntil = ce * exp(-0.1), exp(-0.2), exp(-0.3): log-ratios -0.1, -0.2, -0.3
CE = {0: 10.0, 1: 20.0, 2: 40.0}
NTIL = {s: CE[s] * math.exp(-0.1 * (s + 1)) for s in CE}


def test_three_seeds_with_known_log_ratios():
    p = stats.paired_comparison(NTIL, CE, higher_is_better=False)
    assert p["paired_seeds"] == [0, 1, 2] and p["unpaired"] == []
    assert p["relative"]["log_ratios"] == pytest.approx([-0.1, -0.2, -0.3])
    # mean log-ratio -0.2, sample sd 0.1, half width t(2) * 0.1 / sqrt(3) = 0.248414
    half = T_TABLE[2] * 0.1 / math.sqrt(3)
    assert half == pytest.approx(0.2484137, abs=1e-6)
    assert p["relative"]["change"] == pytest.approx(math.exp(-0.2) - 1)  # -18.13 %
    assert p["relative"]["ci95"] == pytest.approx([math.exp(-0.2 - half) - 1, math.exp(-0.2 + half) - 1])
    assert p["relative"]["ci95"] == pytest.approx([-0.36136, 0.04961], abs=1e-5)
    # differences -0.951626, -3.625385, -10.367271: mean -4.981427, sd sqrt(47.08547 / 2) = 4.852086
    d = [NTIL[s] - CE[s] for s in CE]
    assert d == pytest.approx([-0.951626, -3.625385, -10.367271], abs=1e-6)
    assert p["difference"]["mean"] == pytest.approx(-4.981427, abs=1e-6)
    sd = 4.852086
    assert p["difference"]["ci95"] == pytest.approx(
        [-4.981427 - T_TABLE[2] * sd / math.sqrt(3), -4.981427 + T_TABLE[2] * sd / math.sqrt(3)], abs=1e-5
    )
    assert p["sign_test"] == {"wins": 3, "losses": 0, "ties": 0, "p": 0.25}
    # unpaired delta method: means 23.333 and m_o = 18.5577; se^2 over n
    m_o, m_c = sum(NTIL.values()) / 3, 70 / 3
    v_o = sum((v - m_o) ** 2 for v in NTIL.values()) / 2 / 3
    v_c = sum((v - m_c) ** 2 for v in CE.values()) / 2 / 3
    assert p["unpaired_delta_method"]["change"] == pytest.approx(m_o / m_c - 1)
    assert p["unpaired_delta_method"]["se"] == pytest.approx(math.sqrt(v_o / m_c**2 + m_o**2 * v_c / m_c**4))
    # higher is better flips who wins
    assert stats.paired_comparison(NTIL, CE, higher_is_better=True)["sign_test"]["wins"] == 0


def test_a_run_failed_on_one_side_is_unpaired_and_left_out():
    ce = {**CE, 3: 15.0}  # ntil seed 3 failed
    ntil = {**NTIL, 3: None, 4: 7.0}  # seed 4 has no ce run
    p = stats.paired_comparison(ntil, ce, higher_is_better=False)
    assert p["paired_seeds"] == [0, 1, 2]
    assert p["unpaired"] == [{"seed": 3, "other": "failed or no value"}, {"seed": 4, "baseline": "no run"}]
    full = stats.paired_comparison(NTIL, CE, higher_is_better=False)
    assert p["relative"] == full["relative"] and p["difference"] == full["difference"]
    # the unpaired comparison uses every finished run, seed 3's ce and seed 4's ntil included
    assert p["unpaired_delta_method"]["change"] == pytest.approx(
        (sum(NTIL.values()) + 7) / 4 / ((70 + 15) / 4) - 1
    )


def test_near_zero_baseline_gives_absolute_differences_only():
    at_zero = stats.paired_comparison({0: 0.02, 1: 0.01}, {0: 0.0, 1: 0.01}, higher_is_better=True)
    assert at_zero["relative"] is None and at_zero["relative_omitted"] == "a paired value is <= 0"
    assert at_zero["difference"]["mean"] == pytest.approx(0.01)
    # mean 0.1767, sd 0.2800, se 0.1617: the mean is within 2 se of zero
    noisy = stats.paired_comparison({0: 0.02, 1: 0.03, 2: 0.4}, {0: 0.01, 1: 0.02, 2: 0.5}, True)
    assert noisy["relative"] is None and "2 standard errors" in noisy["relative_omitted"]
    assert noisy["difference"]["ci95"] is not None
    # one seed: a change, no interval
    single = stats.paired_comparison({0: 5.0}, {0: 10.0}, False)
    assert single["relative"]["change"] == pytest.approx(-0.5) and single["relative"]["ci95"] is None


def test_bootstrap_two_levels_paired():
    ones = np.ones(50)
    # items constant within a run: only the seed level varies. Seeds' ratios -50 % and +50 %; the
    # resampled pairs (0,0), (0,1), (1,1) give -50 %, 0 %, +50 % with chance 1/4, 1/2, 1/4
    items = [(10 * ones, ones, 5 * ones, ones), (20 * ones, ones, 30 * ones, ones)]
    boot = stats.paired_bootstrap(items)
    assert boot["relative_ci95"] == pytest.approx([-0.5, 0.5]) and boot["resamples"] == 2000
    assert boot["difference_ci95"] == pytest.approx([-5.0, 10.0])
    assert stats.paired_bootstrap(items) == boot  # seeded
    # paired on items: other = baseline * 0.8 item by item, so every resample's change is -20 % exactly
    rng = np.random.default_rng(1)
    base = [rng.uniform(1, 100, 200) for _ in range(3)]
    boot = stats.paired_bootstrap([(b, np.ones(200), 0.8 * b, np.ones(200)) for b in base])
    assert boot["relative_ci95"] == pytest.approx([-0.2, -0.2])
    # unpaired items would not give that: shuffled other items widen it
    shuffled = stats.paired_bootstrap(
        [(b, np.ones(200), 0.8 * rng.permutation(b), np.ones(200)) for b in base]
    )
    assert shuffled["relative_ci95"][0] < -0.25 and shuffled["relative_ci95"][1] > -0.15
    # weights: an item of weight 0 (unparsed, for a mean error) never counts, whatever its value
    weights = np.r_[np.ones(49), 0.0]
    values = np.r_[np.full(49, 4.0), 1e9]
    boot = stats.paired_bootstrap([(values, weights, values / 2, weights)])
    assert boot["relative_ci95"] == pytest.approx([-0.5, -0.5])
    with pytest.raises(ValueError, match="same test items"):
        stats.paired_bootstrap([(ones, ones, np.ones(3), np.ones(3))])


@pytest.mark.parametrize(
    ("task", "predictions", "references"),
    [
        ("clock", ["3:15", "x", "12:00", "11:58"], ["03:15", "01:00", "06:00", "00:02"]),
        (
            "boxes",
            ["[0, 0, 10, 10]", "[5, 5, 9, 9]", "no"],
            ["[0, 0, 10, 10]", "[0, 0, 8, 8]", "[1, 1, 2, 2]"],
        ),
        ("arithmetic", ["12", "abc", "-3", "100"], ["10", "7", "-3", "1000"]),
    ],
)
def test_item_scores_average_to_the_task_scores(task, predictions, references):
    """What the bootstrap resamples: per-item (value, weight) whose weighted mean is score()'s value."""
    from ntil_ds.scoring import metrics_shown

    scores = score(task, predictions, references)
    for metric in (*metrics_shown(task), "exact_match"):
        values, weights = item_scores(task, metric, predictions, references)
        assert sum(v * w for v, w in zip(values, weights, strict=True)) / sum(weights) == pytest.approx(
            scores[metric]
        ), metric
    with pytest.raises(ValueError, match="no per-item score"):
        item_scores(task, "digit_acc", predictions, references)


def _run(tmp_path, label, seed, value, predictions=None, status="ok"):
    folder = tmp_path / f"{label}-{seed}"
    folder.mkdir()
    if predictions is not None:
        samples = [{"reference": r, "prediction": p} for p, r in zip(predictions, REFERENCES, strict=True)]
        (folder / "eval_test.json").write_text(json.dumps({"samples": samples}))
    metrics = {"abs_error": value, "parse_rate": 1.0} if status == "ok" else {}
    return RunResult(label, label, seed, str(folder), status=status, metrics=metrics)


REFERENCES = ["10", "20", "30", "40"]


def test_paired_report_table_and_mlflow_metrics(tmp_path):
    """From runs as a grid records them: the bootstrap re-scores each run's saved predictions; a failed
    run is named as unpaired in the table; a run without saved predictions stops only the bootstrap."""
    runs = [
        _run(tmp_path, "ce", 0, 2.0, ["12", "18", "30", "42"]),  # errors 2 2 0 2: mean 1.5 (ok, given)
        _run(tmp_path, "ntil", 0, 1.0, ["11", "19", "30", "41"]),
        _run(tmp_path, "ce", 1, 4.0, ["14", "16", "30", "44"]),
        _run(tmp_path, "ntil", 1, 2.0, ["12", "18", "30", "42"]),
        _run(tmp_path, "ce", 2, 3.0, ["13", "17", "30", "43"]),
        _run(tmp_path, "ntil", 2, None, status="failed"),
    ]
    paired = paired_report(runs, ("abs_error", "parse_rate"), "ce", "arithmetic")
    p = paired["ntil"]["abs_error"]
    assert p["paired_seeds"] == [0, 1] and p["unpaired"] == [{"seed": 2, "other": "failed or no value"}]
    assert p["relative"]["change"] == pytest.approx(-0.5)  # both seeds halve the error
    # per item, ntil's errors are half of ce's on both seeds: every resample says -50 %
    assert p["bootstrap"]["relative_ci95"] == pytest.approx([-0.5, -0.5])
    assert paired["ntil"]["parse_rate"]["relative"]["ci95"] == pytest.approx([0.0, 0.0])
    table = paired_markdown(paired, "abs_error", "ce")
    assert "| ntil | 2 | -1.5 [" in table and "| -50.0% [-50.0%, -50.0%] | 2/2 (p=0.5) |" in table
    assert (
        "unpaired, left out of the paired statistics: ntil vs ce seed 2 (ntil: failed or no value)" in table
    )
    flat = paired_metrics(paired)
    assert flat["ntil/paired/abs_error_change"] == pytest.approx(-0.5)
    assert flat["ntil/paired/abs_error_wins"] == 2 and flat["ntil/paired/abs_error_n"] == 2
    (tmp_path / "ntil-1" / "eval_test.json").unlink()
    again = paired_report(runs, ("abs_error",), "ce", "arithmetic")["ntil"]["abs_error"]
    assert again["bootstrap"].startswith("not run:") and again["relative"] == p["relative"]


def test_comparison_plot_draws_the_paired_panel_relative_or_absolute(tmp_path):
    from ntil_ds.tracking.plots import plot_comparison

    summary = {
        "ce": {"abs_error": {"mean": 23.3, "std": 15.3, "n": 3}},
        "ntil": {"abs_error": {"mean": 18.6, "std": 1, "n": 3}},
    }
    relative = {"ntil": {"abs_error": stats.paired_comparison(NTIL, CE, higher_is_better=False)}}
    near_zero = {"ntil": {"abs_error": stats.paired_comparison({0: 0.02, 1: 0.01}, {0: 0.0, 1: 0.01}, False)}}
    for name, paired in (("relative", relative), ("absolute", near_zero), ("none", None)):
        png = plot_comparison(summary, ("abs_error",), tmp_path / f"{name}.png", "t", set(), paired)
        assert png.read_bytes()[:4] == b"\x89PNG"
