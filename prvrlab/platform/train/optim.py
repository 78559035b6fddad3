"""The reference optimiser recipe (REFERENCE.md §5).

Adam-style updates without bias correction, weight decay decoupled from the
gradient (added to the update, not to the gradient) and not applied to biases
or LayerNorm weights, linear warm-up over the first steps then linear decay to
zero.  Gradient clipping is done by the trainer.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


class BertAdam(torch.optim.Optimizer):
    """Adam without bias correction and with decoupled weight decay.

    update = m / (sqrt(v) + eps) + weight_decay * p;  p -= lr * update
    """

    def __init__(
        self,
        params,
        *,
        lr: float,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.0,
    ) -> None:
        if lr <= 0:
            raise ValueError(f"lr must be > 0, got {lr}")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"betas must be in [0, 1), got {betas}")
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[override]
        loss = closure() if closure is not None else None
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
            b1, b2 = group["betas"]
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


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Two groups: decayed weights, and biases / norm weights without decay."""
    decay, no_decay = [], []
    for module_name, module in model.named_modules():
        for name, p in module.named_parameters(recurse=False):
            if not p.requires_grad:
                continue
            is_norm = isinstance(module, (nn.LayerNorm, nn.GroupNorm, nn.BatchNorm1d))
            if name.endswith("bias") or is_norm:
                no_decay.append(p)
            else:
                decay.append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups


def warmup_linear(total_steps: int, warmup_proportion: float):
    """LR multiplier: linear warm-up over the first steps, then linear decay to 0."""
    total_steps = max(1, total_steps)
    warmup = warmup_proportion * total_steps

    def factor(step: int) -> float:
        if warmup > 0 and step < warmup:
            return (step + 1) / warmup
        if total_steps <= warmup:
            return 1.0
        return max(0.0, (total_steps - step) / (total_steps - warmup))

    return factor


def build_optimizer(model: nn.Module, *, lr: float, weight_decay: float, total_steps: int, warmup_proportion: float):
    """The optimiser and its LambdaLR schedule."""
    opt = BertAdam(param_groups(model, weight_decay), lr=lr, weight_decay=weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_linear(total_steps, warmup_proportion))
    return opt, sched
