"""benchmarks/cost_model.py: the async / co-located prediction, worked by hand. CPU, instant."""

import sys

import pytest

from conftest import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
from cost_model import best_split, from_measurement, predict  # noqa: E402


def test_best_split_and_ratio_by_hand():
    """gen 9 and train 3 tokens/s per GPU: on 8 GPUs k generators give min(9k, 3(8 - k)): k=1 -> 9,
    k=2 -> 18 (min(18, 18)), k=3 -> 15; the best is 2:6 at 18. Co-located 2 per GPU -> 16: 18/16."""
    assert best_split(8, 9, 3) == (2, 18)
    r = predict(8, gen=9, train=3, colocated=2, efficiency=0.5)
    assert (r["gen_gpus"], r["async_tokens_per_s"], r["colocated_tokens_per_s"]) == (2, 9, 16)
    assert r["ratio"] == pytest.approx(9 / 16)


def test_rates_from_a_measurement():
    """2 GPUs, 1 generating: ideal min(1 x 100, 1 x 50) = 50; async measured 45 -> efficiency 0.9."""
    doc = {"settings": {"gpus": 2, "gen_gpus": 1},
           "parts": {"gen_alone": {"tokens_per_s": 100}, "train_alone": {"tokens_per_s": 50},
                     "colocated": {"trained_tokens_per_s": 60}, "async": {"trained_tokens_per_s": 45}}}
    assert from_measurement(doc) == {"gen": 100, "train": 50, "colocated": 30, "efficiency": 0.9}


def test_rates_from_one_shared_gpu():
    """One GPU shared by generator and trainer: its async rate (40 here) measures the two competing for
    the SMs, not separate pools, so efficiency is 1 (the bound); gen, train and co-located (1 rank) as measured.
    8 GPUs from it: min(100k, 50(8 - k)): k=2 -> min(200, 300) = 200, k=3 -> min(300, 250) = 250,
    k=4 -> min(400, 200) = 200; the best is 3:5 at 250, against co-located 8 x 30 = 240."""
    doc = {"settings": {"gpus": 1, "gen_gpus": 1},
           "parts": {"gen_alone": {"tokens_per_s": 100}, "train_alone": {"tokens_per_s": 50},
                     "colocated": {"trained_tokens_per_s": 30, "ranks": 1}, "async": {"trained_tokens_per_s": 40}}}
    rates = from_measurement(doc)
    assert rates == {"gen": 100, "train": 50, "colocated": 30, "efficiency": 1.0}
    r = predict(8, **rates)
    assert (r["gen_gpus"], r["async_tokens_per_s"], r["colocated_tokens_per_s"]) == (3, 250, 240)


def test_a_measurement_without_a_part_is_refused():
    doc = {"settings": {"gpus": 1, "gen_gpus": 1},
           "parts": {"gen_alone": {"tokens_per_s": 100}, "colocated": {"error": "timed out"}}}
    with pytest.raises(SystemExit, match="lacks train_alone, colocated.*--merge"):
        from_measurement(doc)
