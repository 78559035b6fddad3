"""Which epochs deal a video twice within one global batch (a negative of its own queries under a global batch)."""

from __future__ import annotations

import pytest

from prvrlab.data.dataset import VideoBatchSampler


@pytest.mark.parametrize("n,bs,world", [(10, 3, 2), (5, 8, 2), (6, 8, 2), (5, 8, 3), (3, 1, 4), (95, 64, 2), (97, 16, 2),
                                        (7, 2, 2), (1, 4, 1)])
def test_repeats_within_step_counts_what_the_steps_deal_twice(n, bs, world):
    sampler = VideoBatchSampler(n, bs, shuffle=True, seed=1, rank=0, world_size=world)
    for epoch in range(3):
        sampler.set_epoch(epoch)
        within = [len(step) - len(set(step.tolist())) for step in sampler.global_batches()]
        assert max(within) == sampler.repeats_within_step()
    single_short = n < bs * world and n % world != 0
    assert (sampler.repeats_within_step() > 0) == single_short
