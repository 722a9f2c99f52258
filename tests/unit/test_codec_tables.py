"""Pinned test vectors: sign tables, codebooks, and the quantizer's distortion on N(0, 1)."""

from __future__ import annotations

import math

import pytest
import torch

from turbowire.codec.codebooks import (
    GAUSSIAN_LLOYD_MAX,
    GAUSSIAN_LLOYD_MAX_MSE,
    boundaries,
    centroids,
    lloyd_max_gaussian,
)
from turbowire.codec.rotation import fwht, pairwise_sum, rotate, sign_tables, unrotate


def _mask(signs: torch.Tensor) -> int:
    """Compact form of research/turboquant.md §2: bit i set <=> signs[i] == -1."""
    return sum(1 << i for i, s in enumerate(signs.tolist()) if s < 0)


def test_sign_tables_match_public_turboquant_plus_tables() -> None:
    s1, s2 = sign_tables(128)
    assert _mask(s1) == 0x49F250A9A4C63BBB42F85949E46A0359
    assert _mask(s2) == 0xBEA56562B7A5357A3F628FDC16ACEE90


def test_sign_tables_256_continue_the_same_stream() -> None:
    s1_128, s2_128 = sign_tables(128)
    s1, s2 = sign_tables(256)
    assert torch.equal(s1, torch.cat([s1_128, s2_128]))
    assert _mask(s2) == 0x3B1BC075A315A9324ECE53067ED4F1A79CB5D453B22659E307365E2A5BDDCC66


@pytest.mark.parametrize("bits", sorted(GAUSSIAN_LLOYD_MAX))
def test_pinned_codebooks_equal_a_fresh_lloyd_iteration(bits: int) -> None:
    fresh = lloyd_max_gaussian(bits)
    pinned = centroids(bits).tolist()
    assert len(pinned) == 2**bits
    for a, b in zip(pinned, fresh):
        assert a == pytest.approx(b, abs=2e-6)


def test_four_bit_table_outer_level_is_not_the_narrow_port() -> None:
    # The llama.cpp port once shipped an outer 4-bit level of 1.97 sigma instead of 2.73.
    assert centroids(4)[-1].item() == pytest.approx(2.7325896, abs=1e-6)
    assert centroids(3)[-1].item() == pytest.approx(2.1519457, abs=1e-6)


@pytest.mark.parametrize("bits", sorted(GAUSSIAN_LLOYD_MAX_MSE))
def test_scalar_quantizer_distortion_on_gaussian(bits: int) -> None:
    g = torch.Generator().manual_seed(bits)
    x = torch.randn(400_000, generator=g)
    idx = torch.searchsorted(boundaries(bits), x)
    mse = (centroids(bits)[idx] - x).pow(2).mean().item()
    assert mse == pytest.approx(GAUSSIAN_LLOYD_MAX_MSE[bits], rel=0.03)


@pytest.mark.parametrize("n", [64, 128, 256])
def test_fwht_is_the_sylvester_hadamard_and_rotation_inverts(n: int) -> None:
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    x = torch.randn(5, n)
    assert torch.allclose(fwht(x), x @ h, atol=1e-4)
    assert torch.allclose(unrotate(rotate(x)) / n, x, atol=1e-5)
    # orthogonal up to sqrt(n)
    assert torch.allclose(rotate(x).norm(dim=-1), x.norm(dim=-1) * math.sqrt(n), rtol=1e-5)


def test_pairwise_sum_order_is_fixed() -> None:
    x = torch.tensor([1e8, 1.0, -1e8, 1.0])
    # ((1e8 + 1) + (-1e8 + 1)) in fp32: 1e8 + 1 rounds to 1e8, -1e8 + 1 rounds to -1e8.
    assert pairwise_sum(x).item() == 0.0
