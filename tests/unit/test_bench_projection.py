"""Unit tests of the GPU-scale projection model (bench/e2e/projection.py)."""

from __future__ import annotations

import pytest

from turbowire.bench_e2e.projection import (
    LLAMA_31_8B,
    LLAMA_31_70B,
    ModelKV,
    PresetRates,
    markdown,
    project,
    project_one,
    wire_ratio_from_codec,
)

FAST = PresetRates("tq4", 4.0, encode_dense_bps=2e12, decode_dense_bps=2e12, source="test")


def test_llama_kv_sizes_per_token() -> None:
    assert LLAMA_31_8B.bytes_per_token == 32 * 2 * 8 * 128 * 2 == 131072
    assert LLAMA_31_70B.bytes_per_token == 80 * 2 * 8 * 128 * 2 == 327680
    with pytest.raises(ValueError):
        ModelKV("bad", 0, 8, 128)


def test_dense_time_is_bytes_over_link() -> None:
    row = project_one(LLAMA_31_8B, 8192, 100.0, FAST)
    dense = 8192 * 131072
    assert row.dense_bytes == dense
    assert row.dense_s == pytest.approx(dense / 12.5e9)
    assert row.wire_bytes == dense // 4
    # critical path: wire + decode; serial adds the encode; encode is charged to the prefill
    assert row.turbowire_s == pytest.approx(dense / 4 / 12.5e9 + dense / 2e12)
    assert row.serial_s == pytest.approx(row.turbowire_s + dense / 2e12)
    assert row.prefill_added_s == pytest.approx(dense / 2e12)
    assert 3.5 < row.speedup < 4.0 and row.speedup_serial < row.speedup


def test_efficiency_scales_link_time_only() -> None:
    a = project_one(LLAMA_31_70B, 32768, 25.0, FAST, efficiency=1.0)
    b = project_one(LLAMA_31_70B, 32768, 25.0, FAST, efficiency=0.5)
    assert b.dense_s == pytest.approx(2 * a.dense_s)
    dec = a.dense_bytes / 2e12
    assert b.turbowire_s - dec == pytest.approx(2 * (a.turbowire_s - dec))
    with pytest.raises(ValueError):
        project_one(LLAMA_31_70B, 32768, 25.0, FAST, efficiency=0.0)


def test_slow_kernels_can_lose_on_a_fast_link() -> None:
    slow = PresetRates("tq4", 4.0, encode_dense_bps=1e9, decode_dense_bps=1e9, source="cpu")
    row = project_one(LLAMA_31_8B, 8192, 400.0, slow)
    assert row.speedup < 1.0


def test_grid_and_table() -> None:
    rows = project([LLAMA_31_8B, LLAMA_31_70B], [8192, 32768, 131072], [25, 100, 400], [FAST])
    assert len(rows) == 18
    table = markdown(rows)
    assert table.count("\n") == 19 and "| Llama-3.1-70B | 128k | 400 | tq4 |" in table
    with pytest.raises(ValueError):
        PresetRates("x", 0.5, 1.0, 1.0, "bad")


def test_wire_ratio_from_codec_counts_headers() -> None:
    raw = wire_ratio_from_codec("raw")
    tq4 = wire_ratio_from_codec("tq4")
    assert 0.95 < raw <= 1.0  # headers make raw slightly larger than dense
    assert 3.0 < tq4 < 4.0


def test_rw_rates_convert_to_dense_rates() -> None:
    from turbowire.bench_e2e.projection import rates_from_rw

    r = rates_from_rw("tq4", 1.0e12, 2.0e12, "test", wire_ratio=4.0)
    assert r.encode_dense_bps == pytest.approx(0.8e12)
    assert r.decode_dense_bps == pytest.approx(1.6e12)
    assert r.wire_ratio == 4.0
