"""``on_meta``: structure-only builds for config checks, without random initialisation.

Torch's meta ``normal_`` imports ``torch._dynamo`` on its first call (~1.6 s a
process: every search driver and trial actor validates configs), so the checks
skip the initialisers; the modules they build must keep the real structure.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

from prvrlab.models.factory import on_meta

from test_backbones import NAMES, build

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name", NAMES)
def test_same_parameters_and_buffers_as_a_real_build(name):
    real = build(name)
    with on_meta():
        meta = build(name)
    shapes = lambda m: {k: (tuple(v.shape), v.dtype) for k, v in [*m.named_parameters(), *m.named_buffers()]}
    assert shapes(meta) == shapes(real)
    assert all(p.is_meta for p in meta.parameters())


def test_initialisers_still_run_on_real_tensors_inside():
    with on_meta():
        weight = torch.zeros(64, 8, device="cpu")
        nn.init.normal_(weight, std=1.0)
        filled = torch.zeros(32, device="cpu").uniform_(1.0, 2.0)
    assert weight.std() > 0.5
    assert bool(((filled >= 1.0) & (filled <= 2.0)).all())


def test_initialisers_are_skipped_on_meta_tensors():
    with on_meta():
        weight = torch.empty(4, 4)
        assert nn.init.normal_(weight) is weight and weight.normal_() is weight and nn.init.trunc_normal_(weight) is weight
    assert weight.is_meta


def test_config_checks_load_neither_dynamo_nor_scipy_optimize(tmp_path):
    """Validating a config (model, losses, plug-ins built on meta; every loss module loaded by the
    registry, optimal_matching included) stays cheap in a fresh process."""
    script = textwrap.dedent(
        f"""
        import sys
        sys.path.insert(0, {str(REPO / 'tests' / 'platform')!r})
        from pathlib import Path
        from train_helpers import small_raw
        from prvrlab.platform.config import validate
        raw = small_raw(Path({str(tmp_path)!r}), Path({str(tmp_path)!r}))
        validate(raw)
        print(sorted(m for m in ("torch._dynamo", "scipy.optimize") if m in sys.modules))
        """
    )
    out = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_every_shipped_config_is_checked_without_dynamo():
    """Every backbone and plug-in of the shipped configs built on meta by validation (MamFusion's Mamba
    included: a meta ``arange`` would import torch._dynamo, so its S4D-real values are made on the CPU)."""
    script = textwrap.dedent(
        f"""
        import sys
        from pathlib import Path
        from prvrlab.platform.config import load_config
        names = set()
        for path in sorted(Path({str(REPO / 'configs')!r}).glob("*.yaml")):
            names.add(load_config(path).model["name"])
        print(sorted(names))
        print(sorted(m for m in ("torch._dynamo",) if m in sys.modules))
        """
    )
    out = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    built, loaded = out.stdout.strip().splitlines()[-2:]
    assert "mamfusion" in built and "gmmformer_v2" in built
    assert loaded == "[]"
