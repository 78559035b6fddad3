"""Optimal-matching loss: Hungarian assignment checked by brute force over all assignments."""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from loss_helpers import make_batch

from prvrlab.losses.optimal_matching import OptimalMatchingLoss, group_queries, matching_cosines
from prvrlab.models.base import ModelOutput, QueryEmbedding, VideoEmbedding
from prvrlab.registry import LOSSES
from device_under_test import DEVICE


def output(vectors: torch.Tensor, clips: torch.Tensor, branch: str = "clip") -> ModelOutput:
    return ModelOutput(scores={}, query=QueryEmbedding(vectors={branch: vectors}), video=VideoEmbedding(clip=clips))


def brute_force(vectors: torch.Tensor, clips: torch.Tensor, query_video: list[int]) -> float:
    """Mean (1 - cos) over the best one-to-one assignment of every video with >= 2 queries."""
    terms = []
    for v in range(clips.shape[0]):
        queries = [i for i, qv in enumerate(query_video) if qv == v]
        if len(queries) < 2:
            continue
        cos = F.cosine_similarity(vectors[queries][:, None], clips[v][None], dim=-1)  # (M, L)
        m, length = cos.shape
        best, best_pairs = -float("inf"), None
        if m <= length:  # each query a distinct clip
            candidates = ([(i, c) for i, c in enumerate(p)] for p in itertools.permutations(range(length), m))
        else:  # each clip a distinct query; the other queries stay unassigned
            candidates = ([(q, c) for c, q in enumerate(p)] for p in itertools.permutations(range(m), length))
        for pairs in candidates:
            total = sum(cos[i, c].item() for i, c in pairs)
            if total > best:
                best, best_pairs = total, pairs
        terms.extend(1 - cos[i, c].item() for i, c in best_pairs)
    return sum(terms) / len(terms)


@pytest.mark.parametrize("seed", range(4))
def test_matches_brute_force_over_all_assignments(seed):
    g = torch.Generator(DEVICE).manual_seed(seed)
    query_video = [0, 0, 0, 1, 2, 2, 3, 3]
    vectors = torch.randn(8, 4, generator=g)
    clips = torch.randn(4, 4, 4, generator=g)
    loss = OptimalMatchingLoss()(output(vectors, clips), make_batch(query_video, 4), epoch=0)
    assert loss.item() == pytest.approx(brute_force(vectors, clips, query_video), abs=1e-6)


def test_more_queries_than_clips_assigns_each_clip_once():
    g = torch.Generator(DEVICE).manual_seed(7)
    query_video = [0, 0, 0, 0, 1, 1]
    vectors = torch.randn(6, 3, generator=g)
    clips = torch.randn(2, 3, 3, generator=g)[:, :2]  # 2 clips per video, video 0 has 4 queries
    loss = OptimalMatchingLoss()(output(vectors, clips), make_batch(query_video, 2), epoch=0)
    assert loss.item() == pytest.approx(brute_force(vectors, clips, query_video), abs=1e-6)
    assigned, queries = matching_cosines(vectors, clips, torch.tensor(query_video))
    assert assigned.shape == (4,)  # 2 + 2 pairs
    assert set(queries.tolist()) >= {4, 5}


def test_interleaved_queries_and_gradients():
    torch.manual_seed(3)
    query_video = [1, 0, 1, 0, 2]  # not contiguous; video 2 has one query
    vectors = torch.randn(5, 4, requires_grad=True)
    clips = torch.randn(3, 5, 4, requires_grad=True)
    loss = OptimalMatchingLoss()(output(vectors, clips), make_batch(query_video, 3), epoch=0)
    assert loss.item() == pytest.approx(brute_force(vectors.detach(), clips.detach(), query_video), abs=1e-6)
    loss.backward()
    assert torch.all(vectors.grad[:4].abs().sum(dim=1) > 0)
    assert torch.all(vectors.grad[4] == 0)  # its video has a single query
    assert torch.all(clips.grad[2] == 0)
    assert int((clips.grad[0].abs().sum(dim=1) > 0).sum()) == 2  # two assigned clips of video 0


def test_no_video_with_two_queries_gives_grad_safe_zero():
    vectors = torch.randn(3, 4, requires_grad=True)
    clips = torch.randn(3, 5, 4, requires_grad=True)
    loss = OptimalMatchingLoss()(output(vectors, clips), make_batch([0, 1, 2], 3), epoch=0)
    assert loss.item() == 0.0
    loss.backward()
    assert torch.equal(vectors.grad, torch.zeros(3, 4)) and torch.equal(clips.grad, torch.zeros(3, 5, 4))
    empty = OptimalMatchingLoss()(output(torch.zeros(0, 4), torch.randn(1, 5, 4)), make_batch([], 1), epoch=0)
    assert empty.item() == 0.0


def test_identical_queries_still_get_distinct_clips():
    # the collapse the loss targets: three identical queries must be pushed to three different clips
    vectors = torch.tensor([[1.0, 0.0]] * 3)
    clips = torch.tensor([[[1.0, 0.0], [0.0, 1.0], [-1.0, 0.0], [0.6, 0.8]]])
    assigned, _ = matching_cosines(vectors, clips, torch.tensor([0, 0, 0]))
    assert sorted(assigned.tolist()) == pytest.approx([0.0, 0.6, 1.0])


def test_group_queries():
    counts, slot = group_queries(np.array([2, 0, 2, 2, 0]), 4)
    assert counts.tolist() == [2, 0, 3, 0]
    assert slot.tolist() == [0, 0, 1, 2, 1]


def test_registered_and_clear_errors():
    assert LOSSES.build("optimal_matching", branch="moment").branch == "moment"
    with pytest.raises(ValueError, match="branch"):
        OptimalMatchingLoss(branch="")
    with pytest.raises(ValueError, match="branch='frame'"):
        out = output(torch.randn(2, 3), torch.randn(1, 2, 3))
        OptimalMatchingLoss(branch="frame")(out, make_batch([0, 0], 1), epoch=0)
    with pytest.raises(ValueError, match="moment"):
        OptimalMatchingLoss()(output(torch.randn(2, 3), None), make_batch([0, 0], 1), epoch=0)



def test_the_loss_reads_the_batchs_host_copy_of_query_video():
    """On a GPU reading ``query_video`` back is a wait: the loss takes the copy the host built the batch from."""
    g = torch.Generator(DEVICE).manual_seed(11)
    query_video = [0, 0, 1, 1, 1, 2]
    vectors = torch.randn(6, 4, generator=g)
    clips = torch.randn(3, 4, 4, generator=g)
    plain = make_batch(query_video, 3)
    with_host = dataclasses.replace(plain, query_video_host=np.array(query_video))
    other = [2, 2, 1, 0, 0, 0]  # a different grouping, same shape: whichever the loss reads decides its value
    misled = dataclasses.replace(make_batch(other, 3), query_video_host=np.array(query_video))
    loss = OptimalMatchingLoss()
    expected = brute_force(vectors, clips, query_video)
    for batch in (plain, with_host, misled):
        assert loss(output(vectors, clips), batch, epoch=0).item() == pytest.approx(expected, abs=1e-6)
    assert brute_force(vectors, clips, other) != pytest.approx(expected, abs=1e-6)


@pytest.mark.parity
@pytest.mark.parametrize("seed", range(3))
def test_video_reduction_is_eq7_per_video_then_the_mean_over_videos(seed):
    """The paper's Eq. 7: per video 1/M_v times the sum over its assigned pairs (a video with more queries
    than clips still divides by M_v), then the mean over the videos with >= 2 queries."""
    g = torch.Generator(DEVICE).manual_seed(seed)
    query_video = [0, 0, 1, 2, 2, 2, 2, 2, 3, 3, 3]  # video 2: 5 queries, 4 clips
    vectors = torch.randn(11, 4, generator=g, requires_grad=True)
    clips = torch.randn(4, 4, 4, generator=g)
    loss = OptimalMatchingLoss(reduction="video")(output(vectors, clips), make_batch(query_video, 4), epoch=0)
    per_video = []
    for v in (0, 2, 3):
        alone = [qv if qv == v else -1 for qv in query_video]  # brute_force sees only video v's queries
        m = query_video.count(v)
        per_video.append(brute_force(vectors.detach(), clips, alone) * min(m, 4) / m)  # mean -> sum / M_v
    assert loss.item() == pytest.approx(sum(per_video) / 3, abs=1e-6)
    pooled = OptimalMatchingLoss()(output(vectors, clips), make_batch(query_video, 4), epoch=0)
    assert pooled.item() == pytest.approx(brute_force(vectors.detach(), clips, query_video), abs=1e-6)
    assert abs(pooled.item() - loss.item()) > 1e-4  # the two reductions weigh the videos differently
    loss.backward()
    assert torch.all(vectors.grad[2] == 0) and torch.isfinite(vectors.grad).all()
    with pytest.raises(ValueError, match="reduction"):
        OptimalMatchingLoss(reduction="mean")
