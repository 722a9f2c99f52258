"""The quality harness measures the real codec: CodecMethod (which runs through the kernels'
dispatch, the C codec when built) must give the reference codec's values and byte counts."""

from __future__ import annotations

import pytest
import torch

from turbowire.codec import Codec
from turbowire.quality.methods import CodecMethod


@pytest.mark.parametrize(("preset", "head_dim", "tokens"),
                         [("tq4", 64, 300), ("k4v3", 128, 77), ("tq3", 64, 512)])
def test_codec_method_equals_the_reference_chunk_by_chunk(
    preset: str, head_dim: int, tokens: int
) -> None:
    gen = torch.Generator().manual_seed(tokens)
    k = torch.randn(tokens, 3, head_dim, generator=gen).to(torch.bfloat16) * 3
    v = torch.randn(tokens, 3, head_dim, generator=gen).to(torch.bfloat16)
    method = CodecMethod(preset, head_dim, num_layers=4)
    got_k, got_v, nbytes = method.apply(1, k, v)

    codec = Codec(preset, head_dim, 4)
    ref_k, ref_v, ref_bytes = [], [], 0
    for t0 in range(0, tokens, 256):
        enc = codec.encode(1, k[t0 : t0 + 256], v[t0 : t0 + 256], token_offset=t0)
        ref_bytes += enc.nbytes
        dk, dv = codec.decode(1, enc.data)
        ref_k.append(dk)
        ref_v.append(dv)
    assert nbytes == ref_bytes
    assert torch.equal(got_k, torch.cat(ref_k))
    assert torch.equal(got_v, torch.cat(ref_v))
    assert not torch.equal(got_k, k)  # it really went through a lossy codec
