"""Tests of prvrlab.evaluation (metrics and retrieval) with tiny fake models and fake batches."""

from __future__ import annotations

import math
import sys
import types

import numpy as np
import pyarrow as pa
import pytest
import torch
from torch import nn

from prvrlab.models.base import BranchScores, QueryEmbedding, RetrievalModel, VideoEmbedding
from prvrlab.evaluation import metrics as evm
from prvrlab.evaluation import retrieval as ev
from prvrlab.platform.config import EvalConfig
from device_under_test import DEVICE

torch.set_num_threads(1)


# ---------------------------------------------------------------- fake models


class MatrixModel(RetrievalModel):
    """Scores looked up in fixed per-branch (Nq, Nv) matrices by row ids.

    Video / query "embeddings" are just their ids, so ``fuse(score(...))`` of
    the full sets equals ``weights["a"] * A + weights["b"] * B``.
    """

    def __init__(self, a: torch.Tensor, b: torch.Tensor, weights=(1.0, 0.5)):
        super().__init__()
        self.a, self.b = a, b
        self.score_weights = {"a": weights[0], "b": weights[1]}
        self.score_rows: list[int] = []

    def score(self, query, video, *, with_logits=False):
        qi, vi = query.extra["id"], video.extra["id"]
        self.score_rows.append(int(qi.shape[0]))
        return {
            "a": BranchScores(sim=self.a[qi][:, vi]),
            "b": BranchScores(sim=self.b[qi][:, vi]),
        }


def query_ids_emb(n: int) -> QueryEmbedding:
    return QueryEmbedding(extra={"id": torch.arange(n)})


def video_ids_emb(n: int) -> VideoEmbedding:
    return VideoEmbedding(extra={"id": torch.arange(n)})


class VectorModel(RetrievalModel):
    """Encoders with controllable outputs; records how it is called.

    A video's embedding: ``clip`` = its clips passed through ``proj`` (a
    Linear, so autocast really changes the dtype), ``frame`` = its frames,
    ``frame_mask`` = its mask.  A query's vector = its first token.  Score =
    dot product of the query vector with the video's first clip.
    """

    def __init__(self, dim: int):
        super().__init__()
        self.proj = nn.Linear(dim, dim, bias=False)
        with torch.no_grad():
            self.proj.weight.copy_(torch.eye(dim))
        self.score_weights = {"clip": 1.0}
        self.video_calls = 0
        self.videos_seen: list[float] = []
        self.observed: list[tuple[bool, bool]] = []  # (training, inference_mode) per call

    def encode_videos(self, clips, frames, frame_mask):
        self.video_calls += 1
        self.videos_seen.extend(clips[:, 0, 0].tolist())
        self.observed.append((self.training, torch.is_inference_mode_enabled()))
        clip = self.proj(clips)
        self.clip_dtype = clip.dtype
        return VideoEmbedding(clip=clip, frame=frames, frame_mask=frame_mask)

    def encode_queries(self, queries, query_mask):
        self.observed.append((self.training, torch.is_inference_mode_enabled()))
        return QueryEmbedding(vectors={"clip": self.proj(queries[:, 0])}, tokens=queries, token_mask=query_mask)

    def score(self, query, video, *, with_logits=False):
        return {"clip": BranchScores(sim=query.vectors["clip"] @ video.clip[:, 0].T)}


def brute_force_ranks(scores: torch.Tensor, query_video: np.ndarray) -> np.ndarray:
    """Explicit loops: 1 + #strictly higher + #other videos with an equal score."""
    s = scores.tolist()
    out = []
    for q, row in enumerate(s):
        gt_index = int(query_video[q])
        gt = row[gt_index]
        higher = sum(1 for v, x in enumerate(row) if x > gt)
        equal_other = sum(1 for v, x in enumerate(row) if x == gt and v != gt_index)
        out.append(1 + higher + equal_other)
    return np.array(out, dtype=np.int64)


# ---------------------------------------------------------------- ranks


@pytest.mark.parametrize("chunk", [1, 3, 7, 100])
def test_compute_ranks_matches_brute_force(chunk):
    gen = torch.Generator(DEVICE).manual_seed(0)
    nq, nv = 17, 9
    # small integers: plenty of exact ties, and 1.0*a + 0.5*b is exact in fp32
    a = torch.randint(0, 4, (nq, nv), generator=gen).float()
    b = torch.randint(0, 3, (nq, nv), generator=gen).float()
    model = MatrixModel(a, b)
    query_video = torch.randint(0, nv, (nq,), generator=gen).cpu().numpy()
    expected = brute_force_ranks(1.0 * a + 0.5 * b, query_video)

    ranks = ev.compute_ranks(model, query_ids_emb(nq), video_ids_emb(nv), query_video, chunk=chunk)

    assert ranks.dtype == np.int64 and ranks.shape == (nq,)
    np.testing.assert_array_equal(ranks, expected)
    # memory bound: never more than `chunk` queries scored at once
    assert max(model.score_rows) == min(chunk, nq)
    assert sum(model.score_rows) == nq


class IndexingModel(MatrixModel):
    """A MatrixModel whose index adds a marker; its scores read the marker, counting the chunks that do."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.indexed = 0
        self.scored_indexed = 0

    def index_videos(self, video):
        self.indexed += 1
        return VideoEmbedding(extra={**video.extra, "marker": torch.ones(video.extra["id"].shape[0])})

    def score(self, query, video, *, with_logits=False):
        self.scored_indexed += int("marker" in video.extra)
        return super().score(query, video, with_logits=with_logits)


def test_compute_ranks_indexes_the_gallery_once_for_every_chunk():
    gen = torch.Generator(DEVICE).manual_seed(2)
    nq, nv = 11, 6
    a, b = torch.randn(nq, nv, generator=gen), torch.randn(nq, nv, generator=gen)
    model = IndexingModel(a, b)
    query_video = torch.randint(0, nv, (nq,), generator=gen).cpu().numpy()
    ranks = ev.compute_ranks(model, query_ids_emb(nq), video_ids_emb(nv), query_video, chunk=4)
    assert model.indexed == 1 and model.scored_indexed == len(model.score_rows) == math.ceil(nq / 4)
    np.testing.assert_array_equal(ranks, brute_force_ranks(1.0 * a + 0.5 * b, query_video))


def test_compute_ranks_continuous_scores_and_tensor_query_video():
    gen = torch.Generator(DEVICE).manual_seed(1)
    nq, nv = 12, 30
    a, b = torch.randn(nq, nv, generator=gen), torch.randn(nq, nv, generator=gen)
    model = MatrixModel(a, b, weights=(0.7, 0.3))
    query_video = torch.randint(0, nv, (nq,), generator=gen)
    expected = brute_force_ranks(model.fuse({"a": BranchScores(a), "b": BranchScores(b)}), query_video.cpu().numpy())
    ranks = ev.compute_ranks(model, query_ids_emb(nq), video_ids_emb(nv), query_video, chunk=5)
    np.testing.assert_array_equal(ranks, expected)


def test_constant_scores_rank_last():
    nq, nv = 6, 11
    model = MatrixModel(torch.zeros(nq, nv), torch.zeros(nq, nv))
    query_video = np.arange(nq) % nv
    ranks = ev.compute_ranks(model, query_ids_emb(nq), video_ids_emb(nv), query_video, chunk=4)
    np.testing.assert_array_equal(ranks, np.full(nq, nv))
    metrics = evm.recall_at(ranks)
    assert metrics["r1"] == 0.0 and metrics["r5"] == 0.0 and metrics["r10"] == 0.0
    assert metrics["r100"] == 100.0  # K >= Nv


def test_nan_scores_never_help():
    a = torch.tensor([[float("nan"), 1.0, 0.0], [2.0, float("nan"), 1.0]])
    model = MatrixModel(a, torch.zeros_like(a))
    ranks = ev.compute_ranks(model, query_ids_emb(2), video_ids_emb(3), np.array([0, 2]), chunk=2)
    np.testing.assert_array_equal(ranks, [3, 2])


def test_compute_ranks_validates_inputs():
    model = MatrixModel(torch.zeros(2, 3), torch.zeros(2, 3))
    with pytest.raises(ValueError, match="chunk"):
        ev.compute_ranks(model, query_ids_emb(2), video_ids_emb(3), [0, 1], chunk=0)
    with pytest.raises(ValueError, match="query_video"):
        ev.compute_ranks(model, query_ids_emb(2), video_ids_emb(3), [0, 3], chunk=2)
    with pytest.raises(ValueError, match="query_video"):
        ev.compute_ranks(model, query_ids_emb(2), video_ids_emb(3), [0], chunk=2)


# ---------------------------------------------------------------- metrics


def test_recall_at_hand_made():
    metrics = evm.recall_at(np.array([1, 2, 6, 11, 101]))
    assert metrics == pytest.approx({"r1": 20.0, "r5": 40.0, "r10": 60.0, "r100": 80.0, "sumr": 200.0})
    assert list(metrics) == ["r1", "r5", "r10", "r100", "sumr"]
    assert all(isinstance(v, float) for v in metrics.values())
    with pytest.raises(ValueError):
        evm.recall_at(np.array([], dtype=np.int64))
    with pytest.raises(ValueError, match="1-based"):
        evm.recall_at(np.array([0, 1]))


def test_chance_recall():
    assert evm.chance_recall(50) == pytest.approx({"r1": 2.0, "r5": 10.0, "r10": 20.0, "r100": 100.0, "sumr": 132.0})
    assert evm.chance_recall(1000)["r100"] == pytest.approx(10.0)


def test_ratio_group_boundaries():
    labels = evm.ratio_groups([0.2, 0.2000001, 0.4, 1.0, 0.05, 0.41, 1.3, 0.0, -0.1, float("nan")])
    assert list(labels) == ["short", "medium", "medium", "long", "short", "long", "long", "", "", ""]
    # float32 0.2 is slightly above float64 0.2 but must stay short
    assert list(evm.ratio_groups(np.array([0.2, 0.4], dtype=np.float32))) == ["short", "medium"]


def test_recall_by_group():
    ranks = np.array([1, 20, 3, 200, 1])
    ratios = np.array([0.1, 0.15, 0.3, 0.9, -1.0])
    groups = evm.recall_by_group(ranks, ratios)
    assert set(groups) == {"short", "medium", "long"}
    assert groups["short"]["count"] == 2 and groups["short"]["r1"] == pytest.approx(50.0)
    assert groups["short"]["r100"] == pytest.approx(100.0)
    assert groups["medium"]["count"] == 1 and groups["medium"]["r5"] == pytest.approx(100.0)
    assert groups["long"]["count"] == 1 and groups["long"]["sumr"] == pytest.approx(0.0)
    empty = evm.recall_by_group(np.array([1]), np.array([0.1]))["long"]
    assert empty["count"] == 0 and math.isnan(empty["r1"])


# ---------------------------------------------------------------- parquet


def test_rank_table_parquet_round_trip(tmp_path):
    table = evm.rank_table(["q0", "q1", "q2"], ["v1", "v0", "v1"], np.array([3, 1, 7]), [0.1, 0.5, 0.25])
    assert table.column_names == ["query_id", "video_id", "rank", "ratio"]
    assert table.schema.field("rank").type == pa.int64()
    path = evm.save_ranks(tmp_path / "sub" / "ranks.parquet", table)
    loaded = evm.load_ranks(path)
    assert loaded.equals(table)
    assert loaded.column("rank").to_pylist() == [3, 1, 7]

    no_ratio = evm.rank_table(["q0"], ["v0"], [2])
    assert no_ratio.column_names == ["query_id", "video_id", "rank"]
    evm.save_ranks(tmp_path / "r2.parquet", no_ratio)
    assert evm.load_ranks(tmp_path / "r2.parquet").equals(no_ratio)
    with pytest.raises(ValueError):
        evm.rank_table(["q0", "q1"], ["v0"], [1, 2])


# ---------------------------------------------------------------- encoding


DIM = 4


def make_video_batches(frame_lengths, per_batch=2, seed=0):
    """Fake (ids, clips, frames, frame_mask) batches; video k's clips start with k."""
    gen = torch.Generator(DEVICE).manual_seed(seed)
    batches, k = [], 0
    for lf in frame_lengths:
        ids = [f"v{k + i}" for i in range(per_batch)]
        clips = torch.randn(per_batch, 3, DIM, generator=gen)
        clips[:, 0, 0] = torch.arange(k, k + per_batch, dtype=torch.float32)
        frames = torch.randn(per_batch, lf, DIM, generator=gen)
        mask = torch.ones(per_batch, lf, dtype=torch.bool)
        mask[0, -1] = False  # one padded frame inside the batch
        batches.append((ids, clips, frames, mask))
        k += per_batch
    return batches


def make_query_batches(token_lengths, per_batch=3, seed=1):
    gen = torch.Generator(DEVICE).manual_seed(seed)
    batches, k = [], 0
    for lq in token_lengths:
        ids = [f"q{k + i}" for i in range(per_batch)]
        batches.append((ids, torch.randn(per_batch, lq, DIM, generator=gen), torch.ones(per_batch, lq, dtype=torch.bool)))
        k += per_batch
    return batches


def test_encode_each_video_once_and_padding():
    model = VectorModel(DIM)
    model.train()
    vbatches = make_video_batches([3, 5, 2])
    qbatches = make_query_batches([4, 2])
    video, video_ids = ev.encode_videos(model, iter(vbatches), device=DEVICE)
    query, query_ids = ev.encode_queries(model, iter(qbatches), device=DEVICE)

    assert model.video_calls == 3
    assert sorted(model.videos_seen) == [float(i) for i in range(6)]  # each video exactly once
    assert video_ids == [v for ids, *_ in vbatches for v in ids] and query_ids == [q for ids, *_ in qbatches for q in ids]
    assert all(not training and inference for training, inference in model.observed)

    assert video.clip.shape == (6, 3, DIM)
    assert video.frame.shape == (6, 5, DIM) and video.frame_mask.shape == (6, 5)
    for b, (_, clips, frames, mask) in enumerate(vbatches):
        rows = slice(2 * b, 2 * b + 2)
        lf = frames.shape[1]
        torch.testing.assert_close(video.clip[rows], clips)
        torch.testing.assert_close(video.frame[rows, :lf], frames)
        assert torch.equal(video.frame_mask[rows, :lf], mask)
        assert not video.frame_mask[rows, lf:].any()
        assert torch.all(video.frame[rows, lf:] == 0)
    assert query.vectors["clip"].shape == (6, DIM)
    assert query.tokens.shape == (6, 4, DIM) and not query.token_mask[3:, 2:].any()


def test_encode_bf16_autocast_returns_float32():
    model = VectorModel(DIM)
    video, _ = ev.encode_videos(model, make_video_batches([3, 4]), device=DEVICE, amp_dtype=torch.bfloat16)
    query, _ = ev.encode_queries(model, make_query_batches([2]), device=DEVICE, amp_dtype="bf16")
    assert model.clip_dtype == torch.bfloat16  # autocast was really on inside the encoder
    assert video.clip.dtype == torch.float32 and video.frame_mask.dtype == torch.bool
    assert query.vectors["clip"].dtype == torch.float32
    assert ev.resolve_amp_dtype("bf16") is torch.bfloat16 and ev.resolve_amp_dtype("none") is None
    with pytest.raises(ValueError):
        ev.resolve_amp_dtype("int8")


def test_encode_rejects_duplicate_and_empty():
    model = VectorModel(DIM)
    batches = make_video_batches([3, 3])
    dup = [batches[0], batches[0]]
    with pytest.raises(ValueError, match="more than once"):
        ev.encode_videos(model, dup, device=DEVICE)
    with pytest.raises(ValueError, match="no video batch"):
        ev.encode_videos(model, [], device=DEVICE)


def test_encode_videos_into_an_announced_gallery_equals_the_concatenation(monkeypatch):
    import prvrlab.models.base as base

    concatenated: list[int] = []
    plain_cat = base._cat
    monkeypatch.setattr(base, "_cat", lambda parts: concatenated.append(len(parts)) or plain_cat(parts))
    model = VectorModel(DIM)
    for lengths, cats in (([5, 3, 2], []), ([3, 5, 2], [3])):  # longest first: written in place; else the rows so far + 2 parts
        batches = make_video_batches(lengths)
        plain, plain_ids = ev.encode_videos(model, batches, device=DEVICE, amp_dtype=torch.bfloat16)
        concatenated.clear()
        video, ids = ev.encode_videos(model, batches, device=DEVICE, amp_dtype=torch.bfloat16, rows=6)
        assert concatenated == cats and ids == plain_ids
        for name in ("clip", "frame", "frame_mask"):
            assert torch.equal(getattr(video, name), getattr(plain, name)), name
    batches = make_video_batches([3, 3])
    with pytest.raises(ValueError, match="more than once"):  # more rows than announced
        ev.encode_videos(model, [batches[0], batches[0], batches[1]], device=DEVICE, rows=4)


# ---------------------------------------------------------------- end to end


def toy_split(num_videos=5, per_video=2, seed=0):
    """Videos whose first clip is a one-hot; each query is (a noisy version of) its video's."""
    gen = torch.Generator(DEVICE).manual_seed(seed)
    video_ids = [f"vid{i}" for i in range(num_videos)]
    clips = torch.zeros(num_videos, 2, num_videos)
    clips[torch.arange(num_videos), 0, torch.arange(num_videos)] = 1.0
    frames = torch.randn(num_videos, 3, num_videos, generator=gen)
    mask = torch.ones(num_videos, 3, dtype=torch.bool)
    query_video = np.repeat(np.arange(num_videos), per_video)
    query_ids = [f"vid{v}#{j}" for v in range(num_videos) for j in range(per_video)]
    queries = torch.zeros(len(query_ids), 2, num_videos)
    queries[torch.arange(len(query_ids)), 0, torch.as_tensor(query_video)] = 1.0
    ratios = np.linspace(0.05, 0.95, len(query_ids))
    return video_ids, clips, frames, mask, query_ids, queries, query_video, ratios


def test_evaluate_batches_out_of_order_yield():
    video_ids, clips, frames, mask, query_ids, queries, query_video, ratios = toy_split()
    # make the last query point to the wrong video: its rank must be > 1
    queries[-1, 0] = 0.0
    queries[-1, 0, 0] = 1.0
    vorder = [3, 1, 4, 0, 2]  # videos yielded in a different order than the split
    vbatches = [([video_ids[i] for i in vorder[:2]], clips[vorder[:2]], frames[vorder[:2]], mask[vorder[:2]]),
                ([video_ids[i] for i in vorder[2:]], clips[vorder[2:]], frames[vorder[2:]], mask[vorder[2:]])]
    qorder = list(reversed(range(len(query_ids))))
    qbatches = [([query_ids[i] for i in qorder], queries[qorder], torch.ones(len(qorder), 2, dtype=torch.bool))]

    model = VectorModel(5)
    model.train()
    result = ev.evaluate_batches(
        model, vbatches, qbatches, video_ids=video_ids, query_ids=query_ids,
        query_video=query_video, ratios=ratios, chunk=3, device=DEVICE,
    )
    assert model.training  # previous mode restored
    assert result.num_videos == 5 and result.num_queries == 10
    table = result.table.to_pydict()
    assert table["query_id"] == [query_ids[i] for i in qorder]
    assert table["video_id"] == [video_ids[query_video[i]] for i in qorder]
    assert table["ratio"] == pytest.approx([ratios[i] for i in qorder])
    expected = {q: 1 for q in query_ids}
    expected[query_ids[-1]] = 5  # its video ties with 3 others at 0, below vid0 at 1
    assert dict(zip(table["query_id"], table["rank"])) == expected
    assert result.metrics["r1"] == pytest.approx(90.0)
    assert sum(g["count"] for g in result.by_group.values()) == 10
    assert set(result.timings) >= {"encode_videos", "encode_queries", "score", "total"}
    flat = result.flat("val/")
    assert flat["val/sumr"] == result.metrics["sumr"] and "val/short/count" in flat


def test_evaluate_batches_rejects_unknown_video():
    video_ids, clips, frames, mask, query_ids, queries, query_video, _ = toy_split()
    vbatches = [(["other"] + video_ids[1:], clips, frames, mask)]
    qbatches = [(query_ids, queries, torch.ones(len(query_ids), 2, dtype=torch.bool))]
    with pytest.raises(ValueError, match="not in the split"):
        ev.evaluate_batches(VectorModel(5), vbatches, qbatches, video_ids=video_ids,
                            query_ids=query_ids, query_video=query_video, device=DEVICE)


def test_evaluate_with_fake_data_layer(monkeypatch):
    video_ids, clips, frames, mask, query_ids, queries, query_video, ratios = toy_split(num_videos=6, per_video=3)
    calls = {}

    class FakeCollection:
        def split(self, name):
            calls["split"] = name
            return types.SimpleNamespace(video_ids=video_ids, query_ids=query_ids,
                                         query_video=query_video, ratios=ratios)

    def video_batches(collection, split, batch_size, **shard):
        calls["video_batch_size"] = batch_size
        for s in range(0, len(video_ids), batch_size):
            yield video_ids[s:s + batch_size], clips[s:s + batch_size], frames[s:s + batch_size], mask[s:s + batch_size]

    def query_batches(collection, split, batch_size, **shard):
        calls["query_batch_size"] = batch_size
        for s in range(0, len(query_ids), batch_size):
            yield query_ids[s:s + batch_size], queries[s:s + batch_size], torch.ones(len(query_ids[s:s + batch_size]), 2, dtype=torch.bool)

    fake = types.ModuleType("prvrlab.data.dataset")
    fake.video_batches, fake.query_batches = video_batches, query_batches
    monkeypatch.setitem(sys.modules, "prvrlab.data.dataset", fake)

    model = VectorModel(6)
    cfg = EvalConfig(video_batch_size=4, query_batch_size=5, score_chunk=7)
    result = ev.evaluate(model, FakeCollection(), "val", cfg, device=DEVICE, amp_dtype="bf16")

    assert calls == {"split": "val", "video_batch_size": 4, "query_batch_size": 5}
    assert model.video_calls == 2
    np.testing.assert_array_equal(result.ranks, np.ones(18, dtype=np.int64))
    assert result.metrics == pytest.approx({"r1": 100.0, "r5": 100.0, "r10": 100.0, "r100": 100.0, "sumr": 400.0})
    assert result.by_group is not None and result.by_group["short"]["count"] > 0
    assert result.table.num_rows == 18 and result.seconds >= 0


def test_score_chunk_fits_the_memory_budget(monkeypatch):
    """Queries per scoring chunk: one float32 score per (query, clip or frame token of every video)
    within min(SCORE_BUDGET_BYTES, free memory / 8), at most the configured chunk, at least 1."""
    nv, lc, lf, d = 6, 4, 10, 3
    emb = VideoEmbedding(clip=torch.zeros(nv, lc, d), frame=torch.zeros(nv, lf, d),
                         frame_mask=torch.ones(nv, lf, dtype=torch.bool), extra={"id": torch.arange(nv)})
    per_query = 4 * nv * (lc + lf)  # bytes of one query's scores (the mask and the ids hold no scores)
    monkeypatch.setattr(ev, "_available_bytes", lambda: 1 << 40)
    monkeypatch.setattr(ev, "SCORE_BUDGET_BYTES", 5 * per_query + 7)
    assert ev.score_chunk(emb, 2048) == 5
    assert ev.score_chunk(emb, 3) == 3
    monkeypatch.setattr(ev, "_available_bytes", lambda: 8 * 2 * per_query)
    assert ev.score_chunk(emb, 2048) == 2
    monkeypatch.setattr(ev, "SCORE_BUDGET_BYTES", 1)
    assert ev.score_chunk(emb, 2048) == 1
    # a model that holds fewer values per query than one per token says so (score_elements)
    monkeypatch.setattr(ev, "_available_bytes", lambda: 1 << 40)
    monkeypatch.setattr(ev, "SCORE_BUDGET_BYTES", 5 * per_query + 7)
    assert ev.score_chunk(emb, 2048, elements=nv) == (5 * per_query + 7) // (4 * nv)


def record_chunks(monkeypatch) -> list[int]:
    """The ``chunk`` of every compute_ranks call that evaluation makes from now on (in call order)."""
    chunks: list[int] = []
    compute_ranks = ev.compute_ranks

    def recording(*args, chunk, **kwargs):
        chunks.append(chunk)
        return compute_ranks(*args, chunk=chunk, **kwargs)

    monkeypatch.setattr(ev, "compute_ranks", recording)
    return chunks


def test_evaluation_sizes_query_chunks_from_the_models_score_elements(monkeypatch):
    video_ids, clips, frames, mask, query_ids, queries, query_video, ratios = toy_split()
    qmask = torch.ones(len(query_ids), 2, dtype=torch.bool)
    model = VectorModel(5)
    tokens = clips.shape[0] * (clips.shape[1] + frames.shape[1])  # the default: one value per video token
    monkeypatch.setattr(ev, "_available_bytes", lambda: 1 << 40)
    monkeypatch.setattr(ev, "SCORE_BUDGET_BYTES", 4 * tokens * 3)  # 3 queries at a time by default
    chunks = record_chunks(monkeypatch)

    def run():
        return ev.evaluate_batches(
            model, [(video_ids, clips, frames, mask)], [(query_ids, queries, qmask)],
            video_ids=video_ids, query_ids=query_ids, query_video=query_video, chunk=2048, device=DEVICE,
        )

    default = run()
    model.score_elements = lambda video: tokens // 2  # half the default: twice the queries
    halved = run()
    assert chunks == [3, 6]
    np.testing.assert_array_equal(halved.ranks, default.ranks)


def test_evaluate_batches_ranks_do_not_depend_on_the_score_budget(monkeypatch):
    video_ids, clips, frames, mask, query_ids, queries, query_video, ratios = toy_split()
    qmask = torch.ones(len(query_ids), 2, dtype=torch.bool)

    def run():
        return ev.evaluate_batches(
            VectorModel(5), [(video_ids, clips, frames, mask)], [(query_ids, queries, qmask)],
            video_ids=video_ids, query_ids=query_ids, query_video=query_video, chunk=2048, device=DEVICE,
        )

    calls = record_chunks(monkeypatch)
    wide = run()
    monkeypatch.setattr(ev, "SCORE_BUDGET_BYTES", 1)
    narrow = run()
    assert calls[0] > 1 and calls[1] == 1
    np.testing.assert_array_equal(narrow.ranks, wide.ranks)


@pytest.mark.parametrize("size, budget, shape, configured, tvr", [
    ("video_batch_size", "ENCODE_BUDGET_BYTES", (160, 3072), 256, 17),  # TVR: 32 clips + 128 frames, 3,072-d
    ("query_batch_size", "QUERY_BUDGET_BYTES", (30, 768), 1024, 182),  # TVR: up to 30 words, 768-d
])
def test_batch_sizes_fit_the_memory_budget(monkeypatch, size, budget, shape, configured, tvr):
    """Videos (queries) per encoding batch: their float32 features within min(budget, free memory / 16),
    at most the configured batch, at least 1."""
    per_item = 4 * shape[0] * shape[1]
    fit = getattr(ev, size)
    monkeypatch.setattr(ev, "_available_bytes", lambda: 1 << 40)
    assert fit(configured, *shape) == tvr == getattr(ev, budget) // per_item
    monkeypatch.setattr(ev, budget, 10 * per_item + 5)
    assert fit(configured, *shape) == 10
    assert fit(7, *shape) == 7
    monkeypatch.setattr(ev, "_available_bytes", lambda: 16 * 3 * per_item)
    assert fit(configured, *shape) == 3
    monkeypatch.setattr(ev, budget, 0)
    assert fit(configured, *shape) == 1


@pytest.mark.parametrize("release", [False, True])
def test_memory_is_released_between_phases_only_when_asked(monkeypatch, release):
    """``release_memory`` (a process that only evaluates) gives malloc's free memory back before the
    encoded videos are concatenated, after the video and the query phase, after indexing the gallery
    and after every chunk of scored queries;
    training's evaluations (the default) never do, and the ranks do not change."""
    video_ids, clips, frames, mask, query_ids, queries, query_video, ratios = toy_split()
    phases: list[str] = []
    real_videos, real_queries = ev.encode_videos, ev.encode_queries
    monkeypatch.setattr(ev, "encode_videos", lambda *a, **k: phases.append("videos") or real_videos(*a, **k))
    monkeypatch.setattr(ev, "encode_queries", lambda *a, **k: phases.append("queries") or real_queries(*a, **k))
    monkeypatch.setattr(ev, "release_free_memory", lambda: phases.append("release") or True)
    result = ev.evaluate_batches(
        VectorModel(5), [(video_ids, clips, frames, mask)], [(query_ids, queries, torch.ones(len(query_ids), 2, dtype=torch.bool))],
        video_ids=video_ids, query_ids=query_ids, query_video=query_video, chunk=3, device=DEVICE,
        release_memory=release,
    )
    chunks = ["release"] * -(-len(query_ids) // 3)  # after every chunk of 3 scored queries
    assert phases == (["videos", "release", "release", "queries", "release", "release", *chunks] if release else ["videos", "queries"])
    assert result.metrics["r1"] == pytest.approx(100.0)


class HalfShare(VectorModel):
    def encode_budget_share(self) -> float:
        return 0.5


def test_video_batches_encoded_on_an_accelerator_use_its_budget(monkeypatch):
    """The host holds only the input batch when an accelerator encodes: min(DEVICE_ENCODE_BUDGET_BYTES,
    free / 16), not the CPU's smaller budget; ``evaluate`` passes the device's kind."""
    per_video = 4 * 160 * 3072
    monkeypatch.setattr(ev, "_available_bytes", lambda: 1 << 40)
    assert ev.DEVICE_ENCODE_BUDGET_BYTES > ev.ENCODE_BUDGET_BYTES
    assert ev.video_batch_size(256, 160, 3072, on_cpu=False) == ev.DEVICE_ENCODE_BUDGET_BYTES // per_video == 68
    assert ev.video_batch_size(256, 160, 3072) == ev.ENCODE_BUDGET_BYTES // per_video
    monkeypatch.setattr(ev, "_available_bytes", lambda: 16 * 5 * per_video)
    assert ev.video_batch_size(256, 160, 3072, on_cpu=False) == 5
    monkeypatch.setattr(ev, "_available_bytes", lambda: 1 << 40)
    assert ev.video_batch_size(256, 160, 3072, share=0.5) == ev.ENCODE_BUDGET_BYTES // 2 // per_video == 8  # v2's share
    assert ev.video_batch_size(256, 160, 3072, on_cpu=False, share=0.5) == 68  # the host holds only the batch

    import prvrlab.data.dataset as ds

    seen = []
    real = ev.video_batch_size
    monkeypatch.setattr(ev, "video_batch_size", lambda *a, **k: seen.append((k.get("on_cpu", True), k["share"])) or real(*a, **k))
    monkeypatch.setattr(ds, "video_batches", lambda *a, **k: iter(()))
    monkeypatch.setattr(ds, "query_batches", lambda *a, **k: iter(()))

    class Stop(Exception):
        pass

    def stop(*a, **k):
        raise Stop

    monkeypatch.setattr(ev, "evaluate_batches", stop)
    collection = types.SimpleNamespace(max_frames=128, num_clips=32, video_dim=3072, max_query_len=30, query_dim=768,
                                       split=lambda name: types.SimpleNamespace(video_ids=[], query_ids=[], query_video=[]))
    eval_cfg = types.SimpleNamespace(video_batch_size=256, query_batch_size=1024, score_chunk=2048)
    for device in ("cpu", "meta"):  # meta: a device that is not the CPU, on any machine
        with pytest.raises(Stop):
            ev.evaluate(HalfShare(DIM), collection, "val", eval_cfg, device=device)
    assert seen == [(True, 0.5), (False, 0.5)]  # the model's share, passed for the CPU budget


LAZY_TABLE = """
import sys
import numpy as np
import prvrlab.evaluation.retrieval as ev, prvrlab.platform.train.checkpoint_eval, prvrlab.platform.train.loop
assert "pyarrow" not in sys.modules, "imported with the evaluation"
result = ev.EvalResult(metrics={}, by_group=None, ranks=np.array([2, 1]), query_ids=["q1", "q0"],
                       query_video_ids=["v0", "v1"], ratios=np.array([0.1, 0.5]), num_queries=2, num_videos=2,
                       seconds=0.0)
assert "pyarrow" not in sys.modules, "imported by the result"
print(result.table.to_pydict(), "pyarrow" in sys.modules)
"""


def test_the_rank_table_and_pyarrow_come_on_first_use():
    """An evaluation process does not load pyarrow (27 MiB resident) until its rank table is asked for;
    the table then holds the result's rows."""
    import os
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", LAZY_TABLE], check=True, capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(root)}).stdout.strip()
    want = {"query_id": ["q1", "q0"], "video_id": ["v0", "v1"], "rank": [2, 1], "ratio": [0.1, 0.5]}
    assert out == f"{want} True"
