"""Which parameters a configuration's training step leaves out (for DDP's ``find_unused_parameters``).

A configuration can leave parameters out of every step: a branch of score
weight 0, a fusion switched off, GMMFormer's frame pooling when RAL's CSA
replaces the frame scores.  DDP refuses the second such step unless it looks
for unused parameters, which costs a walk of every step's autograd graph (and
prints a warning when it finds none).  :func:`unused_parameters` runs one
training forward of a copy of the system on a small synthetic batch and
reads which parameters the loss does not reach, so DDP searches only when
there is something to find.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from prvrlab.data.batch import Batch

FRAMES = (8, 5, 3)  # real frames of the probe's three videos
QUERIES = ((0, 4), (0, 2), (1, 3), (2, 5), (2, 1))  # (video, real tokens) of its five queries


def probe_batch(
    *, video_dim: int, query_dim: int, num_clips: int, device: torch.device, max_frames: int = 8, max_query_len: int = 5
) -> Batch:
    """Three videos with five queries (two videos with several, padding on both sides), random features;
    lengths capped by the data's ``max_frames`` / ``max_query_len``."""
    g = torch.Generator().manual_seed(0)
    frames = torch.tensor(FRAMES).clamp(max=max_frames)  # (B,)
    words = torch.tensor([n for _, n in QUERIES]).clamp(max=max_query_len)  # (Nq,)
    frames_len, query_len = int(frames.max()), int(words.max())
    return Batch(
        frames=torch.randn(len(FRAMES), frames_len, video_dim, generator=g).to(device),  # (B, Lf, Dv)
        frame_mask=(torch.arange(frames_len)[None] < frames[:, None]).to(device),  # (B, Lf)
        clips=torch.randn(len(FRAMES), num_clips, video_dim, generator=g).to(device),  # (B, Lc, Dv)
        queries=torch.randn(len(QUERIES), query_len, query_dim, generator=g).to(device),  # (Nq, Lq, Dq)
        query_mask=(torch.arange(query_len)[None] < words[:, None]).to(device),  # (Nq, Lq)
        query_video=torch.tensor([v for v, _ in QUERIES], device=device),  # (Nq,)
        video_ids=[f"probe-v{i}" for i in range(len(FRAMES))],
        query_ids=[f"probe-q{i}" for i in range(len(QUERIES))],
    )


def unused_parameters(system: nn.Module, batch: Batch, *, epoch: int = 0) -> list[str]:
    """Names of ``system``'s trainable parameters that the loss of one training forward on ``batch``
    does not depend on.  Runs on a copy (the system's state, gradients and random generators are left
    as they were); raises what the forward raises."""
    rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    try:
        probe = copy.deepcopy(system).train()
        if getattr(probe, "global_batch", False):  # each rank probes alone, with no collective: same parameters
            probe.global_batch = False
        named = [(name, p) for name, p in probe.named_parameters() if p.requires_grad]
        result, _ = probe(batch, epoch=epoch)
        grads = torch.autograd.grad(result.total, [p for _, p in named], allow_unused=True)
        return [name for (name, _), grad in zip(named, grads) if grad is None]
    finally:
        torch.set_rng_state(rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)
