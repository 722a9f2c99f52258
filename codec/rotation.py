"""Randomized Hadamard rotation y = S2 · H · S1 · x, as a deterministic fp32 butterfly.

The sign tables are the public TurboQuant+ tables: ``rng = numpy.random.default_rng(42)``,
``s1 = rng.choice([-1, 1], n)`` then ``s2 = rng.choice([-1, 1], n)``. H is the unnormalised
Sylvester Hadamard matrix (entries ±1), applied as log2(n) butterfly stages in a fixed order so that
a GPU kernel doing the same stages in fp32 produces the same bits (additions only, no FMA).
"""

from __future__ import annotations

import functools

import numpy as np
import torch

SIGN_SEED = 42
MAX_ROTATION = 256


@functools.lru_cache(maxsize=None)
def sign_tables(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(s1, s2) of length n as float32 tensors of ±1, regenerated from seed 42."""
    if n <= 0 or n & (n - 1):
        raise ValueError(f"rotation size must be a power of two, got {n}")
    rng = np.random.default_rng(SIGN_SEED)
    s1 = rng.choice([-1.0, 1.0], size=n)
    s2 = rng.choice([-1.0, 1.0], size=n)
    return (
        torch.from_numpy(s1.astype(np.float32)),
        torch.from_numpy(s2.astype(np.float32)),
    )


def signs_on(n: int, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    s1, s2 = sign_tables(n)
    return s1.to(device), s2.to(device)


def fwht(x: torch.Tensor) -> torch.Tensor:
    """Unnormalised Walsh-Hadamard transform over the last dim (x @ H, H Sylvester ±1).

    Stage h (h = 1, 2, 4, ...) pairs element i with i + h inside blocks of 2h and writes
    (a + b, a - b). fp32 in, fp32 out; applying it twice multiplies by n.
    """
    n = x.shape[-1]
    if n & (n - 1):
        raise ValueError(f"FWHT size must be a power of two, got {n}")
    lead = x.shape[:-1]
    h = 1
    while h < n:
        y = x.reshape(*lead, n // (2 * h), 2, h)
        a = y[..., 0, :]
        b = y[..., 1, :]
        x = torch.stack((a + b, a - b), dim=-2).reshape(*lead, n)
        h *= 2
    return x


def rotate(x: torch.Tensor) -> torch.Tensor:
    """u = s2 ⊙ FWHT(s1 ⊙ x) over the last dim (fp32). ‖u‖ = sqrt(n)·‖x‖."""
    s1, s2 = signs_on(x.shape[-1], x.device)
    return fwht(x * s1) * s2


def unrotate(u: torch.Tensor) -> torch.Tensor:
    """Inverse of ``rotate`` up to the factor n: s1 ⊙ FWHT(s2 ⊙ u) = n·x."""
    s1, s2 = signs_on(u.shape[-1], u.device)
    return fwht(u * s2) * s1


def pairwise_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum over the last dim (a power of two) by folding adjacent pairs, in a fixed order.

    Reductions whose order depends on the implementation would let a kernel and this reference
    disagree in the last bit; this order is the contract both follow.
    """
    n = x.shape[-1]
    if n & (n - 1):
        raise ValueError(f"pairwise_sum needs a power-of-two length, got {n}")
    while x.shape[-1] > 1:
        x = x[..., 0::2] + x[..., 1::2]
    return x[..., 0]
