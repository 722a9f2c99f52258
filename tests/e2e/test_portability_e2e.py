"""The machine matrix, on real engines: the C codec forced to its generic build and left at the
best build this CPU runs, with bf16 and fp16 engines (``--dtype``), whatever CPU this is.

Per engine dtype, one prefill engine (core 0, tq4) and two decode engines on core 1 that differ
only in ``TURBOWIRE_CPU_ISA``: ``base`` (the generic C build, no SIMD) and the default (the best
variant this CPU supports). The prefill engine encodes with ``base``. Both decode engines read the
same compressed chunks for the same prompt; the C builds are bit-exact with the reference codec
(tests/unit/test_kernels_cpu.py), so their caches, and therefore their greedy answers, must be
identical. Each engine's log says which C build and which vLLM attention layout it runs: on an
AMX machine bf16 engines get vLLM's ``amx`` placement (the tiled C path), elsewhere ``vec``; fp16
engines get ``vec`` everywhere.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest
from conftest import BLOCK_SIZE, MODEL_NAME
from test_connector_e2e_raw import prompt_ids, staging_bytes_for

from turbowire.serving.launch import (
    EngineSpec,
    ManagedProcess,
    ProcessGroup,
    free_port,
    start_engine,
    start_proxy,
    turbowire_kv_config,
)

pytestmark = pytest.mark.e2e

PRESET = "tq4"
GENERIC = {"TURBOWIRE_CPU_ISA": "base"}


@dataclass
class Matrix:
    dtype: str
    prefill: ManagedProcess
    decoders: dict[str, ManagedProcess]  # "base" / "best" -> decode engine
    proxies: dict[str, ManagedProcess]


@pytest.fixture(scope="module", params=["bfloat16", "float16"])
def matrix(request, tiny_model, engine_slot, tmp_path_factory) -> Iterator[Matrix]:
    dtype = request.param
    log_dir = tmp_path_factory.mktemp(f"logs-matrix-{dtype}")
    common = dict(kvcache_gib=1, block_size=BLOCK_SIZE, max_model_len=2048, max_num_seqs=8,
                  max_num_batched_tokens=1024, served_model_name=MODEL_NAME, dtype=dtype)
    cfg = dict(preset=PRESET, staging_bytes=staging_bytes_for(PRESET, 32), lease_seconds=10)

    def engine(name: str, cpu: int, env: dict[str, str]) -> ManagedProcess:
        kv = turbowire_kv_config(side_channel_port=free_port(), **cfg)
        return group.add(start_engine(EngineSpec(name, tiny_model, free_port(), cpu=cpu,
                                                 kv_transfer_config=kv, env=env, **common),
                                      log_dir))

    group = ProcessGroup()
    try:
        p = engine("prefill-base", 0, GENERIC)
        decoders = {"base": engine("decode-base", 1, GENERIC), "best": engine("decode-best", 1, {})}
        for e in (p, *decoders.values()):
            e.wait_healthy(900)
        proxies = {k: group.add(start_proxy([p.url], [d.url], free_port(), log_dir))
                   for k, d in decoders.items()}
        for x in proxies.values():
            x.wait_healthy(120)
            _complete(x.url, "warm up the connection please", 2)
        yield Matrix(dtype, p, decoders, proxies)
    finally:
        group.stop()


def _complete(url: str, prompt, max_tokens: int) -> dict:
    r = httpx.post(url + "/v1/completions", timeout=300, json={
        "model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()


def _layout_line(proc: ManagedProcess) -> re.Match[str]:
    text = proc.log_path.read_text(errors="replace")
    line = re.search(r"vLLM CPU attention isa (\w+) .*turbowire serves it with (.*)", text)
    assert line, f"no layout line in {proc.log_path}"
    return line


def test_each_engine_runs_the_c_build_and_layout_it_was_given(matrix: Matrix) -> None:
    import torch
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    from turbowire.kernels import cpu_binding

    want_isa = _get_attn_isa(getattr(torch, matrix.dtype), BLOCK_SIZE, 64)
    best = cpu_binding.supported_isas()[-1]
    for proc, build in ((matrix.prefill, "base"), (matrix.decoders["base"], "base"),
                        (matrix.decoders["best"], best)):
        line = _layout_line(proc)
        assert line.group(1) == want_isa, (proc.name, line.group(0))
        assert f"the C codec ({build})" in line.group(2), (proc.name, line.group(0))


@pytest.mark.parametrize("n", [7, BLOCK_SIZE + 1, 5 * BLOCK_SIZE + 19])
def test_generic_and_simd_decoders_answer_identically(matrix: Matrix, n: int) -> None:
    prompt = prompt_ids(91_000 + n + (1000 if matrix.dtype == "float16" else 0), n)
    answers = {}
    for kind, proxy in matrix.proxies.items():
        out = _complete(proxy.url, prompt, 16)
        load = out["kv_transfer_params"]["turbowire_load"]
        assert load["failed"] is None and load["tokens"] == n, (kind, load)
        answers[kind] = (out["choices"][0]["text"], load["wire_bytes"])
    assert answers["base"] == answers["best"], answers
