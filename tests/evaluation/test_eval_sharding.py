"""The optimised evaluation equals the plain one: videos encoded by length instead of split order,
and encoding + scoring sharded over 2 gloo DDP processes, give the single-process, split-order ranks."""

from __future__ import annotations

import dataclasses
import json
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp

import prvrlab.evaluation.retrieval as ev
from prvrlab.data.collection import open_collection
from prvrlab.data.dataset import query_batches, video_batches
from prvrlab.models.factory import build_model
from prvrlab.platform.config import validate
from train_helpers import gloo_group, small_raw
from device_under_test import DEVICE


def setup(tiny_root: Path, tmp: Path, **eval_cfg):
    raw = small_raw(tiny_root, tmp)
    raw["eval"] = {"video_batch_size": 7, "query_batch_size": 11, "score_chunk": 13, **eval_cfg}
    cfg = validate(raw)
    collection = open_collection(cfg.data)
    torch.manual_seed(0)
    model = build_model(cfg.model, cfg.plugins, video_dim=collection.video_dim, query_dim=collection.query_dim)
    return cfg, collection, model


def plain_evaluation(model, collection, cfg, split: str = "val"):
    """Split order, one process: the evaluation before the optimisations."""
    index = collection.split(split)
    return ev.evaluate_batches(
        model,
        video_batches(collection, split, cfg.eval.video_batch_size),
        query_batches(collection, split, cfg.eval.query_batch_size),
        video_ids=index.video_ids, query_ids=index.query_ids, query_video=index.query_video,
        ratios=getattr(index, "ratios", None), chunk=cfg.eval.score_chunk, device=next(model.parameters()).device,
    )


def test_video_batches_by_length_and_sharded_cover_the_split_once(tiny_root, tmp_path):
    cfg, collection, _ = setup(tiny_root, tmp_path)
    index = collection.split("val")
    counts = [collection.visual.num_frames(v) for v in index.video_ids]
    shares = [list(video_batches(collection, "val", 5, by_length=True, rank=r, world_size=3)) for r in range(3)]
    assert [len(s) for s in shares] == [len(range(r, -(-index.num_videos // 5), 3)) for r in range(3)]
    ids = [v for share in shares for batch in share for v in batch[0]]
    assert sorted(ids) == sorted(index.video_ids)  # every video exactly once
    sequence = [b for j in range(len(shares[0])) for b in (s[j] for s in shares if j < len(s))]  # dealt order
    lengths = [counts[index.video_ids.index(v)] for batch in sequence for v in batch[0]]
    assert lengths == sorted(counts, reverse=True)  # the batches, re-dealt, run from the most to the fewest frames
    for batch in sequence:
        real = batch[3].sum(dim=1)  # (B,)
        assert batch[2].shape[1] == int(real.max())  # padded to the batch's longest only
    queries = [q for r in range(2) for batch in query_batches(collection, "val", 4, rank=r, world_size=2) for q in batch[0]]
    assert sorted(queries) == sorted(index.query_ids)


def test_evaluate_equals_plain_split_order(tiny_root, tmp_path):
    cfg, collection, model = setup(tiny_root, tmp_path)
    plain = plain_evaluation(model, collection, cfg)
    fast = ev.evaluate(model, collection, "val", cfg.eval, device=DEVICE)
    np.testing.assert_array_equal(fast.ranks, plain.ranks)
    assert fast.table.column("query_id").to_pylist() == collection.split("val").query_ids
    assert fast.metrics == plain.metrics and fast.by_group == plain.by_group


def test_bf16_falls_back_to_float32_without_native_units(tiny_root, tmp_path, monkeypatch):
    cfg, collection, model = setup(tiny_root, tmp_path)
    monkeypatch.setattr(ev, "native_low_precision", lambda device_type: False)
    ev._warn_emulated.cache_clear()
    with pytest.warns(RuntimeWarning, match="no native bf16"):
        bf16 = ev.evaluate(model, collection, "val", cfg.eval, device=DEVICE, amp_dtype="bf16")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # one warning per dtype and process
        ev.evaluate(model, collection, "val", cfg.eval, device=DEVICE, amp_dtype="bf16")
    np.testing.assert_array_equal(bf16.ranks, plain_evaluation(model, collection, cfg).ranks)


SHARDINGS = {"both ranks": {}, "rank 1 has no share": {"video_batch_size": 1000, "query_batch_size": 1000},
             "the ranks read different free memory": {}}
FREE_VIDEOS = {"the ranks read different free memory": (7, 3)}  # the video batch each rank's free memory fits


def _sharded_rank(rank: int, world: int, init_file: str, tiny_root: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    with gloo_group(rank, world, init_file):
        out = {}
        real_free = ev._available_bytes
        for name, eval_cfg in SHARDINGS.items():
            cfg, collection, model = setup(Path(tiny_root), Path(out_dir), **eval_cfg)
            if name in FREE_VIDEOS:  # as two readings moments apart: each rank alone would cut other batches
                per_video = 4 * (collection.max_frames + collection.num_clips) * collection.video_dim
                free = 16 * per_video * FREE_VIDEOS[name][rank]
                ev._available_bytes = lambda: free
                fits = ev.video_batch_size(cfg.eval.video_batch_size, collection.max_frames + collection.num_clips,
                                           collection.video_dim, share=model.encode_budget_share())
                assert fits == FREE_VIDEOS[name][rank]
            result = ev.evaluate(model, collection, "val", cfg.eval, device="cpu", rank=rank, world_size=world)
            ev._available_bytes = real_free
            out[name] = None if result is None else {
                "ranks": result.ranks.tolist(), "metrics": result.metrics,
                "ids": result.table.column("query_id").to_pylist(), "videos": result.num_videos,
            }
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(out))


@pytest.mark.slow
def test_two_gloo_ranks_equal_one_process(tiny_root, tmp_path):
    mp.spawn(_sharded_rank, args=(2, str(tmp_path / "init"), str(tiny_root), str(tmp_path)), nprocs=2, join=True)
    rank0 = json.loads((tmp_path / "rank0.json").read_text())
    assert json.loads((tmp_path / "rank1.json").read_text()) == {name: None for name in SHARDINGS}
    with torch.device("cpu"):  # the ranks ran on the CPU: the same weights and float order here
        cfg, collection, model = setup(tiny_root, tmp_path)
        plain = plain_evaluation(model, collection, cfg)
    index = collection.split("val")
    for name in SHARDINGS:
        got = rank0[name]
        assert got["ids"] == index.query_ids, name
        np.testing.assert_array_equal(np.array(got["ranks"]), plain.ranks, err_msg=name)
        assert got["metrics"] == pytest.approx(plain.metrics, abs=1e-9), name
        assert got["videos"] == index.num_videos, name


def record_batches(monkeypatch, name: str, record) -> None:
    """Replace ``ev.<name>`` (``encode_videos`` / ``encode_queries``) by one that calls ``record(batch)`` on
    every batch it is given, then encodes them as before."""
    real = getattr(ev, name)

    def recording(model, batches, **kwargs):
        def seen():
            for batch in batches:
                record(batch)
                yield batch
        return real(model, seen(), **kwargs)

    monkeypatch.setattr(ev, name, recording)


def test_query_batches_fitted_to_memory_give_the_same_ranks(tiny_root, tmp_path, monkeypatch):
    """A query budget of 3 queries' word features makes evaluate() encode 3 queries at a time instead
    of the configured 11; the ranks are those of the plain split-order evaluation."""
    cfg, collection, model = setup(tiny_root, tmp_path)
    plain = plain_evaluation(model, collection, cfg)
    sizes: list[int] = []
    record_batches(monkeypatch, "encode_queries", lambda batch: sizes.append(len(batch[0])))
    monkeypatch.setattr(ev, "QUERY_BUDGET_BYTES", 3 * 4 * collection.max_query_len * collection.query_dim)
    fast = ev.evaluate(model, collection, "val", cfg.eval, device=DEVICE)
    assert max(sizes) == 3 and sum(sizes) == collection.split("val").num_queries
    np.testing.assert_array_equal(fast.ranks, plain.ranks)


def test_low_precision_fields_stay_as_encoded_and_move_no_rank(tiny_root, tmp_path, monkeypatch):
    """GMMFormer v2 declares its clips and frames ``low_precision_fields``: under bf16 autocast the
    gallery it is given holds them in bf16 (where bf16 runs natively), the rest in float32, and the ranks
    equal those of a gallery cast to float32 (the same values)."""
    from prvrlab.models.gmmformer_v2 import GMMFormerV2

    raw = small_raw(tiny_root, tmp_path)
    raw["model"] = {"name": "gmmformer_v2", "hidden_size": 32, "num_heads": 2, "dropout": 0.0}
    raw["eval"] = {"video_batch_size": 7, "query_batch_size": 11, "score_chunk": 13}
    cfg = validate(raw)
    collection = open_collection(cfg.data)
    torch.manual_seed(0)
    model = build_model(cfg.model, cfg.plugins, video_dim=collection.video_dim, query_dim=collection.query_dim)
    galleries = []
    real = ev.encode_videos
    monkeypatch.setattr(ev, "encode_videos", lambda *a, **k: galleries.append(real(*a, **k)) or galleries[-1])
    kept = ev.evaluate(model, collection, "val", cfg.eval, device=DEVICE, amp_dtype="bf16")
    monkeypatch.setattr(GMMFormerV2, "low_precision_fields", ())
    cast = ev.evaluate(model, collection, "val", cfg.eval, device=DEVICE, amp_dtype="bf16")
    native = ev.native_low_precision(torch.device(DEVICE).type)
    low = torch.bfloat16 if native else torch.float32
    assert (galleries[0][0].clip.dtype, galleries[0][0].frame.dtype) == (low, low)
    assert (galleries[1][0].clip.dtype, galleries[1][0].frame.dtype) == (torch.float32, torch.float32)
    np.testing.assert_array_equal(kept.ranks, cast.ranks)


@pytest.mark.parametrize("backbone", ["gmmformer", "ice_base"])
def test_float32_encoded_clips_are_stored_as_bf16_values_in_a_bf16_evaluation(tiny_root, tmp_path, monkeypatch, backbone):
    """GMMFormer's and the ICE base model's clips leave their encoder in float32 (LayerNorms last); a
    bf16 evaluation stores them rounded to bf16 (low_precision_fields), where bf16 runs natively, and its
    ranks are those of the float32 gallery rounded to bf16 by hand (that bf16 products equal float32 ones
    on bf16 values is tests/models/test_scoring.py's)."""
    raw = small_raw(tiny_root, tmp_path)
    raw["model"] = {"name": backbone, "hidden_size": 32, "num_heads": 2, "dropout": 0.0}
    raw["eval"] = {"video_batch_size": 7, "query_batch_size": 11, "score_chunk": 13}
    if backbone == "ice_base":  # its branches: moment (the clips) and video
        raw["losses"] = {"moment_nce": {"loss": "infonce", "weight": 1.0, "branch": "moment"}}
    cfg = validate(raw)
    collection = open_collection(cfg.data)
    torch.manual_seed(0)
    model = build_model(cfg.model, cfg.plugins, video_dim=collection.video_dim, query_dim=collection.query_dim)
    galleries, ranked = [], []
    real_videos, real_ranks = ev.encode_videos, ev.compute_ranks
    monkeypatch.setattr(ev, "encode_videos", lambda *a, **k: galleries.append(real_videos(*a, **k)) or galleries[-1])
    monkeypatch.setattr(ev, "compute_ranks", lambda m, q, v, *a, **k: ranked.append((q, v, a, k)) or real_ranks(m, q, v, *a, **k))
    stored = ev.evaluate(model, collection, "val", cfg.eval, device=DEVICE, amp_dtype="bf16")
    monkeypatch.setattr(type(model), "low_precision_fields", ())
    plain = ev.evaluate(model, collection, "val", cfg.eval, device=DEVICE, amp_dtype="bf16")
    if not ev.native_low_precision(torch.device(DEVICE).type):  # emulated bf16: evaluate() runs float32
        assert galleries[0][0].clip.dtype == galleries[1][0].clip.dtype == torch.float32
        np.testing.assert_array_equal(stored.ranks, plain.ranks)
        return
    low, full = galleries[0][0].clip, galleries[1][0].clip  # (Nv, Lc, D) each
    assert low.dtype == torch.bfloat16 and full.dtype == torch.float32 and galleries[0][0].frame.dtype == torch.float32
    assert not torch.equal(full, full.bfloat16().float())  # float32 values: the rounding is real
    assert torch.equal(low, full.bfloat16())
    query, video, args, kwargs = ranked[1]  # the float32 gallery, rounded here and indexed again
    rounded = dataclasses.replace(video, clip=video.clip.bfloat16().float(), extra={})
    by_hand = real_ranks(model, query, model.index_videos(rounded), *args, **kwargs)
    np.testing.assert_array_equal(stored.ranks, by_hand)


def test_a_batch_dependent_model_is_evaluated_in_the_reference_batches(tiny_root, tmp_path, monkeypatch):
    """GMMFormer with ``window_length: batch`` (its videos' encodings depend on their batch) is evaluated as the
    reference code does: the split in order, exactly ``eval.video_batch_size`` videos a batch, even where the
    memory budget would cut smaller ones; its ranks are those of the plain split-order evaluation, and the
    by-length batches would have given other embeddings."""
    raw = small_raw(tiny_root, tmp_path)
    raw["model"]["window_length"] = "batch"
    raw["eval"] = {"video_batch_size": 7, "query_batch_size": 11, "score_chunk": 13}
    cfg = validate(raw)
    collection = open_collection(cfg.data)
    torch.manual_seed(0)
    model = build_model(cfg.model, cfg.plugins, video_dim=collection.video_dim, query_dim=collection.query_dim)
    assert model.batch_dependent_videos()
    batches: list[list[str]] = []
    real = ev.encode_videos
    record_batches(monkeypatch, "encode_videos", lambda batch: batches.append(list(batch[0])))
    per_video = 4 * (collection.max_frames + collection.num_clips) * collection.video_dim
    monkeypatch.setattr(ev, "ENCODE_BUDGET_BYTES", 3 * per_video)  # would cut batches of 3
    got = ev.evaluate(model, collection, "val", cfg.eval, device=DEVICE)
    ids = collection.split("val").video_ids
    chunks = [ids[lo : lo + 7] for lo in range(0, len(ids), 7)]  # the reference's batches
    assert sorted(batches) == sorted(chunks) and len(batches) == len(chunks)
    frames = {v: collection.visual.num_frames(v) for v in ids}
    assert max(frames[v] for v in batches[0]) == max(frames.values())  # the longest-padded batch first
    np.testing.assert_array_equal(got.ranks, plain_evaluation(model, collection, cfg).ranks)
    split_order, _ = real(model, video_batches(collection, "val", 7), device=DEVICE)
    by_length, by_length_ids = real(model, video_batches(collection, "val", 7, by_length=True), device=DEVICE)
    order = [by_length_ids.index(v) for v in ids]
    assert not torch.equal(split_order.frame, by_length.frame[order])
