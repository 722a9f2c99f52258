"""Bit packing of b-bit codes as bit planes of 4, 2 and 1 bits.

A b-bit code is split, from its least significant bit, into planes of widths ``plane_widths(b)``
(3 -> 2+1, 5 -> 4+1, 6 -> 4+2, 7 -> 4+2+1). A plane of width w packs 8/w codes per byte,
element j of the plane at bit offset w·(j mod 8/w) of byte j div (8/w) (LSB first). Each vector's
planes are stored back to back, so one vector of D codes takes D·b/8 bytes. Unpacking is a shift
and a mask per plane: cheap on a GPU, no code straddles a byte.
"""

from __future__ import annotations

import torch

_PLANES: dict[int, tuple[int, ...]] = {
    1: (1,), 2: (2,), 3: (2, 1), 4: (4,), 5: (4, 1), 6: (4, 2), 7: (4, 2, 1), 8: (8,),
}


def plane_widths(bits: int) -> tuple[int, ...]:
    if bits not in _PLANES:
        raise ValueError(f"cannot pack {bits}-bit codes (1..8 supported)")
    return _PLANES[bits]


def packed_row_bytes(dim: int, bits: int) -> int:
    """Bytes one vector of ``dim`` codes occupies."""
    if dim % 8:
        raise ValueError(f"vector length must be a multiple of 8 to pack, got {dim}")
    return dim * bits // 8


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack integer codes [..., D] (values < 2**bits) into uint8 [..., D·bits/8]."""
    dim = codes.shape[-1]
    packed_row_bytes(dim, bits)
    c = codes.to(torch.int32)
    planes = []
    shift = 0
    for width in plane_widths(bits):
        part = (c >> shift) & ((1 << width) - 1)
        per_byte = 8 // width
        part = part.reshape(*c.shape[:-1], dim // per_byte, per_byte)
        weights = torch.tensor(
            [1 << (width * i) for i in range(per_byte)], dtype=torch.int32, device=c.device
        )
        planes.append((part * weights).sum(-1, dtype=torch.int32).to(torch.uint8))
        shift += width
    return torch.cat(planes, dim=-1)


def unpack_codes(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Inverse of ``pack_codes``: uint8 [..., D·bits/8] -> int64 codes [..., D]."""
    if packed.shape[-1] != packed_row_bytes(dim, bits):
        raise ValueError(
            f"packed rows have {packed.shape[-1]} bytes, expected {packed_row_bytes(dim, bits)}"
        )
    p = packed.to(torch.int32)
    out = torch.zeros(*p.shape[:-1], dim, dtype=torch.int32, device=p.device)
    offset = 0
    shift = 0
    for width in plane_widths(bits):
        per_byte = 8 // width
        nbytes = dim // per_byte
        plane = p[..., offset : offset + nbytes]
        shifts = torch.arange(per_byte, dtype=torch.int32, device=p.device) * width
        vals = (plane.unsqueeze(-1) >> shifts) & ((1 << width) - 1)
        out |= vals.reshape(*p.shape[:-1], dim) << shift
        offset += nbytes
        shift += width
    return out.to(torch.int64)
