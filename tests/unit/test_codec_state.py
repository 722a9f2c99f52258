"""The state chunk (``turbowire.codec.state``) and the kernels that move a Mamba / gated-delta-net
layer's state block through it (``turbowire.kernels.state``): bytes back exactly, every
corruption or mismatch refused with the codec's exceptions and nothing written."""

from __future__ import annotations

import pytest
import torch

from turbowire.codec.errors import (
    ChecksumError,
    FormatError,
    IncompatiblePayloadError,
    TruncatedPayloadError,
)
from turbowire.codec.state import STATE_HEADER_BYTES, decode_state, state_chunk_nbytes
from turbowire.kernels import (
    NO_BLOCK,
    BlockIndexError,
    StatePages,
    decode_state_into,
    encode_state_into,
)


def gdn_cache(num_blocks: int, seed: int) -> list[torch.Tensor]:
    """A GDN layer's state as vLLM registers it: views into one padded page per block (conv
    bf16 [3, 256] at the page start, SSM fp32 [4, 32, 32] after it)."""
    page = 32768
    raw = torch.zeros(num_blocks * page, dtype=torch.uint8)
    conv = torch.as_strided(raw.view(torch.bfloat16), (num_blocks, 3, 256),
                            (page // 2, 256, 1))
    ssm = torch.as_strided(raw.view(torch.float32), (num_blocks, 4, 32, 32),
                           (page // 4, 1024, 32, 1), 3 * 256 * 2 // 4)
    g = torch.Generator().manual_seed(seed)
    conv.copy_(torch.randn(conv.shape, generator=g))
    ssm.copy_(torch.randn(ssm.shape, generator=g))
    return [conv, ssm]


def test_a_state_block_moves_byte_for_byte_into_another_block():
    src, dst = StatePages.from_cache(gdn_cache(8, 1)), StatePages.from_cache(gdn_cache(8, 2))
    assert src.state_bytes == 3 * 256 * 2 + 4 * 32 * 32 * 4
    size = state_chunk_nbytes(src.state_bytes)
    buf = torch.zeros(100 + size, dtype=torch.uint8)
    assert encode_state_into(src, 5, 7, 3, 0xABC, buf, 100) == size
    before = [t.clone() for t in dst.tensors]
    decode_state_into(dst, 5, 7, 6, buf, 100, size, 0xABC)
    for s, d, b in zip(src.tensors, dst.tensors, before):
        assert torch.equal(d[6], s[3])
        others = [i for i in range(8) if i != 6]
        assert torch.equal(d[others], b[others])  # only the target block is written


@pytest.mark.parametrize("damage,error", [
    (lambda b: b.__setitem__(0, ord("X")), FormatError),  # not a state chunk
    (lambda b: b.__setitem__(9, 1), ChecksumError),  # header bit
    (lambda b: b.__setitem__(STATE_HEADER_BYTES + 77, b[STATE_HEADER_BYTES + 77] ^ 1),
     ChecksumError),  # body bit
])
def test_a_damaged_state_chunk_is_refused_and_nothing_written(damage, error):
    src, dst = StatePages.from_cache(gdn_cache(4, 1)), StatePages.from_cache(gdn_cache(4, 2))
    size = state_chunk_nbytes(src.state_bytes)
    buf = torch.zeros(size, dtype=torch.uint8)
    encode_state_into(src, 0, 2, 1, 9, buf, 0)
    damage(buf)
    before = [t.clone() for t in dst.tensors]
    with pytest.raises(error):
        decode_state_into(dst, 0, 2, 2, buf, 0, size, 9)
    assert all(torch.equal(t, b) for t, b in zip(dst.tensors, before))


def test_a_valid_chunk_of_another_transfer_is_refused():
    pages = StatePages.from_cache(gdn_cache(2, 1))
    size = state_chunk_nbytes(pages.state_bytes)
    buf = torch.zeros(size, dtype=torch.uint8)
    encode_state_into(pages, 3, 4, 0, 11, buf, 0)
    for layer, layers, nbytes, tag in [(2, 4, pages.state_bytes, 11),
                                       (3, 5, pages.state_bytes, 11),
                                       (3, 4, pages.state_bytes - 16, 11),
                                       (3, 4, pages.state_bytes, 12)]:
        with pytest.raises(IncompatiblePayloadError):
            decode_state(buf, layer, layers, nbytes, tag)
    with pytest.raises(TruncatedPayloadError):
        decode_state(buf[:size - 16], 3, 4, pages.state_bytes, 11)


def test_a_block_outside_the_cache_is_refused():
    pages = StatePages.from_cache(gdn_cache(2, 1))
    buf = torch.zeros(state_chunk_nbytes(pages.state_bytes), dtype=torch.uint8)
    for block in (2, -5, NO_BLOCK):
        with pytest.raises(BlockIndexError):
            encode_state_into(pages, 0, 1, block, 0, buf, 0)
    with pytest.raises(BlockIndexError):
        decode_state_into(pages, 0, 1, 0, buf, 8, buf.numel(), None)
