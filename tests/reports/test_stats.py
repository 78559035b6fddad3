"""Statistics against independent computations on known inputs."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from scipy import stats as sps

from prvrlab.evaluation.metrics import METRIC_KEYS
from prvrlab.reports import stats


def _recall(r: np.ndarray) -> list[float]:
    vals = [float(np.mean(r <= k) * 100.0) for k in (1, 5, 10, 100)]
    return vals + [sum(vals)]


def test_bootstrap_ci_matches_a_numpy_loop_with_the_same_seed():
    ranks = np.random.default_rng(3).integers(1, 300, size=157)
    got = stats.bootstrap_ci(ranks, n_boot=300, seed=11)
    rng = np.random.default_rng(11)
    boot = []
    for _ in range(300):
        boot.append(_recall(ranks[rng.integers(0, ranks.size, size=ranks.size)]))
    boot = np.asarray(boot)
    point = _recall(ranks)
    for i, m in enumerate(METRIC_KEYS):
        assert got[m].value == pytest.approx(point[i], abs=1e-9)
        assert got[m].low == pytest.approx(np.percentile(boot[:, i], 2.5), abs=1e-9)
        assert got[m].high == pytest.approx(np.percentile(boot[:, i], 97.5), abs=1e-9)
        assert got[m].low <= got[m].value <= got[m].high
    again = stats.bootstrap_ci(ranks, n_boot=300, seed=11)
    assert again == got


def test_paired_identical_ranks_give_p_one_and_not_significant():
    ranks = np.random.default_rng(0).integers(1, 50, size=80)
    res = stats.paired_test(stats.hits(ranks), stats.hits(ranks), n_perm=200, seed=0)
    assert res.delta == 0.0 and res.p_value == 1.0 and not res.significant
    assert res.low == 0.0 and res.high == 0.0


def test_paired_clearly_better_is_significant_and_matches_a_loop():
    rng = np.random.default_rng(1)
    base = rng.integers(20, 200, size=120)
    better = np.maximum(1, base // 20)  # every query moves near the top
    res = stats.paired_test(stats.hits(better), stats.hits(base), n_perm=300, seed=5)
    assert res.significant and res.p_value == pytest.approx(1 / 301)
    d = stats.hits(better).sum(1) - stats.hits(base).sum(1)
    assert res.delta == pytest.approx(d.mean())
    # independent sign-flip loop with the same generator stream
    g = np.random.default_rng(5)
    count = sum(abs((( g.integers(0, 2, size=d.size) * 2 - 1) * d).mean()) >= abs(d.mean()) - 1e-9 for _ in range(300))
    assert res.p_value == pytest.approx((1 + count) / 301)


def test_seed_test_exact_enumeration_and_ttest():
    v, b = [10.0, 12.0, 13.5], [9.0, 10.0, 10.5]
    res = stats.seed_test(v, b)
    d = np.subtract(v, b)
    hits = sum(abs((np.asarray(s) * d).mean()) >= abs(d.mean()) - 1e-12 for s in itertools.product((1, -1), repeat=3))
    assert res.p_exact == pytest.approx(hits / 8) == pytest.approx(0.25)
    assert res.p_ttest == pytest.approx(sps.ttest_rel(v, b).pvalue)
    same = stats.seed_test([5.0, 6.0], [5.0, 6.0])
    assert same.p_exact == 1.0 and same.p_ttest == 1.0 and same.min_p == 0.5


def test_the_seed_test_enumerates_up_to_16_seeds_and_draws_sign_vectors_above():
    """An ablation may run any number of seeds: 17 and more get a sampled sign-flip p, not an error."""
    rng = np.random.default_rng(3)
    b = rng.normal(180.0, 2.0, size=17)
    v = b + rng.normal(0.4, 1.0, size=17)
    d = v - b
    many = stats.seed_test(v, b)
    flips = np.random.default_rng(0).integers(0, 2, (2**16, 17))  # the documented draw: seed 0, 2^16 vectors
    hits = np.count_nonzero(np.abs(((1 - 2 * flips) * d).mean(axis=1)) >= abs(d.mean()) - 1e-9)
    assert many.resamples == 2**16 and many.p_exact == pytest.approx((1 + hits) / (1 + 2**16))
    assert many.min_p == pytest.approx(1 / (1 + 2**16))
    assert many.p_ttest == pytest.approx(sps.ttest_rel(v, b).pvalue)
    v16, b16 = v[:16], b[:16]  # 16 seeds: every one of the 2^16 sign vectors, by hand
    d16 = v16 - b16
    signs = 1 - 2 * ((np.arange(2**16)[:, None] >> np.arange(16)) & 1)
    exact = np.count_nonzero(np.abs((signs * d16).mean(axis=1)) >= abs(d16.mean()) - 1e-9) / 2**16
    got = stats.seed_test(v16, b16)
    assert got.resamples == 0 and got.p_exact == pytest.approx(exact) and got.min_p == 2 / 2**16
    assert stats.seed_test([1.0] * 20, [1.0] * 20).p_exact == 1.0  # identical: every vector is as extreme


def test_holm_on_a_worked_example():
    # sorted: 0.005 x 4 = 0.02, 0.01 x 3 = 0.03, 0.03 x 2 = 0.06, 0.04 x 1 = 0.04 -> raised to 0.06 (monotone)
    got = stats.holm([0.01, 0.04, 0.03, 0.005])
    assert got == pytest.approx([0.03, 0.06, 0.06, 0.02])
    assert stats.holm([0.5, float("nan"), 0.4]) == pytest.approx([0.8, float("nan"), 0.8], nan_ok=True)  # m = 2
    assert stats.holm([0.9, 0.8]) == [1.0, 1.0] and stats.holm([]) == []
    assert stats.adjust([0.01, 0.04], "none") == [0.01, 0.04]
    with pytest.raises(ValueError, match="unknown p-value adjustment 'bh'; use one of holm, none"):
        stats.adjust([0.1], "bh")


@pytest.mark.parametrize("seed", range(5))
def test_holm_rejects_what_the_step_down_procedure_rejects(seed):
    """Holm's procedure as written: sort ascending, reject H_(1), H_(2), ... while p_(k) <= alpha / (m - k + 1)."""
    rng = np.random.default_rng(seed)
    p = rng.uniform(0, 0.1, size=8) ** rng.uniform(1, 3)
    adjusted = stats.holm(p)
    for alpha in (0.01, 0.02, 0.05, 0.1):
        rejected = set()
        for k, i in enumerate(np.argsort(p, kind="stable")):
            if p[i] > alpha / (len(p) - k):
                break
            rejected.add(int(i))
        assert {i for i, a in enumerate(adjusted) if a <= alpha} == rejected
    assert all(a >= x for a, x in zip(adjusted, p))  # never below the raw p


def test_seed_differences_constant_up_to_float_noise_get_no_t_test():
    v, b = [189.3, 190.3, 188.7], [189.2, 190.2, 188.6]  # every difference is 0.1, but not bit for bit
    d = np.subtract(v, b)
    assert 0 < np.std(d) < 1e-12
    res = stats.seed_test(v, b)
    assert np.isnan(res.p_ttest) and res.p_exact == pytest.approx(2 / 8)
    assert np.isnan(stats.seed_test([1.5, 2.5], [1.0, 2.0]).p_ttest)  # exactly constant: the same verdict
    small = stats.seed_test([10.0, 10.2 + 1e-6, 9.9], [9.9, 10.1, 9.8])  # a real (small) spread keeps its test
    assert small.p_ttest == pytest.approx(sps.ttest_rel([10.0, 10.2 + 1e-6, 9.9], [9.9, 10.1, 9.8]).pvalue)


def test_hits_align_and_the_query_test_refuse_what_has_no_meaning():
    """A rank below 1 would count as a hit at every K; a repeated query id would be silently collapsed; no
    permutation gives no p-value."""
    with pytest.raises(ValueError, match="ranks start at 1"):
        stats.hits([1, 0, 3])
    with pytest.raises(ValueError, match="repeated"):
        stats.align(["q1", "q1"], np.zeros(2), ["q1"], np.zeros(1))
    with pytest.raises(ValueError, match="n_perm must be >= 1"):
        stats.paired_test(np.ones(3), np.zeros(3), n_perm=0)
