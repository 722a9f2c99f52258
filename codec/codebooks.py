"""Lloyd-Max scalar codebooks for a unit-variance Gaussian (the rotated coordinates' law).

After the randomized Hadamard rotation each coordinate of a vector scaled to unit RMS is close to
N(0, 1) (the exact law is a Beta(d) marginal, within ~1% of it for d >= 64; see
research/turboquant.md §1.4). The positive halves below are pinned: a port of this codec once
shipped a 4-bit table 0.61x too narrow, and tests compare these literals with a fresh Lloyd
iteration so that class of bug cannot come back.
"""

from __future__ import annotations

import functools
import math
from statistics import NormalDist

import torch

# Positive half of the optimal reconstruction levels, in units of the standard deviation.
GAUSSIAN_LLOYD_MAX: dict[int, tuple[float, ...]] = {
    1: (0.7978846,),
    2: (0.4527800, 1.5104176),
    3: (0.2450942, 0.7560053, 1.3439093, 2.1519457),
    4: (0.1283950, 0.3880483, 0.6567591, 0.9423405, 1.2562312, 1.6180464, 2.0690172, 2.7325896),
    5: (0.0658897, 0.1980518, 0.3313783, 0.4666995, 0.6049336, 0.7471357, 0.8945651, 1.0487833,
        1.2118044, 1.3863403, 1.5762281, 1.7872332, 2.0287284, 2.3177394, 2.6911196, 3.2607325),
    6: (0.0334095, 0.1002783, 0.1672969, 0.2345670, 0.3021928, 0.3702826, 0.4389497, 0.5083138,
        0.5785030, 0.6496556, 0.7219219, 0.7954677, 0.8704766, 0.9471549, 1.0257363, 1.1064882,
        1.1897201, 1.2757945, 1.3651410, 1.4582764, 1.5558312, 1.6585889, 1.7675419, 1.8839772,
        2.0096110, 2.1468102, 2.2989812, 2.4713048, 2.6722738, 2.9174068, 3.2404371, 3.7441013),
}

# Mean squared error per coordinate of the tables above on N(0, 1) (used by tests and docs).
GAUSSIAN_LLOYD_MAX_MSE: dict[int, float] = {1: 0.3634, 2: 0.1175, 3: 0.03455, 4: 0.009497}


@functools.lru_cache(maxsize=None)
def centroids(bits: int) -> torch.Tensor:
    """All 2**bits levels in ascending order (float32)."""
    if bits not in GAUSSIAN_LLOYD_MAX:
        raise ValueError(f"no Lloyd-Max table for {bits} bits (have {sorted(GAUSSIAN_LLOYD_MAX)})")
    half = torch.tensor(GAUSSIAN_LLOYD_MAX[bits], dtype=torch.float32)
    return torch.cat([-half.flip(0), half])


@functools.lru_cache(maxsize=None)
def boundaries(bits: int) -> torch.Tensor:
    """The 2**bits - 1 decision thresholds (midpoints of adjacent levels, float32).

    A coordinate v gets code #{k : v > boundaries[k]}; this exact rule is the contract.
    """
    c = centroids(bits)
    return (c[1:] + c[:-1]) * 0.5


def lloyd_max_gaussian(bits: int, tol: float = 1e-12, max_iter: int = 200_000) -> list[float]:
    """Recompute the optimal levels with Lloyd's iteration in float64 (reference for tests)."""
    n = 2**bits
    nd = NormalDist()
    levels = [nd.inv_cdf((i + 0.5) / n) for i in range(n)]
    for _ in range(max_iter):
        mids = [(a + b) / 2 for a, b in zip(levels, levels[1:])]
        pdf = [0.0] + [math.exp(-m * m / 2) / math.sqrt(2 * math.pi) for m in mids] + [0.0]
        cdf = [0.0] + [nd.cdf(m) for m in mids] + [1.0]
        new = [(pdf[i] - pdf[i + 1]) / (cdf[i + 1] - cdf[i]) for i in range(n)]
        delta = max(abs(a - b) for a, b in zip(new, levels))
        levels = new
        if delta < tol:
            break
    return levels
