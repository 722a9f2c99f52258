"""Cut a K/V chunk into chunks of consecutive KV heads, without decoding it.

Every statistic a chunk holds is per head (a vector's scale, a head's channel means, a head's
sink rows), and every section is laid out ``[rows, heads, per-head bytes]`` (``FORMAT.md``,
"Body"), so the chunk of heads ``[a, b)`` is those heads' bytes of each section, re-framed: the
same bytes the codec writes when it encodes those heads alone. A prefill rank that stages its
chunks cut this way lets a decode rank of a wider TP size read only its own heads' bytes.
"""

from __future__ import annotations

import torch

from turbowire.codec.codec import Codec
from turbowire.codec.errors import GeometryError
from turbowire.codec.streams import StreamLayout
from turbowire.codec.wire import HEADER_BYTES, ChunkHeader, parse_header, verify_body, wsum32


def _rows(name: str, layout: StreamLayout, tokens: int) -> int:
    """Rows of a section: the mean has one, the sink its sink rows, the rest one per token."""
    return {"mean": 1, "sink": layout.sink_rows}.get(name, tokens)


def split_heads(codec: Codec, layer: int, data: torch.Tensor, groups: int) -> list[torch.Tensor]:
    """The chunk ``data`` (uint8, verified here) as ``groups`` chunks of equal runs of heads, in
    head order; each is the chunk ``codec.encode`` makes of its heads alone."""
    header = parse_header(data)
    codec.check_compatible(header, layer)
    body = verify_body(header, data)
    heads, tokens = header.num_heads, header.num_tokens
    if groups < 1 or heads % groups:
        raise GeometryError(f"{heads} KV heads do not split into {groups} equal groups")
    part = heads // groups
    whole = codec.layout(layer, tokens, heads, header.token_offset, header.dtype, header.tag)
    piece = codec.layout(layer, tokens, part, header.token_offset, header.dtype, header.tag)
    out = []
    for g in range(groups):
        sub = torch.zeros(piece.header.body_nbytes, dtype=torch.uint8, device=data.device)
        for src, dst, src_base, dst_base in ((whole.k, piece.k, 0, 0),
                                             (whole.v, piece.v, whole.k.nbytes, piece.k.nbytes)):
            for name, (off, nbytes) in src.sections.items():
                rows = _rows(name, src, tokens)
                unit = nbytes // (rows * heads)
                cut = body[src_base + off:src_base + off + nbytes].view(rows, heads, unit)
                d_off, d_nbytes = dst.sections[name]
                sub[dst_base + d_off:dst_base + d_off + d_nbytes] = (
                    cut[:, g * part:(g + 1) * part].reshape(-1))
        framed = ChunkHeader(**{**piece.header.__dict__, "body_checksum": wsum32(sub)})
        head = torch.frombuffer(bytearray(framed.pack()), dtype=torch.uint8).to(data.device)
        out.append(torch.cat([head, sub]))
    assert all(c.numel() == HEADER_BYTES + piece.header.body_nbytes for c in out)
    return out


__all__ = ["split_heads"]
