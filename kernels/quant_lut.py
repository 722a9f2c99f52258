"""Bucketed lookup table for the Lloyd-Max quantizer (the Triton encoder's ``qmode=2``).

The codec's rule is ``code = #{k : v > boundary_k}`` (codec/codebooks.py). A binary search over
the boundaries costs the kernel ~18 instructions per coordinate (comparisons, select trees,
predicate moves) plus a gather of the squared level for the centroid norm. Here one gather of a
table entry does both: the top ``32 - shift`` bits of the float's bit pattern (sign, exponent,
``bits - 1`` mantissa bits) pick a cell, and cells are narrow enough that the code changes at
most once inside one. Inside a cell the value is monotone in the bit pattern (increasing for
positive floats, decreasing for negative ones), so an entry holds the one change point ``t``
and the codes and squared levels on either side: ``code = bits > t ? hi : lo`` and
``sq = bits > t ? c2hi : c2lo`` (int32 comparison of the raw bits). That is bit-identical to the
rule for every float, ties, signed zeros, infinities and NaN (code 0, as the reference's
comparisons give) included, and the table covers every bit pattern, so nothing is clamped.

Entry layout (8 int32 words, 32 bytes): ``t, lo, hi, c2lo, c2hi, 0, 0, 0`` (c2 as fp32 bits).
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from turbowire.codec.codebooks import GAUSSIAN_LLOYD_MAX, boundaries, centroids

ENTRY_WORDS = 8
_POS_INF_BITS = 0x7F800000


def lut_shift(bits: int) -> int:
    """Right shift of the bit pattern that gives a cell (2**(bits-1) cells per octave)."""
    return 24 - bits


def lut_words(bits: int) -> int:
    """Table size in int32 words for one bit width."""
    return ENTRY_WORDS << (32 - lut_shift(bits))


def lut_offset(bits: int) -> int:
    """Word offset of the ``bits`` table inside the concatenation for bits 1, 2, ... (closed
    form so the kernel computes it from a compile-time BITS: sum of 8 * 2**(8 + b), b < bits)."""
    return 4096 * ((1 << (bits - 1)) - 1)


def _codes(bits_i64: np.ndarray, bits: int) -> np.ndarray:
    """The codec's rule #{k : v > boundary_k} for int32 bit patterns given as int64."""
    v = torch.from_numpy(bits_i64.astype(np.int32).view(np.float32).copy())
    return (v[:, None] > boundaries(bits)[None, :]).sum(-1).numpy().astype(np.int64)


@functools.lru_cache(maxsize=None)
def lut_table(bits: int) -> torch.Tensor:
    """The ``bits`` table as int32 [cells * 8]; raises if a cell would hold two code changes."""
    shift = lut_shift(bits)
    ncell = 1 << (32 - shift)
    half = 1 << (31 - shift)
    bnd = np.ascontiguousarray(boundaries(bits).numpy()).view(np.int32).astype(np.int64)
    c = centroids(bits)
    c2 = (c * c).numpy().view(np.int32).astype(np.int64)
    lo_b = (np.arange(ncell, dtype=np.int64) - half) << shift  # first bit pattern of each cell
    hi_b = lo_b + (1 << shift) - 1
    # change points, as the last pattern before the change: a positive boundary with bits K
    # (v > B from K + 1 on), a negative one with bits K (v > B up to K - 1), +inf -> NaN
    t_pts = np.concatenate([bnd[bnd >= 0], bnd[bnd < 0] - 1, [_POS_INF_BITS]])
    t_pts.sort()
    first = np.searchsorted(t_pts, lo_b, side="left")
    count = np.searchsorted(t_pts, hi_b, side="left") - first  # points in [lo, hi - 1]
    if int(count.max()) > 1:
        raise AssertionError(f"{bits}-bit quantizer table: a cell holds two code changes")
    t = np.full(ncell, 0x7FFFFFFF, dtype=np.int64)  # no change: bits > t never holds
    has = count > 0
    t[has] = t_pts[first[has]]
    lo = _codes(lo_b, bits)
    hi = _codes(hi_b, bits)
    out = np.zeros((ncell, ENTRY_WORDS), dtype=np.int64)
    out[:, 0] = t
    out[:, 1] = lo
    out[:, 2] = hi
    out[:, 3] = c2[lo]
    out[:, 4] = c2[hi]
    return torch.from_numpy(out.astype(np.int32).reshape(-1))


def lut_tables() -> torch.Tensor:
    """Tables for every bit width with a codebook, concatenated at ``lut_offset``."""
    widths = sorted(GAUSSIAN_LLOYD_MAX)
    assert widths == list(range(1, len(widths) + 1))
    return torch.cat([lut_table(b) for b in widths])


def lut_quantize(v: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, fp32 squared levels) of fp32 values through the table, as the kernel computes
    them (a host-side mirror for tests)."""
    tab = lut_table(bits).view(-1, ENTRY_WORDS).to(torch.int64)
    shift = lut_shift(bits)
    b = v.contiguous().view(torch.int32).to(torch.int64)
    e = tab[(b >> shift) + (1 << (31 - shift))]
    p = b > e[..., 0]
    code = torch.where(p, e[..., 2], e[..., 1])
    sq = torch.where(p, e[..., 4], e[..., 3]).to(torch.int32).view(torch.float32)
    return code, sq
