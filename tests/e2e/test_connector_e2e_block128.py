"""Real engines at vLLM CPU's default block size (128), preset ``raw``: on an AMX machine bf16
caches then use the ``amx`` attention layout (K and V in VNNI pairs), elsewhere ``vec``; either
way greedy outputs through the proxy equal a single engine's, for prompts inside one block,
across block boundaries and with a partial last block, and for a prompt whose prefix the decode
engine already caches up to a point that is not block-aligned."""

from __future__ import annotations

import pytest
from conftest import VLLM_CPU_DEFAULT_BLOCK_SIZE, PDStack, start_stack
from test_connector_e2e_raw import pd, prompt_ids, single

pytestmark = pytest.mark.e2e

BS = VLLM_CPU_DEFAULT_BLOCK_SIZE


def staging_bytes(slots: int) -> int:
    from turbowire.codec import Codec
    from turbowire.connector.geometry import KVGeometry, LayerSpec, StagingLayout

    geo = KVGeometry(tuple(LayerSpec(f"l.{i}", 2, 64) for i in range(2)), BS, "bfloat16")
    return StagingLayout.build(geo, Codec("raw", 64, 2).encoded_nbytes, 1 << 30).slot_bytes * slots


@pytest.fixture(scope="module")
def stack(tiny_model, engine_slot, tmp_path_factory):
    group, st = start_stack(tiny_model, "raw", tmp_path_factory.mktemp("logs-bs128"),
                            staging_bytes(24), block_size=BS)
    yield st
    group.stop()


@pytest.mark.parametrize("n", [9, BS - 1, BS + 1, 3 * BS + 57])
def test_greedy_equals_single_engine_at_block_128(stack: PDStack, n: int):
    prompt = prompt_ids(5000 + n, n)
    out = pd(stack, prompt, request_id=f"bs128-{n}")
    load = out["kv_transfer_params"]["turbowire_load"]
    assert load["failed"] is None and load["tokens"] == n
    assert out["choices"][0]["text"] == single(stack, prompt)


def test_prefix_cached_up_to_a_non_aligned_point(stack: PDStack):
    shared = prompt_ids(6001, 2 * BS + 40)  # 2 full blocks and 40 tokens of a third
    first = shared + prompt_ids(6002, 5)
    second = shared + prompt_ids(6003, BS)
    pd(stack, first)
    out = pd(stack, second)
    load = out["kv_transfer_params"]["turbowire_load"]
    assert load["failed"] is None
    # vLLM's prefix cache holds whole blocks only: the 2 full shared blocks stay local
    assert load["tokens"] == len(second) - 2 * BS
    assert out["choices"][0]["text"] == single(stack, second)


def test_engine_logs_state_the_cpu_attention_layout(stack: PDStack):
    """turbowire's INFO lines reach the engine log with vLLM's prefix: an operator sees which
    ISA's KV placement the connector probed and which implementation serves it."""
    import re

    for engine in (stack.prefill, stack.decode):
        text = engine.log_path.read_text(errors="replace")
        line = re.search(r"INFO .*\[\w+\.py:\d+\] vLLM CPU attention isa (\w+) .*block size "
                         rf"{BS}.*turbowire serves it with (.*)", text)
        assert line, f"no layout line in {engine.log_path}"
        assert line.group(1) in ("amx", "vec", "vec16", "neon", "rvv", "vxe", "vsx")
        assert "C codec" in line.group(2)
