"""split_heads against the reference encoder: the chunk of a run of heads, cut from a whole
chunk, is byte for byte the chunk the codec encodes from those heads alone."""

from __future__ import annotations

import pytest
import torch

from turbowire.codec import Codec
from turbowire.codec.errors import GeometryError
from turbowire.codec.heads import split_heads
from turbowire.codec.presets import list_presets


@pytest.mark.parametrize("preset", list_presets())
@pytest.mark.parametrize("offset", [0, 256])  # a sequence's first chunk carries sink rows
@pytest.mark.parametrize("heads,groups", [(4, 2), (4, 4), (8, 2), (2, 1)])
def test_a_run_of_heads_cut_from_a_chunk_is_its_own_encoding(preset, offset, heads, groups):
    codec = Codec(preset, 128, 4)
    g = torch.Generator().manual_seed(heads * 10 + groups)
    k = (torch.randn(37, heads, 128, generator=g) * 3 + 1).to(torch.bfloat16)
    v = torch.randn(37, heads, 128, generator=g).to(torch.bfloat16)
    whole = codec.encode(1, k, v, tag=0x1234, token_offset=offset)
    parts = split_heads(codec, 1, whole.data, groups)
    per = heads // groups
    assert len(parts) == groups
    for i, part in enumerate(parts):
        alone = codec.encode(1, k[:, i * per:(i + 1) * per], v[:, i * per:(i + 1) * per],
                             tag=0x1234, token_offset=offset)
        assert torch.equal(part, alone.data), (preset, i)


def test_a_split_refuses_groups_that_do_not_divide_the_heads_and_a_damaged_chunk():
    codec = Codec("tq4", 128, 2)
    k = torch.randn(8, 4, 128).to(torch.bfloat16)
    chunk = codec.encode(0, k, k).data.clone()
    with pytest.raises(GeometryError, match="do not split"):
        split_heads(codec, 0, chunk, 3)
    chunk[-1] ^= 1
    with pytest.raises(Exception, match="checksum"):
        split_heads(codec, 0, chunk, 2)
