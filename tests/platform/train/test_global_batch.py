"""DDP training of a model whose videos' encodings depend on their batch (GMMFormer, ``window_length: batch``):
every rank pads its share of a batch to the longest video of the whole (global) batch, so each share encodes
as it does in one process holding the whole batch (the reference trains in one process).  The batches the
training epoch iterates (``loop.loader``) and those of the components' epoch hooks are both padded."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from train_helpers import gloo_group, rank_loop, small_raw

PER_RANK = 4
WORLD = 2


def batch_raw(root: Path, tmp: Path, *, world: int, window_length: str = "batch") -> dict:
    raw = small_raw(root, tmp, batch_size=PER_RANK * WORLD, epochs=1, torch_threads=1, num_workers=world)
    raw["model"]["window_length"] = window_length
    raw["train"]["ddp_batch"] = "local"  # the padding the model's windows ask for, not the gathered losses'
    return raw


def first_batches(raw: dict, out: Path, *, rank: int, world: int) -> dict:
    """The first batch of the training epoch and of the epoch hooks: frame slots, real lengths, video ids, and
    the training batch's frame vectors (eval mode: no dropout)."""
    loop = rank_loop(raw, out, rank=rank, world=world)
    loop.setup()
    loop.sampler.set_epoch(0)
    batch = next(iter(loop.loader))  # what train_epoch steps through
    hooked = next(loop.epoch_context(0).train_batches())  # what a component's epoch hook reads
    loop.model.eval()
    with torch.no_grad():
        frame = loop.model.encode_videos(batch.clips, batch.frames, batch.frame_mask).frame  # (B, D)
    return {
        "slots": batch.frames.shape[1], "videos": batch.video_ids, "lengths": batch.frame_lengths_host.tolist(),
        "real": batch.frame_mask.sum(1).tolist(), "frame": frame.tolist(),
        "hook_slots": hooked.frames.shape[1], "hook_lengths": hooked.frame_lengths_host.tolist(),
    }


def _rank(rank: int, world: int, init_file: str, raws: dict, out_dir: str) -> None:
    torch.set_num_threads(1)
    with gloo_group(rank, world, init_file):
        got = {name: first_batches(raw, Path(out_dir) / name, rank=rank, world=world) for name, raw in raws.items()}
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(got))


@pytest.mark.slow
def test_each_rank_pads_to_the_global_batch_and_encodes_as_one_process(tiny_root, tmp_path):
    raws = {name: batch_raw(tiny_root, tmp_path / name, world=WORLD, window_length=name) for name in ("batch", "padded")}
    mp.spawn(_rank, args=(WORLD, str(tmp_path / "init"), raws, str(tmp_path)), nprocs=WORLD, join=True)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)]
    one = first_batches(batch_raw(tiny_root, tmp_path / "one", world=1), tmp_path / "one", rank=0, world=1)
    assert [v for r in ranks for v in r["batch"]["videos"]] == one["videos"]  # the ranks' shares make the batch
    assert min(max(r["batch"]["lengths"]) for r in ranks) < one["slots"]  # one share alone pads less: the case matters
    assert min(max(r["batch"]["hook_lengths"]) for r in ranks) < one["hook_slots"]
    for r, got in enumerate(ranks):
        batch = got["batch"]
        assert batch["slots"] == one["slots"] == max(one["lengths"])  # the global batch's longest video
        assert batch["hook_slots"] == one["hook_slots"] == max(one["hook_lengths"])
        assert batch["lengths"] == batch["real"] == one["lengths"][r * PER_RANK : (r + 1) * PER_RANK]
        torch.testing.assert_close(
            torch.tensor(batch["frame"]), torch.tensor(one["frame"][r * PER_RANK : (r + 1) * PER_RANK]),
            atol=1e-5, rtol=1e-5,
        )
        plain = got["padded"]  # a batch-independent model: each share padded to its own longest video
        assert plain["slots"] == max(plain["lengths"]) and plain["hook_slots"] == max(plain["hook_lengths"])
