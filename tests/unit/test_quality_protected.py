"""Protected tokens, simulated in the eval: the first/last tokens come back exact, the others as
the preset decodes them, and the bytes trade the preset's share of those tokens for bf16."""

from __future__ import annotations

import pytest
import torch

from turbowire.quality.methods import CodecMethod, ProtectedMethod, parse_protect


def test_protected_tokens_are_exact_and_paid_for_in_bf16():
    gen = torch.Generator().manual_seed(3)
    k = torch.randn(300, 2, 64, generator=gen).to(torch.bfloat16)
    v = torch.randn(300, 2, 64, generator=gen).to(torch.bfloat16)
    inner = CodecMethod("tq3", 64, 4)
    kq0, vq0, n0 = inner.apply(1, k, v)
    m = ProtectedMethod(inner, sink=4, recent=32)
    kq, vq, n = m.apply(1, k, v)
    keep = m.protected(300)
    assert keep.tolist() == list(range(4)) + list(range(268, 300))
    assert torch.equal(kq[keep], k[keep]) and torch.equal(vq[keep], v[keep])
    rest = torch.ones(300, dtype=torch.bool)
    rest[keep] = False
    assert torch.equal(kq[rest], kq0[rest]) and torch.equal(vq[rest], vq0[rest])
    assert not torch.equal(kq0[keep], k[keep])  # the preset alone is lossy there
    assert n == round(n0 - n0 * 36 / 300) + 36 * 2 * 2 * 64 * 2
    assert m.name == "tq3 +s4r32 (sim)" and m.family == "simulation"


def test_protect_pairs_parse_or_explain():
    assert parse_protect("4:64, 0:128") == [(4, 64), (0, 128)] and parse_protect("") == []
    for bad in ("4", "a:1", "4:-1"):
        with pytest.raises(ValueError, match="SINK:RECENT"):
            parse_protect(bad)
