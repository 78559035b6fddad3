"""VideoBatchSampler: the DDP contract."""

from __future__ import annotations

import math

import pytest

from prvrlab.data.dataset import VideoBatchSampler


def _epoch(n, bs, world, *, seed=0, epoch=0, shuffle=True, drop_last=False):
    out = []
    for rank in range(world):
        s = VideoBatchSampler(n, bs, shuffle=shuffle, seed=seed, rank=rank, world_size=world, drop_last=drop_last)
        s.set_epoch(epoch)
        out.append(list(s))
        assert len(s) == len(out[-1])
    return out


@pytest.mark.parametrize("n,bs,world", [(10, 3, 1), (10, 3, 2), (12, 2, 3), (100, 7, 4), (5, 8, 2), (3, 1, 4), (64, 8, 8)])
def test_ranks_same_count_cover_everything(n, bs, world):
    per_rank = _epoch(n, bs, world)
    counts = {len(b) for b in per_rank}
    assert len(counts) == 1 and counts.pop() == math.ceil(n / (bs * world))
    flat = [i for batches in per_rank for b in batches for i in b]
    assert set(flat) == set(range(n))  # the union covers the epoch
    assert len(flat) - n < world  # at most world - 1 wrapped duplicates
    for batches in per_rank:
        for b in batches:
            assert len(b) == len(set(b)) and 1 <= len(b) <= bs
    for step in range(len(per_rank[0])):
        sizes = {len(per_rank[r][step]) for r in range(world)}
        assert len(sizes) == 1  # equal shares at every step


@pytest.mark.parametrize("n,bs,world", [(12, 3, 2), (24, 2, 4), (9, 3, 3)])
def test_ranks_disjoint_without_padding(n, bs, world):
    per_rank = _epoch(n, bs, world)
    sets = [set(i for b in batches for i in b) for batches in per_rank]
    for r in range(world):
        for q in range(r + 1, world):
            assert not sets[r] & sets[q]
    assert sum(len(s) for s in sets) == n


def test_step_union_equals_single_process_batch():
    n, bs, world = 50, 4, 3
    single = _epoch(n, bs * world, 1, seed=5, epoch=2)[0]
    per_rank = _epoch(n, bs, world, seed=5, epoch=2)
    for step in range(len(single) - 1):  # full steps
        assert sum((per_rank[r][step] for r in range(world)), []) == single[step]


def test_deterministic_per_seed_and_epoch():
    a = _epoch(40, 4, 2, seed=1, epoch=3)
    assert a == _epoch(40, 4, 2, seed=1, epoch=3)
    assert a != _epoch(40, 4, 2, seed=1, epoch=4)
    assert a != _epoch(40, 4, 2, seed=2, epoch=3)


def test_no_shuffle_and_drop_last():
    assert _epoch(7, 3, 1, shuffle=False)[0] == [[0, 1, 2], [3, 4, 5], [6]]
    assert _epoch(7, 3, 1, shuffle=False, drop_last=True)[0] == [[0, 1, 2], [3, 4, 5]]
    assert _epoch(7, 2, 2, shuffle=False) == [[[0, 1], [4, 5]], [[2, 3], [6, 0]]]  # last step wraps
    assert _epoch(7, 2, 2, shuffle=False, drop_last=True) == [[[0, 1]], [[2, 3]]]


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(num_videos=0, batch_size=2), "num_videos"),
        (dict(num_videos=4, batch_size=0), "batch_size"),
        (dict(num_videos=4, batch_size=2, rank=2, world_size=2), "rank=2"),
        (dict(num_videos=4, batch_size=2, seed=-1), "seed"),
        (dict(num_videos=3, batch_size=2, world_size=2, drop_last=True), "no batch"),
    ],
)
def test_invalid_arguments(kwargs, match):
    kwargs = {"shuffle": True, "seed": 0, **kwargs}
    with pytest.raises(ValueError, match=match):
        VideoBatchSampler(kwargs.pop("num_videos"), kwargs.pop("batch_size"), **kwargs)


@pytest.mark.parametrize("n,bs,world", [(10, 3, 2), (100, 7, 4), (5, 8, 2), (3, 1, 4)])
def test_global_batches_are_every_rank_s_share_of_each_step(n, bs, world):
    """Every rank knows each step's whole batch (the short last step with its wrapped videos included)."""
    per_rank = _epoch(n, bs, world, seed=3, epoch=1)
    for rank in range(world):
        s = VideoBatchSampler(n, bs, shuffle=True, seed=3, rank=rank, world_size=world)
        s.set_epoch(1)
        steps = [chunk.tolist() for chunk in s.global_batches()]
        assert steps == [sum((per_rank[r][k] for r in range(world)), []) for k in range(len(per_rank[0]))]
