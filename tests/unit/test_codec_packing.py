"""Bit packing: exact round trips (property-based) and the documented byte layout."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from turbowire.codec.packing import pack_codes, packed_row_bytes, plane_widths, unpack_codes


@settings(max_examples=200, deadline=None)
@given(
    bits=st.integers(min_value=1, max_value=8),
    rows=st.integers(min_value=1, max_value=5),
    dim_units=st.integers(min_value=1, max_value=32),
    seed=st.integers(min_value=0, max_value=2**31 - 1),
)
def test_pack_unpack_round_trip(bits: int, rows: int, dim_units: int, seed: int) -> None:
    dim = dim_units * 8
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 2**bits, (rows, dim), generator=g)
    packed = pack_codes(codes, bits)
    assert packed.dtype == torch.uint8
    assert packed.shape == (rows, packed_row_bytes(dim, bits))
    assert torch.equal(unpack_codes(packed, bits, dim), codes)


def test_four_bit_layout_low_nibble_first() -> None:
    codes = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 15]])
    assert pack_codes(codes, 4).tolist() == [[0x21, 0x43, 0x65, 0xF7]]


def test_three_bit_layout_is_two_bit_plane_then_one_bit_plane() -> None:
    codes = torch.tensor([[7, 0, 5, 2, 1, 6, 3, 4]])
    low = [c & 3 for c in codes[0].tolist()]
    high = [c >> 2 for c in codes[0].tolist()]
    byte0 = low[0] | low[1] << 2 | low[2] << 4 | low[3] << 6
    byte1 = low[4] | low[5] << 2 | low[6] << 4 | low[7] << 6
    byte2 = sum(h << i for i, h in enumerate(high))
    assert pack_codes(codes, 3).tolist() == [[byte0, byte1, byte2]]
    assert plane_widths(3) == (2, 1)


def test_bad_dimensions_are_refused() -> None:
    with pytest.raises(ValueError, match="multiple of 8"):
        pack_codes(torch.zeros(1, 12, dtype=torch.int64), 4)
    with pytest.raises(ValueError, match="1..8"):
        pack_codes(torch.zeros(1, 8, dtype=torch.int64), 9)
