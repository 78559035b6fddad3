"""The fused MS-SL retrieval kernel (prvrlab/models/window_best.cpp through window_best.py) against a
brute-force float64 loop and against MSSL's PyTorch path."""

from __future__ import annotations

import pytest
import torch
from test_backbones import build, make_batch

from prvrlab.models import native, window_best
from prvrlab.models.mssl import _window_bounds

pytestmark = pytest.mark.skipif(
    window_best.load() is None, reason=f"fused window kernel unavailable: {window_best.unavailable_reason()}"
)


def brute_force(dots, scale, max_window, unit, q_frame):
    """Every pair, every window, in float64: (top, first best, frame dot)."""
    nq, nv, length = dots.shape
    top = torch.empty(nq, nv, dtype=torch.float64)
    best = torch.empty(nq, nv, dtype=torch.int64)
    frame = torch.empty(nq, nv, dtype=torch.float64)
    for q in range(nq):
        for v in range(nv):
            values, p = [], 0
            for k in range(1, min(max_window, length) + 1):
                for s in range(length - k + 1):
                    values.append(dots[q, v, s : s + k].double().sum() * scale[v, p].double())
                    p += 1
            values = torch.stack(values)
            top[q, v] = values.max()
            best[q, v] = int(torch.nonzero(values == values.max())[0])
            frame[q, v] = unit[v, best[q, v]].double() @ q_frame[q].double()
    return top, best, frame


@pytest.mark.parametrize("length, max_window", [(8, 8), (8, 3), (5, 32), (1, 1), (13, 6)])
def test_kernel_equals_the_brute_force_loop(length, max_window):
    gen = torch.Generator().manual_seed(length * 31 + max_window)
    nq, nv, dim = 5, 4, 7
    props = window_best.num_proposals(length, max_window)
    dots = torch.randn(nq, nv, length, generator=gen)
    scale = torch.rand(nv, props, generator=gen) + 0.1
    unit = torch.randn(nv, props, dim, generator=gen)
    q_frame = torch.randn(nq, dim, generator=gen)
    top, best, frame = window_best.window_best(dots, scale, max_window, unit, q_frame)
    e_top, e_best, e_frame = brute_force(dots, scale, max_window, unit, q_frame)
    assert top.dtype == frame.dtype == torch.float32 and best.dtype == torch.int64
    torch.testing.assert_close(top.double(), e_top, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(best, e_best)
    torch.testing.assert_close(frame.double(), e_frame, atol=1e-5, rtol=1e-5)
    no_frame = window_best.window_best(dots, scale, max_window)
    assert no_frame[2] is None
    torch.testing.assert_close(no_frame[1], best)


def test_ties_go_to_the_first_proposal():
    # equal dots and equal scales: every window of length k scores k * 0.5 / k = 0.5
    dots = torch.ones(2, 3, 6)
    scale = (1.0 / _window_bounds(6, 6, torch.device("cpu"))[2])[None].expand(3, -1) * 0.5
    _, best, _ = window_best.window_best(dots, scale.contiguous(), 6)
    assert torch.equal(best, torch.zeros(2, 3, dtype=torch.int64))
    dots[:, :, 4] = 2.0  # now the single clip 4 (window p = 4) wins alone
    top, best, _ = window_best.window_best(dots, scale.contiguous(), 6)
    assert torch.equal(best, torch.full((2, 3), 4)) and torch.allclose(top, torch.full((2, 3), 1.0))


def test_kernel_rejects_shapes_that_do_not_fit():
    with pytest.raises(ValueError, match="scale must be"):
        window_best.window_best(torch.zeros(1, 2, 4), torch.zeros(2, 9), 4)  # 4 items, windows 1..4: 10
    with pytest.raises(ValueError, match="unit must be"):
        window_best.window_best(torch.zeros(1, 2, 4), torch.zeros(2, 10), 4, torch.zeros(2, 10, 3), torch.zeros(1, 2))


def test_usable_only_for_finite_float32_cpu_tensors():
    assert window_best.usable(torch.zeros(2, 3))
    assert not window_best.usable(torch.tensor([0.0, float("nan")]))
    assert not window_best.usable(torch.tensor([float("inf")]))
    assert not window_best.usable(torch.zeros(2, dtype=torch.float64))
    assert not window_best.usable(torch.zeros(2, device="meta"))


def scores_of(model, batch):
    with torch.inference_mode():
        video = model.encode_videos(batch.clips, batch.frames, batch.frame_mask)
        query = model.encode_queries(batch.queries, batch.query_mask)
        return query, model.index_videos(video)


def test_mssl_retrieval_through_the_kernel_equals_the_pytorch_path(monkeypatch):
    model = build("mssl").eval()
    b = make_batch([5, 3, 7, 1], [4, 2, 3, 5, 2], [0, 0, 1, 2, 3], frame_pad=2)
    query, index = scores_of(model, b)
    assert bool(index.extra["finite"].all())
    calls = []
    real = window_best.window_best
    monkeypatch.setattr(window_best, "window_best", lambda *a, **k: calls.append(1) or real(*a, **k))
    with torch.inference_mode():
        fused = model.score(query, index)
        assert calls  # the kernel ran
        monkeypatch.setattr(window_best, "load", lambda: None)
        plain = model.score(query, index)
    for branch in ("clip", "frame"):
        torch.testing.assert_close(fused[branch].sim, plain[branch].sim, atol=1e-5, rtol=1e-5)


def test_a_non_finite_gallery_or_query_keeps_the_pytorch_path(monkeypatch):
    model = build("mssl").eval()
    b = make_batch([5, 3, 4], [4, 2, 3], [0, 1, 2])
    query, index = scores_of(model, b)
    monkeypatch.setattr(window_best, "window_best", lambda *a, **k: pytest.fail("the kernel ran"))
    with torch.inference_mode():
        index.extra["attended_norm"][1, 0] = float("nan")
        index.extra["finite"][1] = False
        scores = model.score(query, index)
        assert scores["clip"].sim.isfinite().all()
        query.vectors["clip"][0, 0] = float("nan")
        index.extra["finite"][1] = True
        scores = model.score(query, index)
        assert scores["clip"].sim[0].isnan().all()


def test_index_marks_videos_with_non_finite_values():
    model = build("mssl").eval()
    b = make_batch([5, 3, 4], [4, 2, 3], [0, 1, 2])
    with torch.inference_mode():
        video = model.encode_videos(b.clips, b.frames, b.frame_mask)
        video.extra["clip_items"][2, 0, 0] = float("inf")
        assert model.index_videos(video).extra["finite"].tolist() == [True, True, False]


def test_the_kernel_library_is_built_from_its_own_source():
    lib = window_best.load()
    assert lib.prvrlab_window_abi() == window_best.ABI
    assert any(p.name.startswith("window_best-") for p in native.cache_dir().glob("*.so"))


@pytest.mark.parametrize("length, max_window", [(5, 0), (0, 4), (5, -1)])
def test_zero_proposals_are_refused_as_the_pytorch_maximum_over_none(length, max_window):
    """No window fits: the PyTorch path's ``max(dim=-1)`` over an empty dim has no answer either."""
    with pytest.raises(IndexError):
        torch.zeros(4, 3, 0).max(dim=-1)
    dots = torch.randn(4, 3, length)
    with pytest.raises(ValueError, match="at least one proposal"):
        window_best.window_best(dots, torch.rand(3, 0), max_window)
    with pytest.raises(ValueError, match="at least one proposal"):
        window_best.window_best(dots, torch.rand(3, 0), max_window, torch.rand(3, 0, 8), torch.rand(4, 8))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_unit_of_another_float_dtype_is_read_as_float32(dtype):
    """MSSL passes ``extra["attended"]`` as stored; its PyTorch path reads it through ``.float()``."""
    gen = torch.Generator().manual_seed(11)
    nq, nv, length, max_window, dim = 4, 6, 9, 4, 32
    props = window_best.num_proposals(length, max_window)
    dots = torch.randn(nq, nv, length, generator=gen)
    scale = torch.rand(nv, props, generator=gen) + 0.1
    unit = torch.randn(nv, props, dim, generator=gen).to(dtype)
    q_frame = torch.randn(nq, dim, generator=gen)
    top, best, frame = window_best.window_best(dots, scale, max_window, unit, q_frame)
    e_top, e_best, e_frame = brute_force(dots, scale, max_window, unit.float(), q_frame)
    assert frame.dtype == torch.float32
    torch.testing.assert_close(best, e_best)
    torch.testing.assert_close(frame.double(), e_frame, atol=1e-5, rtol=1e-5)


def test_inputs_the_kernel_cannot_read_are_refused():
    dots, scale = torch.randn(2, 3, 4), torch.rand(3, 10)
    unit, q_frame = torch.rand(3, 10, 5), torch.rand(2, 5)
    with pytest.raises(ValueError, match="dots must be float32"):
        window_best.window_best(dots.double(), scale, 4)
    with pytest.raises(ValueError, match="scale must be float32"):
        window_best.window_best(dots, scale.bfloat16(), 4)
    with pytest.raises(ValueError, match="q_frame must be float32"):
        window_best.window_best(dots, scale, 4, unit, q_frame.double())
    with pytest.raises(ValueError, match="unit must be a floating-point tensor"):
        window_best.window_best(dots, scale, 4, unit.to(torch.int32), q_frame)
    with pytest.raises(ValueError, match="dots must be a CPU tensor"):
        window_best.window_best(dots.to("meta"), scale, 4)
    with pytest.raises(ValueError, match="unit must be"):  # (V, P) read as (V, P, D)
        window_best.window_best(dots, scale, 4, torch.rand(3, 10), torch.rand(2, 10))
    with pytest.raises(ValueError, match="dots must be"):
        window_best.window_best(dots[0], scale, 4)
