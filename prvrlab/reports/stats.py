"""Confidence for retrieval metrics from per-query ranks (seeded, deterministic).

Every query contributes a per-query "hit" vector ``100 * [rank <= K]`` for
K in (1, 5, 10, 100); R@K is its mean over queries and SumR the mean of the
row sums (the query's SumR contribution).  So:

- :func:`bootstrap_ci`: percentile bootstrap over queries (resample the
  queries with replacement ``n_boot`` times, one ``rng.integers(0, n, n)``
  draw per resample from ``numpy.random.default_rng(seed)``); the interval is
  the 2.5 / 97.5 percentiles (NumPy's default linear interpolation).
- :func:`paired_test`: a variant against the baseline on the SAME queries
  (joined on query id): the per-query differences of SumR contributions
  ``d_i``; observed delta = mean(d); two-sided sign-flip permutation test
  (each resample multiplies every ``d_i`` by an independent random sign, one
  ``rng.integers(0, 2, n)`` draw per resample), p = (1 + #{|mean(s d)| >=
  |mean(d)|}) / (1 + n_perm); plus a paired-bootstrap 95% interval of the delta.
  Identical ranks give d = 0 and p = 1 exactly.
- :func:`seed_test`: across seeds, the per-seed SumR differences
  (variant seed s minus baseline seed s), exact two-sided sign-flip test over
  all 2^S sign vectors (S <= 16; above, 2^16 sign vectors drawn with seed 0
  and p = (1 + #) / (1 + 2^16), as the query test) and a paired t-test
  (S >= 2, SciPy).  With two seeds the smallest attainable exact p is 0.5: say
  so rather than over-claim.
- :func:`holm`: Holm–Bonferroni adjusted p-values of a family of tests (a
  table's comparisons with its baseline): sorted ascending, the k-th smallest
  (k = 1..m) becomes max over j <= k of min(1, (m - j + 1) p_(j)); a test is
  significant at level alpha when its adjusted p is below alpha, which controls
  the chance of any false claim in the table at alpha (each row's own p would
  let one of 7 null variants look significant about 30% of the time).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from prvrlab.evaluation.metrics import DEFAULT_KS, METRIC_KEYS

ALPHA = 0.05
EXACT_SEEDS = 16  # the seed test enumerates every sign vector up to this many seeds, and draws 2^16 above
ADJUSTMENTS = ("holm", "none")  # how a table's p-values are adjusted for its number of comparisons
_TOL = 1e-9  # ties of resampled statistics with the observed one count as "as extreme"
_REL_STD = 1e-9  # per-seed differences whose std is below this times max(1, |mean|) are constant (float noise)


def hits(ranks: Sequence[int] | np.ndarray, ks: Sequence[int] = DEFAULT_KS) -> np.ndarray:
    """(n, len(ks)) per-query hit matrix in percent: ``100 * [rank <= K]``."""
    r = np.asarray(ranks, dtype=np.int64).reshape(-1)
    if r.size == 0:
        raise ValueError("no ranks given")
    if r.min() < 1:
        raise ValueError(f"ranks start at 1, got {int(r.min())}")
    return (r[:, None] <= np.asarray(ks, dtype=np.int64)[None, :]).astype(np.float64) * 100.0


def _metrics_of(h: np.ndarray) -> np.ndarray:
    """(.., len(ks)+1): the column means then their sum (SumR)."""
    means = h.mean(axis=-2)
    return np.concatenate([means, means.sum(axis=-1, keepdims=True)], axis=-1)


@dataclass(frozen=True)
class Interval:
    """A point estimate with a 95% interval."""

    value: float
    low: float
    high: float


def bootstrap_ci(
    ranks: Sequence[int] | np.ndarray | None = None,
    *,
    n_boot: int = 1000,
    seed: int = 0,
    level: float = 0.95,
    hit_matrix: np.ndarray | None = None,
) -> dict[str, Interval]:
    """Percentile bootstrap interval of R@1, R@5, R@10, R@100 and SumR over queries.

    Pass per-query ``ranks`` or a precomputed ``hit_matrix`` (n, 4) (e.g. hits
    averaged over seeds, to get the interval of a seed-averaged metric).
    """
    h = hits(ranks) if hit_matrix is None else np.asarray(hit_matrix, dtype=np.float64)
    if n_boot < 1:
        raise ValueError(f"n_boot must be >= 1, got {n_boot!r}")
    n = h.shape[0]
    rng = np.random.default_rng(seed)
    stats = np.empty((n_boot, h.shape[1] + 1), dtype=np.float64)
    for b in range(n_boot):
        idx = rng.integers(0, n, size=n)
        stats[b] = _metrics_of(h[idx])
    point = _metrics_of(h)
    tail = (1.0 - level) / 2.0 * 100.0
    low = np.percentile(stats, tail, axis=0)
    high = np.percentile(stats, 100.0 - tail, axis=0)
    return {m: Interval(float(point[i]), float(low[i]), float(high[i])) for i, m in enumerate(METRIC_KEYS)}


@dataclass(frozen=True)
class PairedResult:
    """Variant minus baseline over the same queries."""

    delta: float  # observed SumR difference
    low: float  # paired-bootstrap 95% interval of the difference
    high: float
    p_value: float  # two-sided sign-flip permutation test
    n_queries: int

    @property
    def significant(self) -> bool:
        return self.p_value < ALPHA


class NoSharedQueries(ValueError):
    """Two runs' ranks have no query id in common (evaluated on different collections)."""


def align(a_ids: Sequence[str], a_values: np.ndarray, b_ids: Sequence[str], b_values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Rows of ``a_values`` and ``b_values`` for the query ids both have, sorted by id (:class:`NoSharedQueries`
    when there is none)."""
    a_pos = {str(q): i for i, q in enumerate(a_ids)}
    b_pos = {str(q): i for i, q in enumerate(b_ids)}
    for ids, pos in ((a_ids, a_pos), (b_ids, b_pos)):
        if len(pos) != len(ids):
            raise ValueError(f"{len(ids) - len(pos)} query id(s) repeated among a run's ranks; each query is ranked once")
    common = sorted(set(a_pos) & set(b_pos))
    if not common:
        raise NoSharedQueries("the two runs share no query id")
    return (
        np.asarray(a_values)[[a_pos[q] for q in common]],
        np.asarray(b_values)[[b_pos[q] for q in common]],
    )


def paired_test(
    variant: np.ndarray,
    baseline: np.ndarray,
    *,
    n_perm: int = 1000,
    seed: int = 0,
) -> PairedResult:
    """Paired test of per-query SumR contributions (or hit matrices) of a variant vs the baseline.

    ``variant`` / ``baseline``: aligned per-query arrays, either SumR
    contributions (n,) or hit matrices (n, 4) (summed per row).
    """
    v = np.asarray(variant, dtype=np.float64)
    b = np.asarray(baseline, dtype=np.float64)
    if v.ndim == 2:
        v = v.sum(axis=1)
    if b.ndim == 2:
        b = b.sum(axis=1)
    if v.shape != b.shape or v.size == 0:
        raise ValueError(f"paired arrays must have the same non-empty shape, got {v.shape} and {b.shape}")
    if n_perm < 1:
        raise ValueError(f"n_perm must be >= 1, got {n_perm}")
    d = v - b
    n = d.size
    observed = float(d.mean())
    rng = np.random.default_rng(seed)
    extreme = 0
    for _ in range(n_perm):
        signs = rng.integers(0, 2, size=n) * 2 - 1
        if abs(float((signs * d).mean())) >= abs(observed) - _TOL:
            extreme += 1
    p = (1 + extreme) / (1 + n_perm)
    boot = np.empty(n_perm, dtype=np.float64)
    for i in range(n_perm):
        boot[i] = d[rng.integers(0, n, size=n)].mean()
    low, high = np.percentile(boot, [2.5, 97.5])
    return PairedResult(observed, float(low), float(high), float(min(1.0, p)), n)


@dataclass(frozen=True)
class SeedResult:
    """Variant minus baseline over paired seeds."""

    deltas: tuple[float, ...]
    p_exact: float  # exact two-sided sign-flip test over 2^S sign vectors (nan when S < 1)
    p_ttest: float  # paired t-test (nan when S < 2 or no variance)
    resamples: int = 0  # sign vectors drawn when S > EXACT_SEEDS (p_exact is then a sampled p); 0: all enumerated

    @property
    def n(self) -> int:
        return len(self.deltas)

    @property
    def min_p(self) -> float:
        """The smallest p the sign-flip test can give with this many seeds (or resamples)."""
        if self.resamples:
            return 1.0 / (1 + self.resamples)
        return 2.0 / 2**self.n if self.n else float("nan")


def seed_test(variant: Sequence[float], baseline: Sequence[float]) -> SeedResult:
    """Paired test over seeds: ``variant[s]`` and ``baseline[s]`` are SumR of the same seed.

    Differences that are constant up to float noise have no variance: no t-test (p 1 when they are all 0)."""
    v = np.asarray(variant, dtype=np.float64)
    b = np.asarray(baseline, dtype=np.float64)
    if v.shape != b.shape:
        raise ValueError(f"seed arrays differ in length: {v.shape} vs {b.shape}")
    d = v - b
    s = d.size
    if s == 0:
        return SeedResult((), float("nan"), float("nan"))
    observed = abs(float(d.mean()))
    resamples = 0
    if s <= EXACT_SEEDS:  # every sign vector: row k flips the seeds whose bit is set in k
        flips = (np.arange(2**s)[:, None] >> np.arange(s)) & 1  # (2^S, S)
    else:
        resamples = 2**EXACT_SEEDS
        flips = np.random.default_rng(0).integers(0, 2, (resamples, s))  # (R, S)
    means = np.abs((1.0 - 2.0 * flips) @ d) / s  # (2^S,) or (R,)
    count = int(np.count_nonzero(means >= observed - _TOL))
    p_exact = (1 + count) / (1 + resamples) if resamples else count / len(means)
    p_t = float("nan")
    if s >= 2 and float(np.std(d)) > _REL_STD * max(1.0, observed):
        from scipy import stats

        p_t = float(stats.ttest_rel(v, b).pvalue)
    elif s >= 2 and observed <= _TOL:
        p_t = 1.0
    return SeedResult(tuple(float(x) for x in d), float(p_exact), p_t if not math.isnan(p_t) else float("nan"), resamples)


def holm(p_values: Sequence[float]) -> list[float]:
    """Holm–Bonferroni adjusted p-values, in the order given (NaN: not tested, stays NaN and is not counted)."""
    p = [float(x) for x in p_values]
    tested = sorted((i for i, x in enumerate(p) if not math.isnan(x)), key=lambda i: p[i])
    m = len(tested)
    adjusted = [float("nan")] * len(p)
    running = 0.0
    for k, i in enumerate(tested):
        running = max(running, min(1.0, (m - k) * p[i]))
        adjusted[i] = running
    return adjusted


def adjust(p_values: Sequence[float], method: str) -> list[float]:
    """``p_values`` adjusted by ``method`` (one of :data:`ADJUSTMENTS`; ``none`` returns them unchanged)."""
    if method == "holm":
        return holm(p_values)
    if method == "none":
        return [float(x) for x in p_values]
    raise ValueError(f"unknown p-value adjustment {method!r}; use one of {', '.join(ADJUSTMENTS)}")


def histogram_quantile(edges: Sequence[float], counts: Sequence[float], q: float) -> float:
    """The ``q``-quantile of binned values: linear within the bin where the cumulative count reaches q * n
    (values assumed uniform inside a bin); NaN for an empty histogram."""
    total = float(sum(counts))
    if total <= 0:
        return float("nan")
    target, seen = q * total, 0.0
    for i, c in enumerate(counts):
        if c > 0 and seen + c >= target:
            return float(edges[i] + (edges[i + 1] - edges[i]) * (target - seen) / c)
        seen += c
    return float(edges[-1])
