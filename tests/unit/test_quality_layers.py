"""The per-layer sensitivity sweep's policy derivation and table, on synthetic sweeps."""

from __future__ import annotations

import io

import pytest

from turbowire.quality.layers import (
    LayersConfig,
    LayerSweep,
    advise,
    plot,
    policy_lines,
    rich_tables,
)

N = 30


def sweep(per_layer: dict[str, list[float]]) -> LayerSweep:
    s = LayerSweep("m", N, LayersConfig(), list(range(N)))
    for preset, kls in per_layer.items():
        s.kl[preset] = {i: [kl, kl] for i, kl in enumerate(kls)}
        s.all_layers[preset] = [sum(kls)]
    return s


def test_flat_sensitivity_needs_no_boundary() -> None:
    s = sweep({"tq4": [1e-3] * N})
    a = advise(s, "tq4")
    assert a.boundary_layers == 0 and a.outside == []
    assert a.additivity == pytest.approx(1.0)
    assert a.pair_shares[0] == pytest.approx(2 / N)
    assert "keep Preset.boundary=None" in policy_lines(s)[-1]


def test_hot_edges_give_boundary_layers() -> None:
    kls = [1e-3] * N
    kls[0], kls[N - 1], kls[1] = 20e-3, 5e-3, 8e-3
    s = sweep({"tq3": kls, "tq4": [x / 4 for x in kls]})
    a = advise(s, "tq3")
    assert a.boundary_layers == 2  # pair (1, 28) still carries > 2x its even share
    assert a.outside == []
    lines = policy_lines(s)
    assert "Preset.boundary_layers=2 (layers 0, 1 and 28, 29)" in lines[-1]


def test_hot_middle_layers_are_reported_outside_the_boundary() -> None:
    kls = [1e-3] * N
    kls[18], kls[20] = 30e-3, 20e-3
    s = sweep({"tq2": kls, "k3v2": kls})
    a = advise(s, "tq2")
    assert a.boundary_layers == 0
    assert a.outside == [18, 20]
    assert [i for i, _ in a.top[:2]] == [18, 20]
    assert "layers 18 (2/2), 20 (2/2); only a per-layer policy" in policy_lines(s)[-1]


def test_tables_fit_80_columns_with_ten_presets(tmp_path) -> None:
    from rich.console import Console

    presets = ["k8v4", "tq4", "k4v3", "tq3", "k3v2", "tq2", "k5v4", "k16v4", "k16v3", "k8v8"]
    kls = [1e-3 * (1 + i % 7) for i in range(N)]
    kls[0] = 0.5  # a wide value
    s = sweep({p: kls for p in presets})
    out = io.StringIO()
    for table in rich_tables(s):
        Console(file=out, width=200).print(table)
    lines = out.getvalue().splitlines()
    assert max(len(line) for line in lines) <= 80
    assert sum(1 for line in lines if line.startswith("│ 0*")) == 2  # the mark, in both tables
    assert "k8v8" in out.getvalue()
    plot(s, tmp_path / "l.png")
    assert (tmp_path / "l.png").read_bytes()[:4] == b"\x89PNG"


def test_a_saved_sweep_gives_the_same_policy() -> None:
    import json

    kls = [1e-3] * N
    kls[23], kls[0] = 9e-3, 8e-3
    s = sweep({"tq4": kls, "tq3": [2 * x for x in kls]})
    again = LayerSweep.from_json(json.loads(json.dumps(s.to_json())))
    assert again.kl == s.kl and again.layers == s.layers
    assert policy_lines(again) == policy_lines(s)
    assert "layers 23 (2/2)" in policy_lines(s)[-1]
