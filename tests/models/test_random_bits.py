"""The dropout draws' random words (prvrlab/models/random_bits.py): the SplitMix64 sequence of a seed taken
from torch's default generator, computed here with Python integers; reproducible, independent of the thread
count, unbiased bits; torch's generator where the kernel is not available."""

from __future__ import annotations

import pytest
import torch

from prvrlab.models import random_bits
from prvrlab.models.blocks import dropout_draw, mask_from_draw

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
