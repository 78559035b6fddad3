"""The dropout draws' random words (prvrlab/models/random_bits.py): the SplitMix64 sequence of a seed taken
from torch's default generator, computed here with Python integers; reproducible, independent of the thread
count, unbiased bits; torch's generator where the kernel is not available."""

from __future__ import annotations

import pytest
import torch

from prvrlab.models import random_bits
from prvrlab.models.blocks import apply_dropout_, dropout_draw, mask_from_draw

needs_kernel = pytest.mark.skipif(random_bits.load() is None, reason="no C++ compiler to build the kernel")
MASK = (1 << 64) - 1


def splitmix64(seed: int, i: int) -> int:
    """Word i of the SplitMix64 sequence of ``seed``, as a signed 64-bit integer."""
    z = (seed + (i + 1) * 0x9E3779B97F4A7C15) & MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    z ^= z >> 31
    return z - (1 << 64) if z >> 63 else z


@needs_kernel
def test_words_are_the_splitmix64_sequence_of_a_seed_from_the_default_generator():
    torch.manual_seed(123)
    seed = int(torch.empty((), dtype=torch.int64).random_())  # the one draw random_words takes
    torch.manual_seed(123)
    words = random_bits.random_words(200_003).tolist()  # more than one thread's range
    for i in (0, 1, 2, 65_535, 65_536, 100_001, 200_002):
        assert words[i] == splitmix64(seed, i)


@needs_kernel
def test_reproducible_and_independent_of_the_thread_count():
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        torch.manual_seed(7)
        one = random_bits.random_words(300_000)
        torch.set_num_threads(max(2, threads))
        torch.manual_seed(7)
        many = random_bits.random_words(300_000)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, many)
    assert not torch.equal(random_bits.random_words(300_000), many)  # the next draw moves on


def test_bits_unbiased_and_dropout_keeps_one_minus_p():
    torch.manual_seed(0)
    words = random_bits.random_words(100_000)
    bits = (words[:, None] >> torch.arange(64)) & 1  # (n, 64)
    frequency = bits.double().mean(0)
    assert (frequency - 0.5).abs().max() < 5 * (0.25 / 100_000) ** 0.5  # every bit position ~ fair
    p = 0.3
    kept = float(mask_from_draw(dropout_draw((400, 1000), p, torch.device("cpu")), p, torch.float32).ne(0).double().mean())
    assert abs(kept - (1 - p)) < 5 * (p * (1 - p) / 400_000) ** 0.5


def test_without_the_kernel_torch_generator_fills_the_words(monkeypatch):
    monkeypatch.setattr(random_bits, "load", lambda: None)
    torch.manual_seed(3)
    got = random_bits.random_words(1000)
    torch.manual_seed(3)
    want = torch.empty(1000, dtype=torch.int64).random_(-(2**63), None)
    assert torch.equal(got, want)


def hand_mask(seed: int, n: int, p: float, dtype: torch.dtype) -> torch.Tensor:
    """The dropout mask of ``random_mask``'s definition, by hand: element i keeps 1/(1-p) (rounded to
    ``dtype`` from the double) where lane i % 4 of word i // 4, as a signed 16-bit integer, is at least
    -32768 + round(65536 p)."""
    threshold, keep = -32768 + round(p * 65536), float(torch.tensor(1 / (1 - p), dtype=dtype))
    out = []
    for i in range(n):
        lane = (splitmix64(seed, i // 4) >> (16 * (i % 4))) & 0xFFFF
        lane = lane - (1 << 16) if lane >> 15 else lane
        out.append(keep if lane >= threshold else 0.0)
    return torch.tensor(out, dtype=dtype)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("n", [1, 3, 4, 7, 1_001])
def test_the_mask_kernel_is_the_lanes_of_the_words_against_the_threshold(dtype, n):
    p = 0.3
    torch.manual_seed(11)
    seed = int(torch.empty((), dtype=torch.int64).random_())
    torch.manual_seed(11)
    got = dropout_draw((n,), p, torch.device("cpu"), dtype)
    assert got.dtype == dtype and mask_from_draw(got, p, dtype) is got
    assert torch.equal(got, hand_mask(seed, n, p, dtype))


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("p", [0.1, 0.5, 0.0, 1 - 2**-18])
def test_a_mask_drawn_in_one_pass_equals_the_int16_draw_turned_into_a_mask(dtype, p):
    shape = (3, 70_001, 5)  # more than one thread's range; n % 4 == 1
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(max(2, threads))
        torch.manual_seed(4)
        want = mask_from_draw(dropout_draw(shape, p, torch.device("cpu")), p, dtype)
        torch.manual_seed(4)
        fast = dropout_draw(shape, p, torch.device("cpu"), dtype)
        torch.set_num_threads(1)
        torch.manual_seed(4)
        one_thread = dropout_draw(shape, p, torch.device("cpu"), dtype)
    finally:
        torch.set_num_threads(threads)
    assert (fast.dtype == dtype) == (p < 1 - 2**-17)  # else no element is kept: the int16 draw, as before
    if p >= 1 - 2**-17:
        assert not want.any()  # none kept (an int16 comparison with 32768 would wrap and keep every element)
    assert torch.equal(mask_from_draw(fast, p, dtype), want) and torch.equal(mask_from_draw(one_thread, p, dtype), want)
    assert torch.equal(mask_from_draw(fast[1, 5:9], p, dtype), want[1, 5:9])  # slices give the slices' masks


@needs_kernel
def test_a_mask_of_another_dtype_is_rescaled_to_the_asked_one_not_rounded_twice():
    p = 0.37  # 1/(1-p) rounded to float32 and then to bf16 is not always bf16's own rounding of it
    torch.manual_seed(9)
    wide = dropout_draw((4_000,), p, torch.device("cpu"), torch.float32)
    torch.manual_seed(9)
    narrow = dropout_draw((4_000,), p, torch.device("cpu"), torch.bfloat16)
    assert torch.equal(mask_from_draw(wide, p, torch.bfloat16), narrow)
    assert torch.equal(mask_from_draw(narrow, p, torch.float32), wide)


def test_without_the_kernel_a_mask_asked_for_comes_from_the_int16_draw(monkeypatch):
    monkeypatch.setattr(random_bits, "load", lambda: None)
    p = 0.25
    torch.manual_seed(2)
    draw = dropout_draw((50, 7), p, torch.device("cpu"), torch.bfloat16)
    assert draw.dtype == torch.int16
    torch.manual_seed(2)
    words = torch.empty((350 + 3) // 4, dtype=torch.int64).random_(-(2**63), None)
    lanes = words.view(torch.int16)[:350].view(50, 7)
    want = torch.where(lanes >= -32768 + round(p * 65536), torch.tensor(1 / (1 - p), dtype=torch.bfloat16), 0)
    assert torch.equal(mask_from_draw(draw, p, torch.bfloat16), want.to(torch.bfloat16))


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_deferred_draw_and_its_row_slices_give_the_written_masks_slices(dtype):
    p, shape = 0.2, (5, 7, 3)  # 21 elements a row: row offsets that are not whole words
    torch.manual_seed(8)
    want = dropout_draw(shape, p, torch.device("cpu"), dtype)
    after_written = torch.rand(3)
    torch.manual_seed(8)
    deferred = dropout_draw(shape, p, torch.device("cpu"), dtype, deferred=True)
    assert isinstance(deferred, random_bits.DeferredDraw)
    assert torch.equal(torch.rand(3), after_written)  # one draw of the default generator, as the written mask
    assert torch.equal(mask_from_draw(deferred, p, dtype), want)
    for index in (0, 3, -1, slice(1, 4), slice(2, None), slice(0, 0)):
        part = deferred[index]
        assert part.shape == tuple(want[index].shape)
        assert torch.equal(mask_from_draw(part, p, dtype), want[index])
    assert torch.equal(mask_from_draw(deferred[1:4][1], p, dtype), want[2])  # a slice of a slice
    with pytest.raises(IndexError):
        deferred[::2]
    with pytest.raises(IndexError):
        deferred[5]


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_deferred_mask_multiplied_in_place_equals_the_written_masks_product(dtype):
    """apply_dropout_ with a deferred draw (kernel: x * mask in float, rounded as torch rounds a product)
    gives x * mask exactly, signs of zeros and infinities included (NaN where it is NaN), with any thread
    count."""
    p = 0.3
    torch.manual_seed(12)
    x = (torch.randn(6, 40_001) * 50).to(dtype)  # 240,006 elements: more than two threads' least share
    x[0, :6] = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 0.0, -1e-30]).to(dtype)
    x[0, 6:10] = torch.tensor([1e-39, -1e-39, 2e-41, -3e-40], dtype=torch.float64).to(dtype)  # subnormal (fp32)
    deferred = dropout_draw(x.shape, p, torch.device("cpu"), dtype, deferred=True)
    want = x * mask_from_draw(deferred, p, dtype)
    threads = torch.get_num_threads()
    try:
        for count in (1, max(2, threads)):
            torch.set_num_threads(count)
            got = apply_dropout_(x.clone(), deferred, p)
            bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
            nan = want.isnan()
            assert torch.equal(got.isnan(), nan)  # NaN where x * mask is (a NaN's bits vary between torch's paths)
            assert torch.equal(got[~nan].view(bits), want[~nan].view(bits))  # bit for bit: signed zeros too
            row = apply_dropout_(x[3].clone(), deferred[3], p)  # starts at element 120,003: mid-word
            torch.testing.assert_close(row, want[3], rtol=0, atol=0, equal_nan=True)
            rows = apply_dropout_(x[1:5].clone(), deferred[1:5], p)  # 160,004 elements from 40,001
            torch.testing.assert_close(rows, want[1:5], rtol=0, atol=0, equal_nan=True)
    finally:
        torch.set_num_threads(threads)
    strided = x.t().contiguous().t()  # not contiguous: the written mask's product
    assert not strided.is_contiguous()
    torch.testing.assert_close(apply_dropout_(strided, deferred, p), want, rtol=0, atol=0, equal_nan=True)


def test_without_the_kernel_no_draw_is_deferred(monkeypatch):
    monkeypatch.setattr(random_bits, "load", lambda: None)
    draw = dropout_draw((4, 5), 0.1, torch.device("cpu"), torch.float32, deferred=True)
    assert isinstance(draw, torch.Tensor) and draw.dtype == torch.int16


@needs_kernel
def test_deferred_draws_refuse_other_shapes_and_thresholds_and_leave_recorded_tensors_to_autograd():
    draw = dropout_draw((4, 6), 0.1, torch.device("cpu"), torch.float32, deferred=True)
    with pytest.raises(ValueError, match="shape"):
        random_bits.apply_mask_(torch.ones(6, 4), draw, -26214, 1.0)
    with pytest.raises(ValueError, match="shape"):
        random_bits.random_mask((6, 4), -26214, torch.tensor(1.0), draw)
    with pytest.raises(ValueError, match="int16"):
        random_bits.apply_mask_(torch.ones(4, 6), draw, 32768, 1.0)
    x = torch.ones(4, 6, requires_grad=True)
    assert not random_bits.apply_mask_(x, draw, -26214, 1.0)  # autograd records x: left to x * mask
    y = torch.ones(4, 6)
    version = y._version
    assert random_bits.apply_mask_(y, draw, -26214, 1.0) and y._version > version  # counted as an in-place write
    assert not mask_from_draw(draw, 1 - 2**-18, torch.float32).any()  # p this close to 1 keeps none


def test_a_deferred_draw_takes_integers_and_slices_only_and_leaves_inference_tensors_to_mul():
    draw = dropout_draw((4, 6), 0.1, torch.device("cpu"), torch.float32, deferred=True)
    assert draw[torch.tensor(2)].offset == draw[2].offset == draw[-2].offset == 12  # any integer: row 2 of 4 x 6
    for index in (True, 1.0, None):  # a bool would be row 1 otherwise; a tensor's t[True] adds a dimension
        with pytest.raises(IndexError, match="an integer or a step-1 slice"):
            draw[index]
    with torch.inference_mode():
        frozen = torch.ones(4, 6)
    assert not random_bits.apply_mask_(frozen, draw, -26214, 1.0)  # mul_ refuses it outside inference mode
    assert (frozen == 1).all()
    with torch.inference_mode():
        assert random_bits.apply_mask_(frozen, draw, -26214, 1.0)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_deferred_dropout_equals_the_written_masks_product_forward_and_backward(dtype):
    """fast_dropout on CPU (blocks._DeferredDropout, the mask never written) gives x * dropout_mask(x, p) after
    the same generator state, bit for bit (NaN where it is NaN), and the gradient g * mask; out of place: x
    is left as it was; with any thread count."""
    from prvrlab.models.blocks import dropout_mask, fast_dropout

    p = 0.25
    gen = torch.Generator().manual_seed(3)
    x = (torch.randn(7, 30_011, generator=gen) * 20).to(dtype)  # more than two threads' least share
    x[0, :5] = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 1e-30]).to(dtype)
    g = torch.randn(7, 30_011, generator=gen).to(dtype)
    bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
    threads = torch.get_num_threads()
    try:
        for count in (1, max(2, threads)):
            torch.set_num_threads(count)
            torch.manual_seed(21)
            mask = dropout_mask(x, p)
            want, want_grad = x * mask, g * mask
            torch.manual_seed(21)
            leaf = x.clone().requires_grad_()
            got = fast_dropout(leaf, p, training=True)
            assert got.grad_fn is not None and got.grad_fn.name() == "_DeferredDropoutBackward"
            got.backward(g)
            assert torch.equal(leaf.detach().view(bits), x.view(bits))  # the input is untouched
            for a, b in ((got.detach(), want), (leaf.grad, want_grad)):
                nan = b.isnan()
                assert torch.equal(a.isnan(), nan)
                assert torch.equal(a[~nan].view(bits), b[~nan].view(bits))
    finally:
        torch.set_num_threads(threads)
    assert fast_dropout(x, p, training=False) is x
    torch.manual_seed(5)
    strided = x.t()  # not contiguous: made contiguous first, the same values
    got = fast_dropout(strided, p, training=True)
    torch.manual_seed(5)
    torch.testing.assert_close(got, strided * dropout_mask(strided, p), rtol=0, atol=0, equal_nan=True)


@needs_kernel
def test_deferred_dropout_is_differentiable_twice():
    """The backward of fast_dropout's unwritten-mask product is the same product, recorded: a gradient of the
    gradient is the mask again (as for x * dropout_mask(x, p))."""
    from prvrlab.models.blocks import dropout_mask, fast_dropout

    x = torch.randn(5, 300, requires_grad=True)
    c = torch.randn(5, 300, requires_grad=True)
    e = torch.randn(5, 300)
    torch.manual_seed(4)
    y = fast_dropout(x, 0.4, training=True)
    (gx,) = torch.autograd.grad((y * c).sum(), x, create_graph=True)  # c * mask, a function of c
    (gc,) = torch.autograd.grad((gx * e).sum(), c)  # e * mask
    torch.manual_seed(4)
    mask = dropout_mask(x, 0.4)
    assert torch.equal(gx.detach(), c.detach() * mask) and torch.equal(gc, e * mask)
