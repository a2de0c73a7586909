"""Tests of the seed statistics: the t interval against textbook values, the per-seed aggregator's nesting."""

import math

import pytest

from stemlm.experiments.stats import format_ci, format_seeds, mean_ci95, summarize_seeds


def test_mean_ci95_matches_textbook_t_interval():
    # [1, 2, 3]: mean 2, sample sd 1, t(0.975, df=2) = 4.302653 (printed tables) -> half-width 4.302653 / sqrt(3)
    r = mean_ci95([1.0, 2.0, 3.0])
    assert r["n"] == 3 and r["mean"] == pytest.approx(2.0) and r["sd"] == pytest.approx(1.0)
    half = 4.302653 / math.sqrt(3)
    assert r["ci95"] == pytest.approx([2.0 - half, 2.0 + half], abs=1e-5)


def test_mean_ci95_two_seeds_uses_df_one():
    # t(0.975, df=1) = 12.706205; values 0.2 and 0.8: sd = 0.6 / sqrt(2), half = 12.706205 * sd / sqrt(2) = 3.8119
    r = mean_ci95([0.2, 0.8])
    assert r["mean"] == pytest.approx(0.5)
    assert r["ci95"] == pytest.approx([0.5 - 12.706205 * 0.3, 0.5 + 12.706205 * 0.3], abs=1e-5)


def test_missing_values_and_single_seed():
    assert mean_ci95([None, float("nan"), 4.0]) == {"mean": 4.0, "ci95": [None, None], "n": 1, "sd": None}
    assert mean_ci95([]) == {"mean": None, "ci95": [None, None], "n": 0, "sd": None}
    assert mean_ci95([3.0, 3.0])["ci95"] == [3.0, 3.0]


def test_summarize_seeds_keeps_nesting_and_skips_non_numbers():
    per_seed = [
        {"seed": 0, "dense": {"loss": 5.0, "recall": {"train": 0.2}}, "name": "a", "ok": True, "curve": [1, 2]},
        {"seed": 1, "dense": {"loss": 6.0, "recall": {"train": 0.4}}, "name": "b", "ok": False, "curve": [3]},
        {"seed": 2, "dense": {"loss": 7.0, "recall": {"train": None}}, "stem": {"loss": 1.0}},
    ]
    s = summarize_seeds(per_seed)
    assert set(s) == {"seed", "dense", "stem"}
    assert s["dense"]["loss"]["mean"] == pytest.approx(6.0) and s["dense"]["loss"]["n"] == 3
    assert s["dense"]["recall"]["train"]["mean"] == pytest.approx(0.3) and s["dense"]["recall"]["train"]["n"] == 2
    assert s["stem"]["loss"] == {"mean": 1.0, "ci95": [None, None], "n": 1, "sd": None}


def test_formatting():
    assert format_ci({"mean": 0.5, "ci95": [0.4, 0.6]}) == "0.500 ± 0.100"
    assert format_ci({"mean": 0.5, "ci95": [None, None]}) == "0.500 (1 seed)"
    assert format_ci(None) == "n/a"
    assert format_seeds([0.1, None, 0.25], digits=2) == "0.10 / - / 0.25"
