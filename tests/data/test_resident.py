"""ResidentSplit: a split held on a device gives the collated batches, value for value."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from prvrlab.data import resident as resident_module
from prvrlab.data.collection import open_collection
from prvrlab.data.config import DataConfig
from prvrlab.data.dataset import VideoDataset, collate, query_batches, train_loader, video_batches
from prvrlab.data.errors import DataError
from prvrlab.data.resident import ResidentSplit


def assert_same_batch(got, want) -> None:
    for field in dataclasses.fields(want):
        a, b = getattr(got, field.name), getattr(want, field.name)
        if isinstance(b, torch.Tensor):
            assert a.dtype == b.dtype and a.shape == b.shape, (field.name, a.dtype, b.dtype, a.shape, b.shape)
            assert torch.equal(a.cpu(), b), field.name
        elif isinstance(b, np.ndarray):  # the host copy of query_video
            assert a.dtype == b.dtype and np.array_equal(a, b), field.name
        else:
            assert a == b, field.name


@pytest.mark.parametrize("split", ["train", "val"])
def test_batches_equal_the_collated_ones_of_the_hand_written_collection(toy_cfg, split):
    col = open_collection(toy_cfg)
    held = ResidentSplit(col, split, device="cpu")
    ds = VideoDataset(col, split)
    for videos in ([0], list(range(len(ds)))[::-1], list(range(len(ds)))):
        assert_same_batch(held.batch(videos), collate([ds[i] for i in videos]))
    if split == "val":
        assert held.frame_len.tolist() == [128]  # 140 frames mean-pooled to max_frames
        assert held.batch([0]).queries.shape[1] == 5


CUDA = pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"))


@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_batches_equal_the_collated_ones_with_pooling_and_truncation(tiny_root, device):
    """Short max_frames / max_query_len: most videos are pooled and most queries cut, in any order of videos."""
    col = open_collection(DataConfig(root=str(tiny_root), max_frames=16, max_query_len=4))
    held = ResidentSplit(col, "train", device=device, num_workers=1)
    assert held.frames.device.type == held.batch([0]).frames.device.type == device
    ds = VideoDataset(col, "train")
    assert (held.frame_len == 16).mean() > 0.5 and (held.query_len == 4).mean() > 0.5
    rng = np.random.default_rng(0)
    for size in (1, 5, 17):
        videos = rng.choice(len(ds), size=size, replace=False).tolist()
        assert_same_batch(held.batch(videos), collate([ds[i] for i in videos]))
    with pytest.raises(ValueError, match="at least one video"):
        held.batch([])


def test_the_train_loader_made_on_a_resident_split_yields_the_loader_batches(tiny_root):
    col = open_collection(DataConfig(root=str(tiny_root)))
    held = ResidentSplit(col, "train", device="cpu")
    kwargs = dict(batch_size_per_rank=7, rank=1, world_size=2, seed=3)
    streamed, streamed_sampler = train_loader(col, "train", **kwargs)
    made, made_sampler = train_loader(col, "train", resident=held, **kwargs)
    assert len(made) == len(streamed) > 1
    for epoch in range(2):
        streamed_sampler.set_epoch(epoch)
        made_sampler.set_epoch(epoch)
        pairs = list(zip(made, streamed, strict=True))
        for got, want in pairs:
            assert_same_batch(got, want)
    with pytest.raises(ValueError, match="holds"):
        train_loader(col, "val", batch_size_per_rank=4, resident=held)


@pytest.mark.parametrize("workers", [0, 1])
def test_the_loader_leaves_the_global_random_stream_alone(toy_cfg, workers):
    """Its workers' seeds come from its own generator, so a resident split's run draws what a streamed one draws."""
    col = open_collection(toy_cfg)
    loader, _ = train_loader(col, "train", batch_size_per_rank=2, num_workers=workers)
    torch.manual_seed(11)
    expected = torch.rand(3)
    torch.manual_seed(11)
    for _ in range(2):  # two epochs: a fresh iterator each time without workers
        list(loader)
    assert torch.equal(torch.rand(3), expected)


def test_a_split_larger_than_the_free_memory_is_refused_naming_the_key(toy_cfg, monkeypatch):
    col = open_collection(toy_cfg)
    need = ResidentSplit(col, "train", device="cpu").nbytes
    frames = 5 + 40 + 3  # the toy train videos' frames, none pooled
    tokens = 3 + 30 + 2 + 1 + 4  # its queries' tokens, 35 cut to max_query_len 30
    assert need == 4 * (frames * 6 + 3 * 32 * 6 + tokens * 4)
    monkeypatch.setattr(resident_module, "available_bytes", lambda device: int(need / 0.8) - 1)
    with pytest.raises(DataError, match=r"data\.resident: the 'train' split's .* set data\.resident: false"):
        ResidentSplit(col, "train", device="cpu")
    monkeypatch.setattr(resident_module, "available_bytes", lambda device: int(need / 0.8) + 8)
    ResidentSplit(col, "train", device="cpu")


def test_the_free_memory_of_the_cpu_is_known():
    free = resident_module.available_bytes(torch.device("cpu"))
    assert free is not None and free > 0


@pytest.mark.skipif(not Path("/proc/meminfo").exists(), reason="Linux's /proc/meminfo")
def test_the_cpus_free_memory_counts_the_page_cache_the_os_can_reclaim():
    """MemAvailable, not MemFree: a machine that has read large feature files has little of the latter."""
    fields = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in Path("/proc/meminfo").read_text().splitlines()}
    free = resident_module.available_bytes(torch.device("cpu"))
    cgroup = resident_module.cgroup_headroom()
    expected = fields["MemAvailable"] if cgroup is None else min(fields["MemAvailable"], cgroup)
    assert abs(free - expected) < 256 << 20  # read moments apart
    if cgroup is None:
        assert free >= fields["MemFree"] - (256 << 20)


def _cgroup_files(folder: Path, **files: int | str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for name, value in files.items():
        if name == "stat":
            (folder / "memory.stat").write_text(str(value))
        else:
            (folder / name.replace("_", ".", 1)).write_text(f"{value}\n")


def test_a_cgroup_v2_limit_caps_the_free_memory_less_its_usage_but_not_its_reclaimable_cache(tmp_path):
    gib = 1 << 30
    job = tmp_path / "kubepods" / "pod1"
    _cgroup_files(tmp_path, memory_max="max", memory_current=50 * gib)
    _cgroup_files(tmp_path / "kubepods", memory_max=64 * gib, memory_current=40 * gib, stat="anon 1\ninactive_file 0\n")
    _cgroup_files(job, memory_max=8 * gib, memory_current=5 * gib,
                  stat=f"anon {3 * gib}\nactive_file 5\ninactive_file {2 * gib}\nfile 7\n")
    room = resident_module.cgroup_headroom(root=tmp_path, membership="0::/kubepods/pod1\n")
    assert room == 8 * gib - (5 * gib - 2 * gib)  # the pod's own limit is the tightest: 5 GiB
    _cgroup_files(job, memory_max="max", memory_current=5 * gib, stat="inactive_file 0\n")
    assert resident_module.cgroup_headroom(root=tmp_path, membership="0::/kubepods/pod1\n") == 24 * gib  # the parent's
    _cgroup_files(tmp_path / "kubepods", memory_max="max", memory_current=1, stat="")
    assert resident_module.cgroup_headroom(root=tmp_path, membership="0::/kubepods/pod1\n") is None  # no limit anywhere


def test_a_cgroup_v1_memory_limit_and_a_namespaced_cgroup_are_read(tmp_path):
    gib = 1 << 30
    unlimited = 9223372036854771712  # v1's "no limit"
    mine = tmp_path / "memory" / "slurm" / "job_7"
    _cgroup_files(tmp_path / "memory", memory_limit_in_bytes=unlimited, memory_usage_in_bytes=90 * gib)
    _cgroup_files(tmp_path / "memory" / "slurm", memory_limit_in_bytes=unlimited, memory_usage_in_bytes=9 * gib)
    _cgroup_files(mine, memory_limit_in_bytes=4 * gib, memory_usage_in_bytes=3 * gib,
                  stat=f"inactive_file 1\ntotal_inactive_file {gib}\n")
    (tmp_path / "unified").mkdir()
    hybrid = "12:memory:/slurm/job_7\n11:cpu,cpuacct:/slurm/job_7\n0::/\n"  # v1 memory beside v2 without it
    assert resident_module.cgroup_headroom(root=tmp_path, membership=hybrid) == 4 * gib - (3 * gib - gib)
    _cgroup_files(tmp_path / "memory", memory_limit_in_bytes=2 * gib, memory_usage_in_bytes=gib // 2)
    namespaced = "12:memory:/\n"  # inside a container the own cgroup is the mount's root
    assert resident_module.cgroup_headroom(root=tmp_path, membership=namespaced) == 2 * gib - gib // 2
    assert resident_module.cgroup_headroom(root=tmp_path, membership="12:memory:/gone/elsewhere\n") == 2 * gib - gib // 2
    assert resident_module.cgroup_headroom(root=tmp_path, membership="") is None
    assert resident_module.cgroup_headroom(root=tmp_path / "absent", membership=hybrid) is None


def test_the_cpus_free_memory_is_the_smaller_of_the_hosts_and_the_cgroups(monkeypatch):
    monkeypatch.setattr(resident_module, "_host_available", lambda: 10 << 30)
    monkeypatch.setattr(resident_module, "cgroup_headroom", lambda: 3 << 30)
    assert resident_module.available_bytes(torch.device("cpu")) == 3 << 30
    monkeypatch.setattr(resident_module, "cgroup_headroom", lambda: None)
    assert resident_module.available_bytes(torch.device("cpu")) == 10 << 30
    monkeypatch.setattr(resident_module, "_host_available", lambda: None)
    assert resident_module.available_bytes(torch.device("cpu")) is None


def test_a_process_reuses_the_split_it_holds_until_what_it_was_made_from_changes(toy_cfg, monkeypatch):
    """Trials run one after another in a reused pool's ranks: only the first loads the split."""
    monkeypatch.setattr(resident_module, "_HELD", {})
    loads = []
    real_init = ResidentSplit.__init__

    def counting_init(self, *args, **kwargs):
        loads.append(args[1] if len(args) > 1 else kwargs["split"])
        real_init(self, *args, **kwargs)

    monkeypatch.setattr(ResidentSplit, "__init__", counting_init)
    def hold(cfg, splits=("train", "val")):
        return resident_module.hold_splits(open_collection(cfg), list(splits), device="cpu")

    first = hold(toy_cfg)
    assert sorted(first) == ["train", "val"] and loads == ["train", "val"]
    assert hold(toy_cfg) == first  # a fresh open of the same files: the same held splits, nothing loaded
    assert hold(toy_cfg, ["train"])["train"] is first["train"] and len(resident_module._HELD) == 1  # val let go
    assert loads == ["train", "val"]
    pooled = hold(dataclasses.replace(toy_cfg, max_frames=4))
    assert pooled["train"] is not first["train"] and pooled["train"].frame_len.max() == 4
    assert len(resident_module._HELD) == 2 and loads == ["train", "val", "train", "val"]  # the old train let go first
    captions = open_collection(toy_cfg).split("train").caption_file
    stat = captions.stat()
    os.utime(captions, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # the train captions rewritten
    again = hold(dataclasses.replace(toy_cfg, max_frames=4))
    assert again["train"] is not pooled["train"] and again["val"] is pooled["val"]
    assert loads[4:] == ["train"]
    exact = hold(dataclasses.replace(toy_cfg, max_frames=4, normalize="exact"))  # other rows: not the held ones
    assert exact["train"] is not again["train"] and loads[5:] == ["train", "val"]


def test_releasing_lets_go_of_the_held_split(toy_cfg, monkeypatch):
    monkeypatch.setattr(resident_module, "_HELD", {})
    (held,) = resident_module.hold_splits(open_collection(toy_cfg), ["train"], device="cpu").values()
    resident_module.release_held()
    assert resident_module._HELD == {}
    assert resident_module.hold_splits(open_collection(toy_cfg), ["train"], device="cpu")["train"] is not held


@pytest.mark.parametrize("rank, world", [(0, 1), (1, 2)])
def test_evaluation_batches_of_a_resident_split_equal_the_read_ones(tiny_root, rank, world):
    col = open_collection(DataConfig(root=str(tiny_root), max_frames=16, max_query_len=4))
    held = ResidentSplit(col, "val", device="cpu")
    shard = dict(rank=rank, world_size=world)
    for made, read in zip(video_batches(col, "val", 5, by_length=True, resident=held, **shard),
                          video_batches(col, "val", 5, by_length=True, **shard), strict=True):
        assert made[0] == read[0] and all(torch.equal(a, b) for a, b in zip(made[1:], read[1:], strict=True))
    for made, read in zip(query_batches(col, "val", 7, resident=held, **shard), query_batches(col, "val", 7, **shard),
                          strict=True):
        assert made[0] == read[0] and all(torch.equal(a, b) for a, b in zip(made[1:], read[1:], strict=True))
    with pytest.raises(ValueError, match="holds"):
        list(video_batches(col, "train", 5, resident=held))
