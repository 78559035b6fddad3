"""Time the official GMMFormer / GMMFormer v2 evaluation on a prvrlab TVR-shaped collection, on this machine.

The official code is not part of prvrlab.  Give this script a checkout of it (its ``src`` folder):

    git clone https://github.com/huangmozhi9527/GMMFormer      ../official/GMMFormer      # commit c38df37d
    git clone https://github.com/huangmozhi9527/GMMFormer_v2   ../official/GMMFormer_v2   # commit 5bacac96
    pip install --target ../official/site easydict einops ipdb seaborn   # what its modules import
    .venv/bin/python benchmarks/official_eval.py --src ../official/GMMFormer/src --site ../official/site --split val

It runs what the official ``main.py`` runs to evaluate (``get_configs('tvr')``, ``set_seed``,
``get_datasets``, ``get_models``, ``get_validations(cfg)(model, context_loader, query_loader)``
under ``torch.no_grad()``) with an untrained model (its own initialisation: this times, it does not
score), fp32 on the CPU.  No official file is edited; at run time:

- ``Tensor.cuda`` / ``Module.cuda`` return their object (the official code calls ``.cuda()``);
- ``Configs/tvr.py`` is imported with ``os.makedirs`` disabled (it creates its authors' hard-coded
  folders at import); its results folder is a temporary one;
- ``data_root`` / ``collection`` / ``visual_feature`` point at the collection (through a symlink in
  a temporary folder: the official loader wants ``data_root/<collection>/``), ``num_workers`` is
  ``--num-workers`` (official 32; 0 keeps every read in this process, so its peak RSS is complete).
  Every other setting is the official TVR one (batches of 100 videos / 50 queries, 128 frames,
  32 clips, clip/frame weights 0.7/0.3);
- the two evaluation loaders and the model's encoders are wrapped with timers.

Prints, and with ``--json`` ends with one JSON line of: the index set-up (``get_datasets`` reads
the feature file's 278k-name index and ``video2frames.txt`` for train, val and test), the wait for
video batches (per-frame reads in float64, pooling, collation), video encoding, queries + scoring +
metrics, the evaluation's total (from the first batch to the metrics, set-up excluded), and the
peak RSS (VmHWM).  ``bench_eval.py --official-src`` runs this alternately with prvrlab's evaluation.
Like any checkout you run, the official code runs with your permissions (its loader ``eval()``s
``video2frames.txt``).
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

T_START = time.perf_counter()


def vm_kib(key: str) -> int:
    """``key`` (VmRSS, VmHWM) of /proc/self/status in KiB, or -1 where there is none."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return -1


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--src", required=True, type=Path, help="the official repository's src folder")
    p.add_argument("--site", type=Path, help="a folder of packages the official code imports (pip --target)")
    p.add_argument("--root", type=Path, default=Path("data/bench_tvr"), help="the TVR-shaped collection")
    p.add_argument("--split", choices=["val", "test"], default="val")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--num-workers", type=int, default=0, help="DataLoader workers (official config: 32)")
    p.add_argument("--json", action="store_true", help="end with one JSON line of the figures")
    args = p.parse_args()
    src, root = args.src.resolve(), args.root.resolve()
    if not (src / "Configs" / "tvr.py").is_file():
        p.error(f"--src {args.src}: no Configs/tvr.py there (give the official repository's src folder)")
    marker = root / "synth.json"
    if not marker.is_file():
        p.error(f"--root {args.root}: no synth.json there (a collection bench_eval.py wrote)")
    collection = json.loads(marker.read_text())["collection"]
    sys.path.insert(0, str(src))
    if args.site is not None:
        sys.path.append(str(args.site.resolve()))  # after the venv's own torch and numpy

    import torch
    from torch import nn

    torch.set_num_threads(args.threads)
    torch.Tensor.cuda = lambda self, *a, **k: self
    nn.Module.cuda = lambda self, *a, **k: self
    work = Path(tempfile.mkdtemp(prefix="official-eval-"))  # the data symlink and the results folder
    atexit.register(shutil.rmtree, work, True)  # removed at exit (the symlink itself, not the collection)
    (work / "data").mkdir()
    (work / "data" / collection).symlink_to(root)
    makedirs = os.makedirs
    os.makedirs = lambda *a, **k: None
    try:
        import Configs.tvr as tvr_module
    finally:
        os.makedirs = makedirs
    cfg = tvr_module.cfg
    cfg.update(root=str(work / "results"), model_root=str(work / "results"), ckpt_path=str(work / "results" / "ckpt"),
               data_root=str(work / "data"), collection=collection, visual_feature="synth_feat",
               num_workers=args.num_workers)
    os.makedirs(cfg["ckpt_path"], exist_ok=True)

    from Configs.builder import get_configs
    from Datasets.builder import get_datasets
    from Models.builder import get_models
    from torch.utils.data import DataLoader
    from Utils.utils import set_seed
    from Validations.builder import get_validations

    seconds: dict[str, float] = {}

    def add(key: str, dt: float) -> None:
        seconds[key] = seconds.get(key, 0.0) + dt

    def timed(key, fn):
        def wrapper(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                add(key, time.perf_counter() - t0)
        return wrapper

    class TimedLoader(DataLoader):
        """The same loader, timing the wait for each batch."""

        timing_key = ""

        def __iter__(self):
            it = super().__iter__()
            while True:
                t0 = time.perf_counter()
                try:
                    batch = next(it)
                except StopIteration:
                    return
                finally:
                    add(self.timing_key, time.perf_counter() - t0)
                yield batch

    imports_s = time.perf_counter() - T_START
    cfg = get_configs("tvr")
    set_seed(cfg["seed"])
    t0 = time.perf_counter()
    cfg, _, val_videos, val_queries, test_videos, test_queries = get_datasets(cfg)
    setup_s = time.perf_counter() - t0
    videos, queries = (val_videos, val_queries) if args.split == "val" else (test_videos, test_queries)
    for loader, key in ((videos, "video_wait"), (queries, "query_wait")):
        loader.__class__ = TimedLoader
        loader.timing_key = key
    model = get_models(cfg)
    model.encode_context = timed("encode_videos", model.encode_context)
    validate = get_validations(cfg)
    validate.compute_context_info = timed("videos_total", validate.compute_context_info)
    rss_before = vm_kib("VmRSS")
    t0 = time.perf_counter()
    with torch.no_grad():
        metrics = validate(model, videos, queries)
    total = time.perf_counter() - t0
    figures = {
        "split": args.split, "videos": len(videos.dataset), "queries": len(queries.dataset),
        "setup_s": setup_s, "load_videos_s": seconds["video_wait"],
        "encode_videos_s": seconds["videos_total"] - seconds["video_wait"],
        "queries_score_metrics_s": total - seconds["videos_total"], "total_s": total,
        "peak_rss_gib": vm_kib("VmHWM") / 2**20, "rss_before_gib": rss_before / 2**20, "imports_s": imports_s,
    }
    print(f"official {src.parent.name} {args.split}: {figures['queries']} queries x {figures['videos']} videos, "
          f"fp32, {torch.get_num_threads()} threads, {args.num_workers} loader workers")
    print(f"  R@1/5/10/100/SumR (untrained): {' '.join(f'{float(v):.2f}' for v in metrics)}")
    print(f"  index set-up {setup_s:.2f} s (not in the total); videos: waiting for batches "
          f"{figures['load_videos_s']:.2f} s, encoding {figures['encode_videos_s']:.2f} s; queries + scoring + "
          f"metrics {figures['queries_score_metrics_s']:.2f} s; total {total:.2f} s")
    print(f"  peak RSS {figures['peak_rss_gib']:.2f} GiB ({figures['rss_before_gib']:.2f} GiB before the evaluation)")
    if args.json:
        print(json.dumps(figures))


if __name__ == "__main__":
    main()
