"""The demo's paired bootstrap: the interval of a gain in exact match, both models scored on the same questions."""

import pytest

from lorakit.demo.exact_match import paired_bootstrap_interval


def test_the_interval_is_the_normal_one_for_a_known_spread_of_paired_differences():
    # 200 questions: 60 right only after, 20 right only before, 120 the same. Gain 0.2; the differences' standard
    # deviation is sqrt(80/200 - 0.2^2) = 0.6, so the standard error is 0.6 / sqrt(200) = 0.0424 and the 95%
    # interval about 0.2 -+ 1.96 x 0.0424 = [0.117, 0.283].
    before = [False] * 60 + [True] * 20 + [True] * 70 + [False] * 50
    after = [True] * 60 + [False] * 20 + [True] * 70 + [False] * 50
    low, high = paired_bootstrap_interval(before, after, resamples=20_000, seed=1)
    assert low == pytest.approx(0.117, abs=0.01) and high == pytest.approx(0.283, abs=0.01)


def test_pairs_that_agree_add_no_width_and_the_same_seed_gives_the_same_interval():
    same = [True, False] * 50
    assert paired_bootstrap_interval(same, same) == (0.0, 0.0)
    assert paired_bootstrap_interval([False] * 10, [True] * 10) == (1.0, 1.0)
    mixed = [True, False, False, True, False] * 20
    assert paired_bootstrap_interval(same, mixed, seed=3) == paired_bootstrap_interval(same, mixed, seed=3)


def test_unpaired_scores_are_refused():
    with pytest.raises(ValueError, match="paired scores of 3 and 2 questions"):
        paired_bootstrap_interval([True] * 3, [True] * 2)
