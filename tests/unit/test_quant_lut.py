"""The bucketed quantizer table (kernels/quant_lut.py) against the codec's rule.

``code = #{k : v > boundary_k}`` must come out of one table lookup for every float32: values on
and next to every boundary, signed zeros, infinities, every NaN pattern (the reference gives code
0: NaN compares false) and random bit patterns; the squared level must be fp32(c[code] ** 2).
The Triton encoder's qmode=2 reads the same table (tests/unit/test_kernels_triton.py).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from turbowire.codec.codebooks import GAUSSIAN_LLOYD_MAX, boundaries, centroids
from turbowire.kernels.quant_lut import ENTRY_WORDS, lut_offset, lut_quantize, lut_table, lut_tables


def _probe_values(bits: int, seed: int) -> torch.Tensor:
    rng = np.random.default_rng(seed)
    vals: list[np.float32] = []
    for b in boundaries(bits).numpy():
        for b0 in (np.float32(b), np.float32(-b)):
            for direction in (np.float32(np.inf), np.float32(-np.inf)):
                x = b0
                for _ in range(4):
                    vals.append(x)
                    x = np.nextafter(x, direction)
    edge = np.array([0.0, -0.0, np.inf, -np.inf, 1e-45, -1e-45, 3.4e38, -3.4e38, 5.0, -5.0],
                    dtype=np.float32)
    nan_bits = np.array([0x7FFFFFFF, 0xFFFFFFFF, 0x7FC00000, 0xFFC00000, 0x7F800001, 0xFF800001],
                        dtype=np.uint32).view(np.float32)
    random_bits = (rng.integers(0, 2**32, 200_000, dtype=np.uint64).astype(np.uint32)
                   .view(np.float32))
    gaussian = (rng.standard_normal(200_000) * 1.5).astype(np.float32)
    return torch.from_numpy(np.concatenate([np.array(vals, np.float32), edge, nan_bits,
                                            random_bits, gaussian]))


@pytest.mark.parametrize("bits", sorted(GAUSSIAN_LLOYD_MAX))
def test_lookup_equals_the_codebook_rule(bits: int) -> None:
    v = _probe_values(bits, seed=bits)
    expected = (v[:, None] > boundaries(bits)[None, :]).sum(-1)
    code, sq = lut_quantize(v, bits)
    assert torch.equal(code, expected)
    c = centroids(bits)
    assert torch.equal(sq.view(torch.int32), (c * c)[expected].view(torch.int32))
    assert int(code[torch.isnan(v)].abs().sum()) == 0


def test_tables_are_concatenated_at_their_offsets() -> None:
    tabs = lut_tables()
    for bits in sorted(GAUSSIAN_LLOYD_MAX):
        t = lut_table(bits)
        off = lut_offset(bits)
        assert torch.equal(tabs[off : off + t.numel()], t)
        assert t.numel() % ENTRY_WORDS == 0
    assert tabs.numel() == lut_offset(max(GAUSSIAN_LLOYD_MAX) + 1)
