"""The selective scan (prvrlab/models/mamba.py) against the step-by-step recurrence and a dense
attention layer, and MamFusion's query-conditioned retrieval against its factorised one.

1. Scan forward + backward at B x L x E with an N-dimensional state (default
   128 x 128 x 768, N = 16): the fused C++ kernel (prvrlab/models/fused_scan.py,
   what ``kernel: auto`` runs on CPU), the PyTorch chunked scan (one line per
   chunk length), the step-by-step recurrence (``selective_scan_reference``)
   and, as a yardstick, a dense attention layer of the same width
   (prvrlab's TransformerLayer with no feed-forward sublayer, E wide, on the
   same B x L tokens).  Prints wall and CPU seconds (the CPU time of this
   process is the steadier figure on a shared machine) and the ratios
   reference / fused and reference / chunked (goal >= 20) and fused /
   attention (goal <= 3).  The recurrence is timed over all L steps by
   default (its autograd graph grows with every step, so later steps cost
   more: timing the first steps and scaling underestimates it 4x at B = 128);
   ``--reference-steps K`` times the first K and scales by L / K.
2. Retrieval ms per query of MamFusion (TVR dims, hidden 384) against a
   gallery of encoded videos: ``fusion: batch`` (factorised scores, the
   reference's) and ``fusion: temporal`` with ``fusion_at_retrieval: true``
   (every query x video pair fused), same weights.

    .venv/bin/python benchmarks/bench_mamba_scan.py
    .venv/bin/python benchmarks/bench_mamba_scan.py --threads 1 --gallery 0 --reference-steps 32
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from prvrlab.models.gmm import TransformerLayer
from prvrlab.models import fused_scan
from prvrlab.models.mamba import selective_scan, selective_scan_chunked, selective_scan_reference
from prvrlab.registry import BACKBONES


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--length", type=int, default=128)
    p.add_argument("--channels", type=int, default=768)
    p.add_argument("--state", type=int, default=16)
    p.add_argument("--chunks", type=int, nargs="+", default=[16, 32, 64])
    p.add_argument("--heads", type=int, default=8, help="heads of the attention yardstick")
    p.add_argument("--repeats", type=int, default=2, help="timed repetitions (after one warm-up)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--skip-reference", action="store_true")
    p.add_argument("--reference-steps", type=int, default=0, help="steps of the recurrence timed (0: all L)")
    p.add_argument("--block-elements", type=int, default=None, help="state elements per block of the chunked scan")
    p.add_argument("--gallery", type=int, default=200, help="videos in the retrieval gallery (0: skip part 2)")
    p.add_argument("--queries", type=int, default=20, help="queries scored in part 2")
    p.add_argument("--frames", type=int, default=128)
    return p.parse_args()


def timed(fn, repeats: int) -> float:
    """Median wall seconds of ``fn()`` over ``repeats`` runs after one warm-up."""
    return timed_both(fn, repeats)[0]


def timed_both(fn, repeats: int) -> tuple[float, float]:
    """Median (wall, CPU-of-this-process) seconds of ``fn()`` over ``repeats`` runs after one warm-up."""
    fn()
    walls, cpus = [], []
    for _ in range(repeats):
        w0, c0 = time.perf_counter(), time.process_time()
        fn()
        walls.append(time.perf_counter() - w0)
        cpus.append(time.process_time() - c0)
    return sorted(walls)[len(walls) // 2], sorted(cpus)[len(cpus) // 2]


def scan_inputs(args: argparse.Namespace) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    B, L, E, N = args.batch, args.length, args.channels, args.state
    x = torch.randn(B, L, E, generator=g)
    delta = F.softplus(torch.randn(B, L, E, generator=g))  # MamFusion's initial delta is softplus(0) = 0.69
    A = -torch.arange(1, N + 1, dtype=torch.float32).repeat(E, 1)  # S4D-real
    Bm, Cm = torch.randn(B, L, N, generator=g), torch.randn(B, L, N, generator=g)
    D = torch.ones(E)
    return [t.requires_grad_() for t in (x, delta, A, Bm, Cm, D)]


def forward_backward(fn, inputs):
    def run():
        for t in inputs:
            t.grad = None
        fn(*inputs).sum().backward()

    return run


def bench_scan(args: argparse.Namespace) -> None:
    inputs = scan_inputs(args)
    print(f"scan forward+backward, B={args.batch} L={args.length} E={args.channels} N={args.state}, "
          f"{args.threads} thread(s): wall s / CPU s")
    blocking = {} if args.block_elements is None else {"block_elements": args.block_elements}
    chunked = {}
    for chunk in args.chunks:
        fn = forward_backward(lambda *a: selective_scan_chunked(*a, chunk=chunk, **blocking), inputs)
        chunked[chunk] = timed_both(fn, args.repeats)
        print(f"  chunked scan, chunk {chunk:3d}: {chunked[chunk][0]:8.3f} / {chunked[chunk][1]:8.3f}")
    best = min(chunked, key=lambda c: chunked[c][1])
    fused = None
    if fused_scan.load() is None:
        print(f"  fused kernel unavailable: {fused_scan.unavailable_reason()}")
    else:
        fn = forward_backward(lambda *a: selective_scan(*a, chunk=max(args.chunks), kernel="fused"), inputs)
        fused = timed_both(fn, args.repeats)
        print(f"  fused C++ kernel, chunk {max(args.chunks):3d}: {fused[0]:8.3f} / {fused[1]:8.3f}")
    tokens = torch.randn(args.batch, args.length, args.channels, requires_grad=True)
    layer = TransformerLayer(hidden_size=args.channels, num_heads=args.heads, dropout=0.0, ffn_size=0)
    attention = timed_both(forward_backward(layer, [tokens]), args.repeats)
    print(f"  dense attention layer ({args.heads} heads, width {args.channels}): {attention[0]:8.3f} / {attention[1]:8.3f}")
    fastest = ("fused", fused) if fused is not None else (f"chunked (chunk {best})", chunked[best])
    print(f"  {fastest[0]} / attention: {fastest[1][0] / attention[0]:6.2f}x wall, "
          f"{fastest[1][1] / attention[1]:6.2f}x CPU (goal <= 3)")
    if not args.skip_reference:
        steps = args.length if args.reference_steps <= 0 else min(args.reference_steps, args.length)
        short = [t[:, :steps] if t.dim() == 3 else t for t in inputs]  # x, delta, B, C cut to the first steps
        short = [t.detach().requires_grad_() for t in short]
        scale = args.length / steps
        wall, cpu = timed_both(forward_backward(selective_scan_reference, short), max(1, args.repeats // 2))
        reference = (wall * scale, cpu * scale)
        note = "" if steps == args.length else f" ({steps} steps timed, x {scale:g})"
        print(f"  step-by-step recurrence{note}: {reference[0]:8.3f} / {reference[1]:8.3f}")
        rows = ([("fused", fused)] if fused is not None else []) + [(f"chunked (chunk {best})", chunked[best])]
        for name, (wall_s, cpu_s) in rows:
            print(f"  recurrence / {name}: {reference[0] / wall_s:6.2f}x wall, {reference[1] / cpu_s:6.2f}x CPU (goal >= 20)")


def bench_retrieval(args: argparse.Namespace) -> None:
    g = torch.Generator().manual_seed(0)
    dims = {"video_dim": 3072, "query_dim": 768, "hidden_size": 384, "max_frames": args.frames}
    torch.manual_seed(0)
    factorised = BACKBONES.build("mamfusion", **dims).eval()
    torch.manual_seed(0)
    conditioned = BACKBONES.build("mamfusion", fusion="temporal", fusion_at_retrieval=True, **dims).eval()
    conditioned.load_state_dict(factorised.state_dict())
    n, f = args.gallery, args.frames
    clips, frames = torch.randn(n, 32, 3072, generator=g), torch.randn(n, f, 3072, generator=g)
    mask = torch.ones(n, f, dtype=torch.bool)
    queries, qmask = torch.randn(args.queries, 30, 768, generator=g), torch.ones(args.queries, 30, dtype=torch.bool)
    print(f"\nretrieval, {args.queries} queries x {n} videos ({f} frames), hidden 384")
    results = {}
    with torch.inference_mode():
        for name, model in (("fusion: batch (factorised)", factorised), ("temporal at retrieval", conditioned)):
            t0 = time.perf_counter()
            video = model.encode_videos(clips, frames, mask)
            encode = time.perf_counter() - t0

            def score(model=model, video=video):
                return model.fuse(model.score(model.encode_queries(queries, qmask), video))

            seconds = timed(score, 1)
            results[name] = seconds
            print(f"  {name:28s}: encode gallery {encode:6.2f} s, {1000 * seconds / args.queries:9.2f} ms/query")
    ratio = results["temporal at retrieval"] / results["fusion: batch (factorised)"]
    print(f"  query-conditioned / factorised: {ratio:.1f}x per query")


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    bench_scan(args)
    if args.gallery:
        bench_retrieval(args)


if __name__ == "__main__":
    main()
