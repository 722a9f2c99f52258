"""Bucketed lookup table for the Lloyd-Max quantizer (the Triton encoder's ``qmode=2``).

The codec's rule is ``code = #{k : v > boundary_k}`` (codec/codebooks.py) over symmetric
boundaries whose middle one is 0. As in the select-tree quantizer, the kernel folds the sign:
``a = |v|`` as integer bits, one ulp up where ``v <= 0`` (so ``>=`` becomes ``>``), then
``n = #{j : a > P_j}`` over the positive boundaries and ``code = (n + H) ^ (v <= 0 ? 2H - 1 : 0)``.
Here ``n`` comes from one 16-byte gather instead of a select tree: ``a >> shift`` (exponent and
``bits - 1`` mantissa bits) picks a cell, clamped to the last one, and cells are narrow enough
that ``n`` changes at most once inside one. An entry holds that change point ``t``, ``n`` below
it and the squared levels on either side, so ``n = n_lo + (a > t)`` and ``sq = a > t ? c2hi :
c2lo`` (the centroid-norm fold's input, the same for both signs). Bit-identical to the rule for
every float, ties, signed zeros, infinities and every NaN (code 0) included.

The table is small on purpose: a warp's gather touches only the cache lines of the cells its 32
values fall in. A first version indexed all 2**32 bit patterns with 32-byte entries; it cut the
encoder's instructions by a quarter but its gathers touched ~15 L1 lines per warp and the kernel
got slower (bench/RESULTS.md).

Entry layout (4 int32 words, 16 bytes): ``t, n_lo, c2lo, c2hi`` (c2 as fp32 bits).
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from turbowire.codec.codebooks import GAUSSIAN_LLOYD_MAX, boundaries, centroids

ENTRY_WORDS = 4
CELL_TOP = 130  # cells cover |v| < 2**(CELL_TOP - 127) = 8 (every boundary is below 4)


def lut_shift(bits: int) -> int:
    """Right shift of |v|'s bits that gives a cell (2**(bits-1) cells per octave)."""
    return 24 - bits


def lut_cells(bits: int) -> int:
    """Cells of the ``bits`` table; the last one takes every larger pattern (inf, NaN)."""
    return CELL_TOP << (bits - 1)


def lut_offset(bits: int) -> int:
    """Word offset of the ``bits`` table inside the concatenation for bits 1, 2, ... (closed
    form so the kernel computes it from a compile-time BITS)."""
    return ENTRY_WORDS * CELL_TOP * ((1 << (bits - 1)) - 1)


@functools.lru_cache(maxsize=None)
def lut_table(bits: int) -> torch.Tensor:
    """The ``bits`` table as int32 [cells * 4]; raises if a cell would hold two changes of n."""
    shift = lut_shift(bits)
    ncell = lut_cells(bits)
    half = 1 << (bits - 1)
    b = boundaries(bits)
    pos = np.ascontiguousarray(b[b > 0].numpy()).view(np.int32).astype(np.int64)  # ascending
    levels = centroids(bits)[half:]
    c2 = (levels * levels).numpy().view(np.int32).astype(np.int64)
    lo = np.arange(ncell, dtype=np.int64) << shift
    hi = lo + (1 << shift) - 1
    hi[-1] = (1 << 32) - 1
    if len(pos) and int(pos[-1]) >= int(lo[-1]):
        raise AssertionError(f"{bits}-bit quantizer table: a boundary above the last cell")
    # n changes at a = P + 1 for each positive boundary pattern P in [lo, hi - 1]
    first = np.searchsorted(pos, lo, side="left")
    count = np.searchsorted(pos, hi, side="left") - first
    if int(count.max(initial=0)) > 1:
        raise AssertionError(f"{bits}-bit quantizer table: a cell holds two changes")
    t = np.full(ncell, 0xFFFFFFFF, dtype=np.int64)  # no change: a > t never holds
    has = count > 0
    t[has] = pos[first[has]]
    n_lo = first  # boundaries strictly below the cell's first pattern
    n_hi = np.minimum(n_lo + 1, half - 1)
    out = np.stack([t, n_lo, c2[n_lo], c2[n_hi]], axis=1)
    return torch.from_numpy(out.astype(np.uint32).view(np.int32).reshape(-1).copy())


def lut_tables() -> torch.Tensor:
    """Tables for every bit width with a codebook, concatenated at ``lut_offset``."""
    widths = sorted(GAUSSIAN_LLOYD_MAX)
    assert widths == list(range(1, len(widths) + 1))
    return torch.cat([lut_table(b) for b in widths])


def lut_quantize(v: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, fp32 squared levels) of fp32 values through the table, as the kernel computes
    them (a host-side mirror for tests)."""
    tab = lut_table(bits).view(-1, ENTRY_WORDS).to(torch.int64) & 0xFFFFFFFF
    half = 1 << (bits - 1)
    raw = v.contiguous().view(torch.int32).to(torch.int64)
    neg = ~(v > 0)
    a = (raw & 0x7FFFFFFF) + neg.to(torch.int64)
    e = tab[torch.clamp(a >> lut_shift(bits), max=lut_cells(bits) - 1)]
    p = a > e[..., 0]
    n = e[..., 1] + p.to(torch.int64)
    code = (n + half) ^ torch.where(neg, 2 * half - 1, 0)
    sq = torch.where(p, e[..., 3], e[..., 2]).to(torch.int32).view(torch.float32)
    return code, sq
