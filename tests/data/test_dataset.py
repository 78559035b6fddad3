"""VideoDataset, collate, train_loader and the eval iterators."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from prvrlab.data.collection import open_collection
from prvrlab.data.dataset import VideoBatchSampler, VideoDataset, collate, query_batches, train_loader, video_batches
from prvrlab.data.text import video_id_of


def _unit(x):
    """The official normalisation (the default): x / (|x| + 1e-5)."""
    return x / (np.linalg.norm(x, axis=-1, keepdims=True) + 1e-5)


def test_item_is_a_preprocessed_video_with_its_queries(toy_cfg, files):
    col = open_collection(toy_cfg)
    ds = VideoDataset(col, "train")
    assert len(ds) == 3
    item = ds[0]
    assert item.video_id == "vA" and item.query_ids == ["vA#0", "vA#1"]
    np.testing.assert_allclose(item.frames, _unit(files.video_frames(5, 6, 1)), rtol=1e-6)
    assert item.clips.shape == (32, 6)
    np.testing.assert_allclose(np.linalg.norm(item.clips, axis=1), 1.0, rtol=1e-4)
    assert [q.shape for q in item.queries] == [(3, 4), (30, 4)]  # 35 tokens truncated to 30
    np.testing.assert_allclose(item.queries[0], 0.5, rtol=1e-4)  # constant tokens, unit norm (to 1e-5 / |x|)
    val = VideoDataset(col, "val")[0]
    assert val.frames.shape == (128, 6)  # 140 frames mean-pooled


def test_data_normalize_reaches_every_row(toy_cfg, files):
    exact = VideoDataset(open_collection(dataclasses.replace(toy_cfg, normalize="exact")), "train")[0]
    official = VideoDataset(open_collection(toy_cfg), "train")[0]
    raw = files.video_frames(5, 6, 1)
    np.testing.assert_allclose(exact.frames, raw / np.linalg.norm(raw, axis=-1, keepdims=True), rtol=1e-6)
    np.testing.assert_allclose(official.frames, _unit(raw), rtol=1e-6)
    np.testing.assert_allclose(exact.queries[0], 0.5, rtol=1e-6)
    assert not np.array_equal(exact.queries[0], official.queries[0])  # small tokens: |x| / (|x| + 1e-5) shows
    for a, b in ((exact.frames, official.frames), (exact.clips, official.clips), (exact.queries[0], official.queries[0])):
        np.testing.assert_allclose(a, b, rtol=1e-4)


def test_collate_pads_and_indexes(toy_cfg):
    ds = VideoDataset(open_collection(toy_cfg), "train")
    items = [ds[i] for i in range(3)]
    b = collate(items)
    assert b.video_ids == ["vA", "vB", "vC"]
    assert b.query_ids == ["vA#0", "vA#1", "vB#0", "vB#1", "vC#0"]
    assert b.frames.shape == (3, 40, 6) and b.frames.dtype == torch.float32
    assert b.frame_mask.dtype == torch.bool and b.frame_mask.sum(1).tolist() == [5, 40, 3]
    assert b.clips.shape == (3, 32, 6)
    assert b.queries.shape == (5, 30, 4) and b.query_mask.sum(1).tolist() == [3, 30, 2, 4, 1]
    assert b.query_video.dtype == torch.int64 and b.query_video.tolist() == [0, 0, 1, 1, 2]
    assert b.query_video_host.dtype == np.int64 and b.query_video_host.tolist() == [0, 0, 1, 1, 2]  # read without a wait
    moved = b.to("cpu")
    assert moved.host_query_video() is b.query_video_host  # moving the tensors keeps the host copy
    assert not b.frames[~b.frame_mask].any() and not b.queries[~b.query_mask].any()  # zero padding
    assert b.frames[b.frame_mask].norm(dim=-1).allclose(torch.ones(48))
    np.testing.assert_allclose(b.frames[2, :3].numpy(), items[2].frames)
    np.testing.assert_allclose(b.queries[4, :1].numpy(), items[2].queries[0])
    # a one-video batch
    one = collate([items[2]])
    assert one.frames.shape == (1, 3, 6) and one.queries.shape == (1, 1, 4) and one.query_video.tolist() == [0]


def test_collated_and_evaluation_masks_carry_their_host_lengths(toy_cfg):
    import io
    import pickle
    from multiprocessing.reduction import ForkingPickler

    from prvrlab.data.batch import host_lengths, mask_to

    col = open_collection(toy_cfg)
    b = collate([VideoDataset(col, "train")[i] for i in range(3)])
    assert b.frame_lengths_host.tolist() == b.frame_mask.sum(1).tolist() == [5, 40, 3]
    assert b.query_lengths_host.tolist() == b.query_mask.sum(1).tolist() == [3, 30, 2, 4, 1]
    assert host_lengths(b.frame_mask) is b.frame_lengths_host and host_lengths(b.query_mask) is b.query_lengths_host
    # moving the batch keeps the marks on the moved masks ("meta": a device where every move is a new tensor)
    moved = b.to("meta")
    assert moved.frame_mask.device.type == "meta" and moved.frame_lengths_host is b.frame_lengths_host
    assert moved.query_lengths_host is b.query_lengths_host
    # a mask put in by hand has no mark (it is read back), whatever the batch held before
    swapped = dataclasses.replace(b, frame_mask=b.frame_mask.clone())
    assert swapped.frame_lengths_host is None and swapped.query_lengths_host is b.query_lengths_host
    # a loader worker sends tensors without their Python attributes; the unpickled batch marks them again
    buffer = io.BytesIO()
    ForkingPickler(buffer).dump(b)
    received = pickle.loads(buffer.getvalue())
    assert host_lengths(received.frame_mask).tolist() == [5, 40, 3]
    assert host_lengths(received.query_mask).tolist() == [3, 30, 2, 4, 1]
    for ids, clips, frames, frame_mask in video_batches(col, "val", 2):
        assert host_lengths(frame_mask).tolist() == frame_mask.sum(1).tolist()
        assert host_lengths(mask_to(frame_mask.clone(), "cpu")) is None  # a copy without the mark
        assert mask_to(frame_mask, "meta").device.type == "meta"
        assert host_lengths(mask_to(frame_mask, "meta")) is host_lengths(frame_mask)
    for ids, queries, query_mask in query_batches(col, "val", 2):
        assert host_lengths(query_mask).tolist() == query_mask.sum(1).tolist()


def test_marking_a_mask_with_lengths_that_cannot_describe_it_is_refused():
    from prvrlab.data.batch import prefix_mask, tag_lengths

    assert prefix_mask(np.array([2, 0, 1])).tolist() == [[True, True], [False, False], [True, False]]
    with pytest.raises(ValueError, match=r"lengths of shape \(2,\) do not describe a mask of shape \(3, 2\)"):
        tag_lengths(torch.zeros(3, 2, dtype=torch.bool), np.array([1, 1]))
    with pytest.raises(ValueError, match=r"lengths must lie in \[0, 2\], got \[0, 3\]"):
        tag_lengths(torch.zeros(2, 2, dtype=torch.bool), np.array([0, 3]))


def test_a_batch_without_a_host_copy_reads_query_video_and_a_wrong_copy_is_refused(toy_cfg):
    b = collate([VideoDataset(open_collection(toy_cfg), "train")[i] for i in range(3)])
    bare = dataclasses.replace(b, query_video_host=None)
    assert bare.host_query_video().dtype == np.int64 and bare.host_query_video().tolist() == [0, 0, 1, 1, 2]
    with pytest.raises(ValueError, match=r"query_video_host has shape \(4,\), query_video \(5,\)"):
        dataclasses.replace(b, query_video_host=np.zeros(4, dtype=np.int64))


def _check_batch(b):
    qv = b.query_video.tolist()
    assert qv == sorted(qv)  # contiguous per video
    assert [b.video_ids[v] for v in qv] == [video_id_of(q) for q in b.query_ids]
    assert len(set(b.video_ids)) == b.num_videos
    # the masks reach the model marked with their lengths, also from a worker process and through pinning
    assert b.frame_lengths_host.tolist() == b.frame_mask.sum(1).tolist()
    assert b.query_lengths_host.tolist() == b.query_mask.sum(1).tolist()


def test_train_loader_covers_split(toy_cfg):
    col = open_collection(toy_cfg)
    loader, sampler = train_loader(col, "train", batch_size_per_rank=2, rank=0, world_size=1, seed=3, num_workers=0)
    seen = []
    for epoch in range(2):
        sampler.set_epoch(epoch)
        batches = list(loader)
        assert len(batches) == len(loader) == 2
        for b in batches:
            _check_batch(b)
        seen.append(sorted(v for b in batches for v in b.video_ids))
    assert seen[0] == seen[1] == ["vA", "vB", "vC"]


def test_loader_workers_reopen_hdf5(tmp_path, files):
    cfg = files.make_collection(tmp_path / "h5", files.toy_videos, files.toy_captions, fmt="hdf5")
    col = open_collection(cfg)
    col.visual.frames("vA")  # the parent holds open handles before the workers fork
    col.queries.tokens("vA#0")
    loader, _ = train_loader(col, "train", batch_size_per_rank=3, rank=0, world_size=1, seed=0, num_workers=1)
    (batch,) = list(loader)
    _check_batch(batch)
    assert batch.num_queries == 5


@pytest.mark.skipif(not torch.cuda.is_available(), reason="page-locked memory needs a CUDA device")
def test_pinned_loader_yields_page_locked_batches(toy_cfg):
    col = open_collection(toy_cfg)
    loader, _ = train_loader(col, "train", batch_size_per_rank=3, num_workers=1, pin_memory=True)
    (batch,) = list(loader)
    _check_batch(batch)
    tensors = {name: value for name, value in vars(batch).items() if isinstance(value, torch.Tensor)}
    assert tensors and all(t.is_pinned() for t in tensors.values()), [n for n, t in tensors.items() if not t.is_pinned()]


def test_eval_iterators_follow_split_order(toy_cfg):
    col = open_collection(toy_cfg)
    ds = VideoDataset(col, "train")
    vb = list(video_batches(col, "train", 2))
    assert [ids for ids, *_ in vb] == [["vA", "vB"], ["vC"]]
    ids, clips, frames, mask = vb[0]
    assert clips.shape == (2, 32, 6) and frames.shape == (2, 40, 6) and mask.sum(1).tolist() == [5, 40]
    np.testing.assert_allclose(clips[1].numpy(), ds.video(1)[1])
    assert vb[1][2].shape == (1, 3, 6)  # padded to the longest video of that batch only
    qb = list(query_batches(col, "train", 3))
    assert [ids for ids, *_ in qb] == [["vA#0", "vA#1", "vB#0"], ["vB#1", "vC#0"]]
    assert qb[0][1].shape == (3, 30, 4) and qb[1][1].shape == (2, 4, 4)
    assert qb[1][2].sum(1).tolist() == [4, 1]
    np.testing.assert_allclose(qb[1][1][0].numpy(), ds.query(3))


def test_last_bin_setting_reaches_the_dataset(toy_cfg):
    toy_cfg.last_bin = "inclusive"
    inclusive = VideoDataset(open_collection(toy_cfg), "val")
    toy_cfg.last_bin = "official"
    official = VideoDataset(open_collection(toy_cfg), "val")
    raw = official.collection.visual.frames(official.index.video_ids[0])  # (140, Dv)
    # 140 frames into 128 bins: the last bin is [round(127 * 140 / 128), 140) = [139, 140), one frame,
    # so frames agree; 32 clips: the last bin [round(31 * 140 / 32), 140) = [136, 140) loses frame 139.
    np.testing.assert_array_equal(official[0].frames, inclusive[0].frames)
    np.testing.assert_array_equal(official[0].clips[:-1], inclusive[0].clips[:-1])
    np.testing.assert_allclose(official[0].clips[-1], _unit(raw[136:139].mean(0)), rtol=1e-5)
    np.testing.assert_allclose(inclusive[0].clips[-1], _unit(raw[136:140].mean(0)), rtol=1e-5)


def test_eval_video_batches_equal_the_items_and_refuse_a_length_the_index_does_not_say(toy_cfg, monkeypatch):
    col = open_collection(toy_cfg)
    ds = VideoDataset(col, "train")
    for ids, clips, frames, frame_mask in video_batches(col, "train", 2, by_length=True):
        for row, vid in enumerate(ids):
            item = ds[ds.index.video_ids.index(vid)]
            n = len(item.frames)  # preprocessed straight into the padded rows: the same values as the item's
            np.testing.assert_array_equal(frames[row, :n].numpy(), item.frames)
            np.testing.assert_array_equal(clips[row].numpy(), item.clips)
            assert not frames[row, n:].any() and frame_mask[row].sum().item() == n
    monkeypatch.setattr(type(col.visual), "num_frames", lambda self, v: 4)  # the index says 4 frames a video
    with pytest.raises(ValueError, match=r"video 'v[A-C]': \d+ frames after preprocessing, its index says 4"):
        list(video_batches(col, "train", 2))


@pytest.mark.parametrize("normalize", ["official", "exact"])
def test_eval_query_batches_equal_the_items_queries_bit_for_bit(toy_cfg, normalize):
    """Query batches read each query into its padded row and normalise the rows in blocks; each row
    equals the item's preprocessed query (truncated to max_query_len), padding zero."""
    col = open_collection(dataclasses.replace(toy_cfg, normalize=normalize))
    ds = VideoDataset(col, "train")
    seen = 0
    for ids, queries, query_mask in query_batches(col, "train", 3):
        for row, qid in enumerate(ids):
            want = ds.query(ds.index.query_ids.index(qid))  # (Lq, Dq)
            np.testing.assert_array_equal(queries[row, : len(want)].numpy(), want)
            assert not queries[row, len(want):].any() and query_mask[row].sum().item() == len(want)
            seen += 1
    assert seen == ds.index.num_queries and max(len(ds.query(j)) for j in range(seen)) == 30  # one was truncated


def test_eval_query_batches_normalised_in_blocks_and_checked_against_the_index(toy_cfg, monkeypatch):
    """Normalising NORMALIZE_ROWS rows at a time (here 2, in batches of 5: blocks of 2, 2, 1) gives every
    row the item's values bit for bit; a query whose token count disagrees with the index is named."""
    import prvrlab.data.dataset as dataset_module

    col = open_collection(toy_cfg)
    ds = VideoDataset(col, "train")
    monkeypatch.setattr(dataset_module, "NORMALIZE_ROWS", 2)
    rows = 0
    for ids, queries, query_mask in query_batches(col, "train", 5):
        lengths = query_mask.sum(dim=1).tolist()
        for row, qid in enumerate(ids):
            want = ds.query(ds.index.query_ids.index(qid))  # (Lq, Dq)
            assert lengths[row] == len(want)
            np.testing.assert_array_equal(queries[row, : len(want)].numpy(), want)
            assert not queries[row, len(want):].any()
        rows += len(ids)
    assert rows == ds.index.num_queries == 5  # one batch: blocks of 2, 2 and 1 rows
    ds.index.token_counts[0] += 1  # the index now says one token more than the file holds
    first = ds.index.query_ids[0]
    with pytest.raises(ValueError, match=rf"query '{first}': \d+ tokens as read, its index says \d+"):
        list(query_batches(col, "train", 5))


def test_padding_a_batch_s_frames_adds_zero_slots_and_keeps_its_host_lengths(toy_cfg):
    b = collate([VideoDataset(open_collection(toy_cfg), "train")[i] for i in (0, 2)])  # 5 and 3 frames
    assert b.frames.shape[1] == 5
    wide = b.pad_frames(9)
    assert wide.frames.shape == (2, 9, 6) and wide.frame_mask.shape == (2, 9)
    assert torch.equal(wide.frames[:, :5], b.frames) and not wide.frames[:, 5:].any()
    assert torch.equal(wide.frame_mask[:, :5], b.frame_mask) and not wide.frame_mask[:, 5:].any()
    assert wide.frame_lengths_host.tolist() == wide.frame_mask.sum(1).tolist() == [5, 3]
    assert wide.queries is b.queries and wide.video_ids == b.video_ids  # the rest is the batch's
    assert b.pad_frames(5) is b
    with pytest.raises(ValueError, match="cannot pad 5 frame slots to 4"):
        b.pad_frames(4)


def test_a_globally_padded_loader_pads_each_share_to_its_step_s_longest_video(toy_cfg):
    from prvrlab.data.collection import open_collection as open_toy

    col = open_toy(toy_cfg)
    counts = [min(n, col.max_frames) for n in col.split("train").frame_counts]  # frames each video keeps
    shares = {}
    for rank in range(2):
        loader, sampler = train_loader(col, "train", batch_size_per_rank=1, rank=rank, world_size=2, shuffle=False,
                                       global_padding=True)
        sampler.set_epoch(0)
        plain, _ = train_loader(col, "train", batch_size_per_rank=1, rank=rank, world_size=2, shuffle=False)
        shares[rank] = [(b.frames.shape[1], b.frame_lengths_host.tolist(), p.frames) for b, p in zip(loader, plain)]
        assert len(shares[rank]) == len(plain)
        for b, p in zip(loader, plain):
            assert torch.equal(b.frames[:, : p.frames.shape[1]], p.frames) and not b.frames[:, p.frames.shape[1]:].any()
    for k, whole in enumerate(VideoBatchSampler(len(counts), 1, shuffle=False, seed=0, world_size=2).global_batches()):
        assert shares[0][k][0] == shares[1][k][0] == max(counts[i] for i in whole)


def test_padding_a_batch_s_queries_adds_zero_slots_and_keeps_its_host_lengths():
    from prvrlab.data.batch import Batch, prefix_mask

    lengths = np.array([3, 1, 2])
    queries = torch.arange(3 * 3 * 2, dtype=torch.float32).reshape(3, 3, 2) * prefix_mask(lengths, 3)[:, :, None]
    b = Batch(
        frames=torch.zeros(2, 4, 5), frame_mask=torch.ones(2, 4, dtype=torch.bool), clips=torch.zeros(2, 2, 5),
        queries=queries, query_mask=prefix_mask(lengths, 3), query_video=torch.tensor([0, 0, 1]),
        video_ids=["a", "b"], query_ids=["q0", "q1", "q2"],
    )
    wide = b.pad_queries(6)
    assert wide.queries.shape == (3, 6, 2) and wide.query_mask.shape == (3, 6)
    assert torch.equal(wide.queries[:, :3], queries) and not wide.queries[:, 3:].any()
    assert wide.query_lengths_host.tolist() == wide.query_mask.sum(1).tolist() == [3, 1, 2]
    assert wide.frames is b.frames and b.pad_queries(3) is b
    with pytest.raises(ValueError, match="cannot pad 3 query token slots to 2"):
        b.pad_queries(2)
