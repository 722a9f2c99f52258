"""The Codec's public API: round trips, sizes, distortion, and refusal of bad payloads."""

from __future__ import annotations

import pytest
import torch

from turbowire.codec import (
    ChecksumError,
    Codec,
    FormatError,
    GeometryError,
    IncompatiblePayloadError,
    TruncatedPayloadError,
    UnknownPresetError,
    UnsupportedVersionError,
    get_preset,
    list_presets,
    parse_header,
)
from turbowire.codec.codebooks import GAUSSIAN_LLOYD_MAX_MSE
from turbowire.codec.wire import HEADER_BYTES

PRESETS = list_presets()
LOSSY_BOUND = {"raw": 0.0, "k8v4": 0.02, "k5v4": 0.02, "tq4": 0.02, "k4v3": 0.06, "tq3": 0.06,
               "k3v2": 0.2, "tq2": 0.2, "k16v4": 0.02, "k16v3": 0.06, "k8v8": 0.002}


def kv(tokens: int, heads: int, dim: int, dtype=torch.bfloat16, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(tokens, heads, dim, generator=g) * 2
    k[..., 3] += 12.0  # an outlier channel with a large offset, as real keys have
    v = torch.randn(tokens, heads, dim, generator=g)
    return k.to(dtype), v.to(dtype)


def rel_mse(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return float((a - b).pow(2).sum() / b.pow(2).sum())


def test_list_presets_has_the_required_names() -> None:
    for name in ["raw", "k8v4", "tq4", "k4v3", "tq3", "k3v2", "tq2", "k16v4", "k16v3", "k8v8"]:
        assert name in PRESETS


def test_preset_ids_are_pinned() -> None:
    """Ids are wire format: a chunk names its preset by id, so ids are only ever added."""
    ids = {name: get_preset(name).preset_id for name in PRESETS}
    assert ids == {"raw": 0, "k8v4": 1, "tq4": 2, "k4v3": 3, "tq3": 4, "k3v2": 5, "tq2": 6,
                   "k5v4": 7, "k16v4": 8, "k16v3": 9, "k8v8": 10}
    assert all(get_preset(i).name == n for n, i in ids.items())


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("dim", [64, 128, 256])
@pytest.mark.parametrize("tokens,offset", [(1, 0), (7, 0), (33, 64), (256, 0), (300, 512)])
def test_round_trip(preset: str, dim: int, tokens: int, offset: int) -> None:
    codec = Codec(preset, dim, num_layers=4)
    k, v = kv(tokens, 3, dim, seed=tokens + dim)
    enc = codec.encode(2, k, v, tag=99, token_offset=offset)
    assert enc.nbytes == len(enc.to_bytes()) == codec.encoded_nbytes(2, tokens, 3, offset)
    for payload in (enc, enc.to_bytes(), bytearray(enc.to_bytes()), memoryview(enc.to_bytes()),
                    enc.data):
        k2, v2 = codec.decode(2, payload, expected_tag=99)
        assert k2.shape == k.shape and k2.dtype == k.dtype
        assert rel_mse(k2, k) <= LOSSY_BOUND[preset]
        assert rel_mse(v2, v) <= LOSSY_BOUND[preset]
    if preset == "raw":
        assert torch.equal(k2, k) and torch.equal(v2, v)
    if preset.startswith("k16"):  # raw keys: exact whatever the values get
        assert torch.equal(k2, k)
        assert tokens == 1 or not torch.equal(v2, v)  # one token at offset 0 is the exact sink


@pytest.mark.parametrize("preset", ["tq4", "tq3"])
def test_sink_row_of_a_sequence_is_exact(preset: str) -> None:
    codec = Codec(preset, 64, 2)
    k, v = kv(40, 2, 64)
    k2, v2 = codec.decode(0, codec.encode(0, k, v, token_offset=0))
    assert torch.equal(k2[0], k[0]) and torch.equal(v2[0], v[0])
    # a later chunk has no sink row, and is smaller
    assert codec.encoded_nbytes(0, 40, 2, token_offset=256) < codec.encoded_nbytes(0, 40, 2, 0)


def test_fp16_source_round_trips() -> None:
    codec = Codec("tq4", 128, 1)
    k, v = kv(16, 2, 128, dtype=torch.float16)
    k2, v2 = codec.decode(0, codec.encode(0, k, v))
    assert k2.dtype == torch.float16 and rel_mse(k2, k) < 0.02


def test_encoding_is_deterministic() -> None:
    codec = Codec("tq3", 128, 2)
    k, v = kv(50, 4, 128)
    assert codec.encode(1, k, v).to_bytes() == codec.encode(1, k.clone(), v.clone()).to_bytes()


@pytest.mark.parametrize("bits,preset", [(4, "tq4"), (3, "tq3"), (2, "tq2")])
def test_value_distortion_within_5_percent_of_lloyd_max(bits: int, preset: str) -> None:
    """Gaussian vectors: per-coordinate MSE relative to the per-coordinate variance."""
    codec = Codec(preset, 128, 1)
    g = torch.Generator().manual_seed(1)
    v = torch.randn(4096, 1, 128, generator=g).to(torch.bfloat16)
    _, v2 = codec.decode(0, codec.encode(0, v, v, token_offset=1))
    mse = float((v2.float() - v.float()).pow(2).mean() / v.float().pow(2).mean())
    assert mse == pytest.approx(GAUSSIAN_LLOYD_MAX_MSE[bits], rel=0.05)


def test_bits_per_element_counts_metadata() -> None:
    for dim in (64, 128, 256):
        raw = Codec("raw", dim, 4).bits_per_element(1)
        assert 16.0 < raw < 16.05
        tq4 = Codec("tq4", dim, 4).bits_per_element(1)
        assert 4.0 + 16 / dim < tq4 < 4.0 + 16 / dim + 0.1
    # ordering of the ladder
    bpe = {p: Codec(p, 128, 4).bits_per_element(1) for p in PRESETS}
    assert (bpe["raw"] > bpe["k16v4"] > bpe["k16v3"] > bpe["k8v8"] > bpe["k8v4"] > bpe["k5v4"]
            > bpe["tq4"] > bpe["k4v3"] > bpe["tq3"] > bpe["k3v2"] > bpe["tq2"])
    # raw keys cost 16 bits, the values their own bits plus a scale per vector
    assert bpe["k16v4"] == pytest.approx((16 + 4 + 16 / 128) / 2, abs=0.01)
    assert bpe["k8v8"] == pytest.approx(8 + 16 / 128, abs=0.01)


# ---- refusal of bad input ------------------------------------------------------------------
@pytest.fixture
def chunk() -> tuple[Codec, bytes]:
    codec = Codec("tq4", 64, 4)
    k, v = kv(20, 2, 64)
    return codec, codec.encode(1, k, v, tag=5).to_bytes()


def test_body_bit_flip_is_a_checksum_error(chunk) -> None:
    codec, data = chunk
    for pos in (HEADER_BYTES, HEADER_BYTES + 100, len(data) - 1):
        bad = bytearray(data)
        bad[pos] ^= 0x10
        with pytest.raises(ChecksumError):
            codec.decode(1, bytes(bad))


def test_header_bit_flip_is_refused(chunk) -> None:
    codec, data = chunk
    for pos in range(0, HEADER_BYTES):
        bad = bytearray(data)
        bad[pos] ^= 0x01
        with pytest.raises(FormatError):
            codec.decode(1, bytes(bad))


def test_truncated_payload(chunk) -> None:
    codec, data = chunk
    for n in (0, 10, HEADER_BYTES, len(data) - 16, len(data) - 1):
        with pytest.raises(FormatError):
            codec.decode(1, data[:n])
    with pytest.raises(TruncatedPayloadError):
        codec.decode(1, data[: len(data) - 1])


def test_foreign_bytes_and_versions(chunk) -> None:
    codec, data = chunk
    with pytest.raises(FormatError, match="magic"):
        codec.decode(1, b"GGUF" + data[4:])
    with pytest.raises(FormatError):
        codec.decode(1, bytes(range(256)) * 4)
    from turbowire.codec.wire import ChunkHeader

    header = parse_header(data)
    future = ChunkHeader(**{**header.__dict__, "version": 9}).pack()
    with pytest.raises(UnsupportedVersionError):
        codec.decode(1, future + data[HEADER_BYTES:])


def test_wrong_decoder_is_refused_with_the_differing_field(chunk) -> None:
    _, data = chunk
    with pytest.raises(IncompatiblePayloadError, match="preset tq4"):
        Codec("tq3", 64, 4).decode(1, data)
    with pytest.raises(IncompatiblePayloadError, match="layer 1"):
        Codec("tq4", 64, 4).decode(2, data)
    with pytest.raises(IncompatiblePayloadError, match="model layers"):
        Codec("tq4", 64, 8).decode(1, data)
    with pytest.raises(IncompatiblePayloadError, match="tag"):
        Codec("tq4", 64, 4).decode(1, data, expected_tag=6)


def test_bad_construction_and_inputs() -> None:
    with pytest.raises(UnknownPresetError, match="known presets"):
        Codec("tq9", 64, 4)
    with pytest.raises(GeometryError, match="head_dim 100"):
        Codec("tq4", 100, 4)
    codec = Codec("tq4", 64, 4)
    k, v = kv(4, 2, 64)
    with pytest.raises(GeometryError):
        codec.encode(4, k, v)
    with pytest.raises(GeometryError):
        codec.encode(0, k.float(), v.float())
    with pytest.raises(GeometryError):
        codec.encode(0, k, v[:3])
