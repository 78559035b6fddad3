"""The reference optimiser recipe (REFERENCE.md §5).

Adam-style updates without bias correction, weight decay decoupled from the
gradient (added to the update, not to the gradient) and not applied to biases
or LayerNorm gains, linear warm-up over the first steps then linear decay to
zero.  Gradient clipping: each parameter tensor to ``max_grad_norm`` inside
:meth:`BertAdam.step` (the reference, ``train.clip_grad: per_tensor``) or the
global norm by the trainer (``global``).  A prvrlab tensor that holds several of
the reference's (all branches' Q/K/V in one projection, K branches' maps or
LayerNorm affines in one (K, ...) tensor) is clipped block by block, as the
reference's separate tensors are: its module names it in ``clip_parts``
(:func:`clip_blocks`); tensors that are one of the reference's (Q and K|V held
apart where the reference packs them) are clipped together: ``clip_together``
(:func:`clip_joint`).
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor, nn

from prvrlab.models import adam_step

Warmup = Literal["official", "shifted"]
WARMUPS: tuple[str, ...] = ("official", "shifted")
NORM_MODULES = (nn.LayerNorm, nn.GroupNorm, nn.modules.batchnorm._BatchNorm)


class BertAdam(torch.optim.Optimizer):
    """Adam without bias correction and with decoupled weight decay.

    update = m / (sqrt(v) + eps) + weight_decay * p;  p -= lr * update

    ``max_grad_norm > 0`` first rescales each parameter's gradient to at most
    that L2 norm, tensor by tensor (as the reference BertAdam); 0: no clipping.
    Under a GradScaler the gradients reaching :meth:`step` are already unscaled.

    ``fused``: update float32 CPU parameters in one pass where :func:`prvrlab.models.adam_step.takes` them (the
    foreach form's roundings but a correctly rounded square root); other tensors, or without the built kernel,
    take the foreach form.

    ``clip_blocks``: parameter -> n, a tensor clipped as n equal blocks along its first dimension, each to
    ``max_grad_norm`` on its own (:func:`clip_blocks`); ``clip_joint``: groups of parameters clipped as one
    tensor, by their joint norm (:func:`clip_joint`).  Their gradients are scaled in place, as the
    reference's ``clip_grad_norm_`` scales each of its tensors.
    """

    def __init__(
        self,
        params,
        *,
        lr: float,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.0,
        max_grad_norm: float = 0.0,
        fused: bool = True,
        clip_blocks: dict[Tensor, int] | None = None,
        clip_joint: list[tuple[Tensor, ...]] | None = None,
    ) -> None:
        if lr <= 0:
            raise ValueError(f"lr must be > 0, got {lr}")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"betas must be in [0, 1), got {betas}")
        if max_grad_norm < 0:
            raise ValueError(f"max_grad_norm must be >= 0 (0: no clipping), got {max_grad_norm}")
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, max_grad_norm=max_grad_norm)
        super().__init__(params, defaults)
        self.fused = fused
        self.clip_blocks = dict(clip_blocks or {})
        for p, n in self.clip_blocks.items():
            if n < 1 or p.dim() == 0 or p.shape[0] % n:
                raise ValueError(f"clip_blocks: {n} blocks do not divide a parameter of shape {tuple(p.shape)}")
        self.clip_joint = [tuple(members) for members in clip_joint or ()]
        joined = [p for members in self.clip_joint for p in members]
        if len({id(p) for p in joined}) < len(joined) or any(p in self.clip_blocks for p in joined):
            raise ValueError("clip_joint: a parameter is in two clipping units")
        self._layout: tuple[tuple, tuple] | None = None  # (key, tensors) of :meth:`_unit_layout`: the current units

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[override]
        loss = closure() if closure is not None else None
        clipped = self._clip_units()
        for group in self.param_groups:
            params: list[Tensor] = []
            grads: list[Tensor] = []
            exp_avg: list[Tensor] = []
            exp_sq: list[Tensor] = []
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                params.append(p)
                grads.append(p.grad)
                exp_avg.append(state["exp_avg"])
                exp_sq.append(state["exp_avg_sq"])
            if not params:
                continue
            max_norm = group.get("max_grad_norm", self.defaults["max_grad_norm"])  # absent from older checkpoints
            scales = None
            if max_norm > 0:
                norms = torch._foreach_norm(grads)  # one 0-dim norm per tensor
                scales = [(max_norm / (n + 1e-6)).clamp_(max=1.0) for n in norms]
                for i, p in enumerate(params):
                    if id(p) in clipped:
                        scales[i] = torch.ones_like(scales[i])  # clipped with its unit already
            b1, b2 = group["betas"]
            if self.fused and adam_step.takes(params, grads, exp_avg, exp_sq):
                adam_step.step(params, grads, exp_avg, exp_sq, scales=None if scales is None else [float(s) for s in scales],
                               lr=group["lr"], b1=b1, b2=b2, eps=group["eps"], weight_decay=group["weight_decay"])
                continue
            if scales is not None:
                grads = torch._foreach_mul(grads, scales)
            torch._foreach_mul_(exp_avg, b1)
            torch._foreach_add_(exp_avg, grads, alpha=1 - b1)
            torch._foreach_mul_(exp_sq, b2)
            torch._foreach_addcmul_(exp_sq, grads, grads, value=1 - b2)
            denom = torch._foreach_sqrt(exp_sq)
            torch._foreach_add_(denom, group["eps"])
            update = torch._foreach_div(exp_avg, denom)
            if group["weight_decay"] > 0:
                torch._foreach_add_(update, params, alpha=group["weight_decay"])
            torch._foreach_add_(params, update, alpha=-group["lr"])
        return loss

    def _clip_units(self) -> set[int]:
        """Clip the gradients of :attr:`clip_blocks`' blocks and :attr:`clip_joint`'s groups in place, each
        unit to its group's ``max_grad_norm`` by its own norm; the ids of the parameters they cover."""
        if not (self.clip_blocks or self.clip_joint):
            return set()
        limit = {id(p): g.get("max_grad_norm", self.defaults["max_grad_norm"]) for g in self.param_groups for p in g["params"]}
        units: list[tuple[list[Tensor], float]] = []
        covered: set[int] = set()
        for p, n in self.clip_blocks.items():
            if p.grad is not None and limit.get(id(p), 0.0) > 0:
                units += [([part], limit[id(p)]) for part in p.grad.chunk(n, 0)]
                covered.add(id(p))
        for members in self.clip_joint:
            live = [p for p in members if p.grad is not None]
            if live and limit.get(id(live[0]), 0.0) > 0:
                units.append(([p.grad for p in live], limit[id(live[0])]))
                covered.update(id(p) for p in live)
        if not units:
            return covered
        flat = [t for tensors, _ in units for t in tensors]
        norms = torch.stack(torch._foreach_norm(flat))  # (T,) one norm per tensor
        unit, single, limits = self._unit_layout(tuple((len(tensors), m) for tensors, m in units), norms)
        if unit is not None:  # a joint unit's L2 norm; a one-tensor unit keeps its own norm exactly
            joint = norms.new_zeros(len(units)).index_add_(0, unit, norms.square()).sqrt()[unit]  # (T,)
            norms = torch.where(single, norms, joint)
        torch._foreach_mul_(flat, list((limits / (norms + 1e-6)).clamp_(max=1.0).unbind()))
        return covered

    def _unit_layout(self, shape: tuple[tuple[int, float], ...], norms: Tensor) -> tuple[Tensor | None, Tensor | None, Tensor]:
        """For units of (tensor count, limit) ``shape``: each tensor's unit index and whether its unit is one
        tensor (None, None without joint units), and each tensor's limit, on ``norms``' device and dtype;
        built once per shape (it changes only when a gradient goes missing), so a GPU step copies nothing."""
        key = (shape, norms.device, norms.dtype)
        if self._layout is None or self._layout[0] != key:
            limits = torch.tensor([m for n, m in shape for _ in range(n)], dtype=norms.dtype, device=norms.device)
            unit = single = None
            if any(n > 1 for n, _ in shape):
                unit = torch.tensor([u for u, (n, _) in enumerate(shape) for _ in range(n)], device=norms.device)
                single = torch.tensor([n == 1 for n, _ in shape for _ in range(n)], device=norms.device)
            self._layout = (key, (unit, single, limits))
        return self._layout[1]


def clip_blocks(model: nn.Module) -> dict[Tensor, int]:
    """Each parameter of ``model`` that holds several of the reference's tensors -> how many (equal blocks
    along its first dimension): its modules' ``clip_parts``, parameter names under the module -> count."""
    found: dict[Tensor, int] = {}
    for module in model.modules():
        for name, count in getattr(module, "clip_parts", {}).items():
            p = module.get_parameter(name)
            if p.requires_grad and count > 1:
                found[p] = count
    return found


def clip_joint(model: nn.Module) -> list[tuple[Tensor, ...]]:
    """Groups of ``model``'s parameters that are one tensor of the reference's (clipped by their joint norm):
    its modules' ``clip_together``, tuples of parameter names under the module."""
    groups = []
    for module in model.modules():
        for names in getattr(module, "clip_together", ()):
            members = tuple(module.get_parameter(name) for name in names)
            if all(p.requires_grad for p in members):
                groups.append(members)
    return groups


def no_decay(module: nn.Module, name: str, p: Tensor) -> bool:
    """Whether ``module``'s own parameter ``name`` is exempt from weight decay.

    Exempt (the BERT convention the reference follows, plus scalars): every
    parameter of a norm module (LayerNorm, GroupNorm, BatchNorm); a name
    ending in ``bias``; a name listed in the module's ``norm_parameters``
    (the gains and biases of LayerNorms kept as plain parameters, e.g. the
    per-branch affines of GMMBlock); a 0-dim parameter (a learnable loss
    temperature or scale: decay would pull it towards 0, i.e. temperature 1
    for a log-temperature, which is no regularisation of the weights).
    A name listed in the module's ``decayed_parameters`` is decayed whatever
    the rules above say (a reference whose name-based grouping decays it).
    """
    if name in getattr(module, "decayed_parameters", ()):
        return False
    if isinstance(module, NORM_MODULES) or name.endswith("bias") or p.dim() == 0:
        return True
    return name in getattr(module, "norm_parameters", ())


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Two groups: decayed weights, and the parameters :func:`no_decay` exempts (no decay)."""
    decay, exempt = [], []
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            if p.requires_grad:
                (exempt if no_decay(module, name, p) else decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}]
    if exempt:
        groups.append({"params": exempt, "weight_decay": 0.0})
    return groups


def warmup_linear(total_steps: int, warmup_proportion: float, warmup: Warmup = "official"):
    """LR multiplier of step s (0-based): linear warm-up over W = proportion * total steps, then
    linear decay (T - s) / (T - W) to 0.

    Warm-up ``official`` (the reference): s / W, so the first step has lr 0;
    ``shifted``: min(1, (s + 1) / W), so no step is wasted and step ceil(W) - 1 (W - 1 for a
    whole W) reaches the full lr, never more (a fractional W would otherwise overshoot it).
    """
    if warmup not in WARMUPS:
        raise ValueError(f"warmup must be one of {', '.join(WARMUPS)}, got {warmup!r}")
    total_steps = max(1, total_steps)
    length = warmup_proportion * total_steps
    shift = 1 if warmup == "shifted" else 0

    def factor(step: int) -> float:
        if length > 0 and step < length:
            return min(1.0, (step + shift) / length)
        if total_steps <= length:
            return 1.0
        return max(0.0, (total_steps - step) / (total_steps - length))

    return factor


def build_optimizer(
    model: nn.Module,
    *,
    lr: float,
    weight_decay: float,
    total_steps: int,
    warmup_proportion: float,
    warmup: Warmup = "official",
    max_grad_norm: float = 0.0,
    fused: bool = True,
):
    """The optimiser (per-tensor clipping at ``max_grad_norm``, 0: none, each of the reference's tensors on its
    own: :func:`clip_blocks`, :func:`clip_joint`; ``fused``: as :class:`BertAdam`'s) and its LambdaLR schedule."""
    opt = BertAdam(param_groups(model, weight_decay), lr=lr, weight_decay=weight_decay, max_grad_norm=max_grad_norm,
                   fused=fused, clip_blocks=clip_blocks(model), clip_joint=clip_joint(model))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_linear(total_steps, warmup_proportion, warmup))
    return opt, sched
