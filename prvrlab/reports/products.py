"""Where a training step's matrix products lose time: every product timed by shape, against the machine's roof.

:class:`ProductTimer` is a ``TorchDispatchMode`` that times each matrix product dispatched inside it (``mm``,
``addmm``, ``bmm``, ``baddbmm`` and their in-place forms, ``mv``, ``addmv``, oneDNN's fused
``_linear_pointwise``; ``linear`` and ``matmul`` reach the dispatcher as these) and counts its FLOPs (a
multiply-add is 2).  :func:`product_lines` sums them up and lists the shapes that lost the most time against a
roof (GFLOP/s of a large product on the same machine): a product of ``F`` FLOPs taking ``t`` seconds lost
``t - F / roof``.  ``benchmarks/bench_model_step.py --products N`` prints it for each precision of a training
step.

Not timed: products inside this project's C++ kernels (called through ctypes, invisible to the dispatcher:
e.g. GMMFormer v2's branch mix in bf16, which float32 runs as ``bmm``), convolutions, and every other
operation; the share of the step left over is theirs, Python's and the autograd engine's.  Each product is
timed on the host: on a GPU the stream is synchronised before and after every product, so the figures are
meant for CPUs.  Dispatching through the mode adds a few microseconds a call.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# the products timed: the op's name as the dispatcher prints it (before the overload)
PRODUCT_OPS: tuple[str, ...] = (
    "aten.mm", "aten.addmm", "aten.addmm_", "aten.bmm", "aten.baddbmm", "aten.baddbmm_", "aten.mv", "aten.addmv",
    "mkldnn._linear_pointwise",
)


@dataclass
class ProductStat:
    """One (op, operand layout) of the products seen: calls, seconds and FLOPs summed over the calls."""

    op: str
    operands: str  # shapes, dtypes and 'T' for an operand that is not contiguous (a transposed view)
    calls: int = 0
    seconds: float = 0.0
    flops: float = 0.0

    def lost(self, roof_gflops: float) -> float:
        """Seconds over what the FLOPs take at ``roof_gflops``."""
        return self.seconds - self.flops / (roof_gflops * 1e9)


def product_flops(op: str, tensors: list[torch.Tensor], overload: str = "default") -> float:
    """FLOPs of one product from its tensor arguments (in call order; a bias or ``input`` first for
    ``addmm`` / ``baddbmm`` / ``addmv``; for ``_linear_pointwise`` the weight (out, in) second, or third in its
    ``binary`` ``overload`` (x, other, weight, bias))."""
    if op == "mkldnn._linear_pointwise":
        x, weight = tensors[0], tensors[2 if overload == "binary" else 1]
        return 2.0 * (x.numel() // max(1, x.shape[-1])) * weight.shape[1] * weight.shape[0]
    a, b = tensors[-2], tensors[-1]  # (M, K) @ (K, N) or (K,), or batched (B, M, K) @ (B, K, N)
    batch = a.shape[0] if a.dim() == 3 else 1
    columns = b.shape[-1] if b.dim() >= 2 else 1
    return 2.0 * batch * a.shape[-2] * a.shape[-1] * columns


def _operand(t: torch.Tensor) -> str:
    dtype = str(t.dtype).removeprefix("torch.")
    return f"{tuple(t.shape)}{'T' if not t.is_contiguous() else ''} {dtype}"  # 'T': any non-contiguous view


class ProductTimer(TorchDispatchMode):
    """Times every product of :data:`PRODUCT_OPS` dispatched while it is active (module docstring);
    ``stats`` maps (op, operands) to its :class:`ProductStat`."""

    def __init__(self) -> None:
        super().__init__()
        self.stats: dict[tuple[str, str], ProductStat] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        op = str(func.overloadpacket)
        if op not in PRODUCT_OPS:
            return func(*args, **kwargs)
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        cuda = next((t.device for t in tensors if t.is_cuda), None)  # the product's GPU (cuda:1 under --device cuda:1)
        if cuda is not None:
            torch.cuda.synchronize(cuda)
        start = time.perf_counter()
        out = func(*args, **kwargs)
        if cuda is not None:
            torch.cuda.synchronize(cuda)
        elapsed = time.perf_counter() - start
        operands = " x ".join(_operand(t) for t in tensors)
        stat = self.stats.setdefault((op, operands), ProductStat(op, operands))
        stat.calls += 1
        stat.seconds += elapsed
        stat.flops += product_flops(op, tensors, func._overloadname)
        return out


def product_lines(stats: list[ProductStat], roof_gflops: float, step_seconds: float, top: int, steps: int = 1) -> list[str]:
    """A summary line (the products' time and share of a step of ``step_seconds``, their GFLOP/s against
    ``roof_gflops``) and the ``top`` (op, operands) that lost the most time against the roof, per step over
    ``steps`` timed steps."""
    for name, value in (("roof_gflops", roof_gflops), ("step_seconds", step_seconds)):
        if not (value > 0 and math.isfinite(value)):
            raise ValueError(f"{name} must be a positive number, got {value}")
    if steps < 1 or top < 0:
        raise ValueError(f"steps must be >= 1 and top >= 0, got steps={steps}, top={top}")
    seconds = sum(s.seconds for s in stats) / steps
    flops = sum(s.flops for s in stats) / steps
    rate = flops / seconds / 1e9 if seconds > 0 else 0.0
    lines = [
        f"matrix products: {seconds * 1e3:.0f} ms a step ({seconds / step_seconds:.0%} of {step_seconds:.2f} s), "
        f"{flops / 1e9:.0f} GFLOP at {rate:.0f} GFLOP/s ({rate / roof_gflops:.0%} of the {roof_gflops:.0f} GFLOP/s roof); "
        f"at the roof they would take {flops / roof_gflops / 1e6:.0f} ms"
    ]
    ranked = sorted(stats, key=lambda s: s.lost(roof_gflops), reverse=True)[:top]
    if ranked:
        lines.append(f"  {'ms/step':>8} {'lost ms':>8} {'calls':>5} {'GFLOP/s':>8}  op: operands ('T': not contiguous)")
    for s in ranked:
        speed = s.flops / s.seconds / 1e9 if s.seconds > 0 else 0.0
        lines.append(
            f"  {s.seconds / steps * 1e3:8.1f} {s.lost(roof_gflops) / steps * 1e3:8.1f} {s.calls / steps:5.3g} "
            f"{speed:8.0f}  {s.op}: {s.operands}"
        )
    return lines
