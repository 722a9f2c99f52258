"""The latent chunk (an MLA layer's rows: the latent coded with the preset's key stream, the RoPE
part raw): sizes as promised, raw and RoPE bit-exact, and every mix-up refused."""

from __future__ import annotations

import struct

import pytest
import torch

from turbowire.codec import Codec
from turbowire.codec.errors import (
    ChecksumError,
    FormatError,
    GeometryError,
    IncompatiblePayloadError,
)
from turbowire.codec.latent import decode_latent, encode_latent, latent_nbytes
from turbowire.codec.wire import parse_header, wsum32

L, R, T = 512, 64, 16


def rows(seed: int = 0, tokens: int = T) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(tokens, L, generator=g).bfloat16(),
            torch.randn(tokens, R, generator=g).bfloat16())


@pytest.mark.parametrize("preset", ["raw", "k16v4", "tq4", "k8v4", "tq3"])
@pytest.mark.parametrize("offset", [0, 48])
def test_round_trip(preset, offset):
    codec = Codec(preset, 128, 4)
    latent, rope = rows()
    chunk = encode_latent(codec, 2, latent, rope, tag=9, token_offset=offset)
    assert chunk.nbytes == latent_nbytes(codec, 2, T, L, R, offset)
    header = parse_header(chunk.data)
    assert (header.is_latent, header.rope_dim, header.num_heads, header.head_dim) == \
        (True, R, L // 128, 128)
    got_latent, got_rope = decode_latent(codec, 2, chunk, L, R, expected_tag=9,
                                         expected_tokens=T, expected_offset=offset)
    assert torch.equal(got_rope, rope)  # the RoPE part always crosses raw
    if codec.policy(2).k.kind == "raw":  # a preset that keeps keys raw keeps the latent raw
        assert torch.equal(got_latent, latent)
        return
    err = (got_latent.float() - latent.float()).norm() / latent.float().norm()
    assert 0 < err < (0.2 if preset == "tq3" else 0.12)
    assert chunk.nbytes < T * (L + R) * 2 * 0.6
    if offset == 0 and codec.policy(2).k.sink_tokens:  # the sequence's first row exact
        assert torch.equal(got_latent[0], latent[0])


def test_a_kv_decoder_refuses_a_latent_chunk_and_the_other_way_round():
    codec = Codec("tq4", 128, 4)
    chunk = encode_latent(codec, 0, *rows())
    with pytest.raises(IncompatiblePayloadError, match="latent"):
        codec.decode(0, chunk)
    kv = codec.encode(0, torch.randn(T, 4, 128).bfloat16(), torch.randn(T, 4, 128).bfloat16())
    with pytest.raises(IncompatiblePayloadError, match="K/V chunk"):
        decode_latent(codec, 0, kv, L, R)


@pytest.mark.parametrize("change,match", [
    (dict(layer=1), "layer"),
    (dict(latent_dim=256), "latent of"),
    (dict(rope_dim=32), "latent of"),
    (dict(expected_tag=8), "tag"),
    (dict(expected_tokens=T - 1), "tokens"),
    (dict(expected_offset=16), "offset"),
])
def test_a_latent_chunk_of_another_layer_shape_or_transfer_is_refused(change, match):
    codec = Codec("tq4", 128, 4)
    chunk = encode_latent(codec, 0, *rows(), tag=7)
    args = dict(layer=0, latent_dim=L, rope_dim=R, expected_tag=7)
    args.update(change)
    with pytest.raises(IncompatiblePayloadError, match=match):
        decode_latent(codec, args.pop("layer"), chunk, args.pop("latent_dim"),
                      args.pop("rope_dim"), **args)
    with pytest.raises(IncompatiblePayloadError, match="preset"):
        decode_latent(Codec("tq3", 128, 4), 0, chunk, L, R)


def test_a_flipped_body_bit_is_refused():
    codec = Codec("raw", 128, 4)
    data = encode_latent(codec, 0, *rows()).data.clone()
    data[-3] ^= 4  # inside the raw RoPE rows
    with pytest.raises(ChecksumError):
        decode_latent(codec, 0, data, L, R)


def test_the_latent_flag_and_the_rope_width_field_must_agree():
    codec = Codec("raw", 128, 4)
    data = bytearray(encode_latent(codec, 0, *rows()).to_bytes())
    data[18:20] = struct.pack("<H", 0)  # flag set, width cleared: re-sign the header
    data[44:48] = struct.pack("<I", wsum32(torch.frombuffer(bytearray(data[:44]),
                                                            dtype=torch.uint8)))
    with pytest.raises(FormatError, match="RoPE width"):
        parse_header(bytes(data))


def test_widths_the_vectors_do_not_tile_are_refused():
    codec = Codec("tq4", 128, 4)
    with pytest.raises(GeometryError, match="vectors"):
        latent_nbytes(codec, 0, T, 320, R)
    with pytest.raises(GeometryError, match="RoPE"):
        latent_nbytes(codec, 0, T, L, 0)
