"""Which KV cache kinds the connector serves, on the groups vLLM itself builds from per-layer
specs (``get_kv_cache_groups``, with its hybrid KV cache manager off and on): full attention and
sliding windows are served (interleaved with full layers and the manager off, vLLM promotes the
windows to full-attention allocation; with the manager on, the sliding layers get a group of
their own, and each layer takes its blocks from its group's table; on every layer, vLLM frees
the blocks the window leaves, which the geometry records), everything else is refused at start
in turbowire's own words."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from vllm.v1.core.kv_cache_utils import get_kv_cache_groups
from vllm.v1.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)

from turbowire.connector.geometry import GeometryError, KVGeometry

SHAPE = dict(block_size=32, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
NO_HMA = SimpleNamespace(scheduler_config=SimpleNamespace(disable_hybrid_kv_cache_manager=True))
HMA = SimpleNamespace(
    scheduler_config=SimpleNamespace(disable_hybrid_kv_cache_manager=False),
    # one page size per layer kind here: vLLM packs no mixed pages, the layout does not matter
    cache_config=SimpleNamespace(
        get_resolved_kv_cache_layout=lambda: SimpleNamespace(is_block_outermost=False)),
    speculative_config=None, model_config=None)


def layer_specs(kinds: str, window: int = 64) -> dict:
    """Per-layer specs: ``s`` a sliding-window layer, ``f`` full attention, ``m`` MLA."""
    make = {"s": lambda: SlidingWindowSpec(sliding_window=window, **SHAPE),
            "f": lambda: FullAttentionSpec(**SHAPE),
            "m": lambda: MLAAttentionSpec(**{**SHAPE, "num_kv_heads": 1, "head_size": 576})}
    return {f"model.layers.{i}.self_attn.attn": make[k]() for i, k in enumerate(kinds)}


def vllm_config_of(kinds: str, hma: bool = False) -> KVCacheConfig:
    groups = get_kv_cache_groups(HMA if hma else NO_HMA, layer_specs(kinds))
    return KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=groups)


@pytest.mark.parametrize("kinds", ["ffff", "sfsf", "sssssf", "fs", "ssss"])
def test_full_and_sliding_layers_are_served_in_model_order(kinds):
    geo = KVGeometry.from_kv_cache_config(vllm_config_of(kinds))
    assert [layer.name for layer in geo.layers] == list(layer_specs(kinds))
    assert {(layer.num_kv_heads, layer.head_dim) for layer in geo.layers} == {(2, 64)}
    assert geo.block_size == 32 and geo.dtype == "bfloat16"
    # only a model whose every layer slides has blocks freed under it
    assert geo.frees_out_of_window == (set(kinds) == {"s"})


@pytest.mark.parametrize("transport", ["store", "both"])
def test_the_store_refuses_a_model_whose_every_layer_slides(transport):
    """A stored chunk spans blocks the window freed: refused at start, naming the fix."""
    from support.fakes import stand_in_configs

    from turbowire.connector.config import ConnectorConfigError, TurboWireConfig
    from turbowire.connector.spec import EngineSetup

    extra = {"preset": "tq4", "staging_bytes": "1MiB", "transport": transport,
             "store_url": "redis://127.0.0.1:1"}
    names = list(layer_specs("ssss"))
    vcfg, _ = stand_in_configs(extra, names, block_size=32, num_kv_heads=2, head_size=64,
                               num_blocks=64, engine_id="e")
    vcfg.model_config.get_num_layers = lambda parallel_config: len(names)
    cfg = TurboWireConfig.from_extra_config(extra, environ={})
    with pytest.raises(ConnectorConfigError, match="every layer has a sliding window.*'nixl'"):
        EngineSetup.build(vcfg, vllm_config_of("ssss"), cfg)
    # interleaved: the store serves it with the hybrid manager off, not with its groups
    EngineSetup.build(vcfg, vllm_config_of("sfsf"), cfg)
    with pytest.raises(ConnectorConfigError, match="sliding-window group.*disable-hybrid"):
        EngineSetup.build(vcfg, vllm_config_of("sfsf", hma=True), cfg)


def test_mla_latents_are_served_given_the_rope_width():
    """vLLM's MLA group (one 576-wide row per token): 512 latent as 4 vectors of 128, and the
    RoPE part the model config names; without that width the row cannot be split."""
    geo = KVGeometry.from_kv_cache_config(vllm_config_of("mm"), mla_rope_dim=64)
    assert [(layer.latent_dim, layer.rope_dim, layer.head_dim) for layer in geo.layers] == \
        [(512, 64, 128)] * 2
    assert geo.dense_bytes_per_token(2) == 2 * 576 * 2
    with pytest.raises(GeometryError, match="qk_rope_head_dim"):
        KVGeometry.from_kv_cache_config(vllm_config_of("mm"))


@pytest.mark.parametrize("kinds", ["sfsf", "sssssf", "fssf"])
def test_the_hybrid_managers_groups_are_served_each_layer_in_its_group(kinds):
    """vLLM's own grouping with the manager on: full and sliding layers in groups of their
    own (groups of equal size, so 5 sliding layers beside 1 full one make 6 groups); the
    geometry keeps model order and records each layer's group."""
    config = vllm_config_of(kinds, hma=True)
    assert len(config.kv_cache_groups) >= 2
    geo = KVGeometry.from_kv_cache_config(config)
    assert geo.num_groups == len(config.kv_cache_groups)
    assert [layer.name for layer in geo.layers] == list(layer_specs(kinds))
    for layer in geo.layers:
        group = config.kv_cache_groups[layer.group]
        assert layer.name in group.layer_names
    kinds_of = {type(g.kv_cache_spec).__name__ for g in config.kv_cache_groups}
    assert kinds_of == {"FullAttentionSpec", "SlidingWindowSpec"}
    assert geo.frees_out_of_window
    # the manager off: one group, nothing freed under an interleaved model
    assert KVGeometry.from_kv_cache_config(vllm_config_of(kinds)).num_groups == 1


def test_groups_of_other_kinds_are_still_refused():
    names = list(layer_specs("ff"))
    config = KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(names[:1], FullAttentionSpec(**SHAPE)),
        KVCacheGroupSpec(names[1:], ChunkedLocalAttentionSpec(**SHAPE,
                                                              attention_chunk_size=64)),
    ])
    with pytest.raises(GeometryError, match="ChunkedLocalAttentionSpec.*not supported"):
        KVGeometry.from_kv_cache_config(config)


def mamba_spec(mode: str = "align", spec_blocks: int = 0) -> MambaSpec:
    """A gated-delta-net layer's state as vLLM specs it: a bf16 conv state and an fp32 SSM
    state in one page padded to an attention page; with prefix caching off (mode 'none') one
    block per request, of the model's length."""
    return MambaSpec(block_size=32 if mode == "align" else 4096, shapes=((3, 256), (4, 32, 32)),
                     dtypes=(torch.bfloat16, torch.float32), page_size_padded=32768,
                     mamba_cache_mode=mode, num_speculative_blocks=spec_blocks)


def hybrid_config(**spec) -> KVCacheConfig:
    """Qwen3-Next-style: GDN layers 0 and 2 (group 0), full attention on 1 and 3 (group 1)."""
    names = [f"model.layers.{i}.{'linear_attn' if i % 2 == 0 else 'self_attn.attn'}"
             for i in range(4)]
    return KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(names[0::2], mamba_spec(**spec)),
        KVCacheGroupSpec(names[1::2], FullAttentionSpec(**SHAPE)),
    ])


@pytest.mark.parametrize("mode", ["align", "none"])
def test_a_hybrid_models_state_layers_follow_its_attention_layers(mode):
    """The codec codes the attention layers (its indices 0..n-1); each state layer keeps its
    group and its state bytes (conv 3 x 256 bf16 + SSM 4 x 32 x 32 fp32), not the padding; the
    blocks are the attention layers' (a state group's block size does not place a state)."""
    geo = KVGeometry.from_kv_cache_config(hybrid_config(mode=mode))
    assert geo.block_size == 32
    assert [layer.name for layer in geo.layers] == [
        "model.layers.1.self_attn.attn", "model.layers.3.self_attn.attn",
        "model.layers.0.linear_attn", "model.layers.2.linear_attn"]
    assert [layer.is_state for layer in geo.layers] == [False, False, True, True]
    assert [layer.group for layer in geo.layers] == [1, 1, 0, 0]
    assert geo.layers[2].state_bytes == 3 * 256 * 2 + 4 * 32 * 32 * 4
    assert geo.num_attention_layers == 2 and geo.state_groups == frozenset({0})
    assert geo.head_dim == 64 and geo.dense_bytes_per_token() == 2 * 2 * 2 * 64 * 2
    from turbowire.connector.codecs import chunk_nbytes, make_codec

    codec = make_codec("tq4", geo)
    assert codec.num_layers == 2
    assert chunk_nbytes(codec, geo, 3, 5, 0) == chunk_nbytes(codec, geo, 3, 32, 7) == 32 + 17920


def test_a_slot_mostly_reserved_for_state_is_said_at_start():
    """Every staging slot reserves room for each state layer's chunk (only a request's last
    block moves one): when that is most of a slot, the prefill engine says so with the blocks
    the pool holds; a plain model, or a state that is a small part, says nothing."""
    from turbowire.connector.codecs import chunk_nbytes, make_codec
    from turbowire.connector.geometry import StagingLayout

    geo = KVGeometry.from_kv_cache_config(hybrid_config())
    codec = make_codec("tq4", geo)

    def sizer(layer: int, tokens: int, heads: int) -> int:
        return chunk_nbytes(codec, geo, layer, tokens, 0)

    layout = StagingLayout.build(geo, sizer, 8 << 20)
    note = layout.state_note(geo)
    assert note is not None and "state of 2 Mamba / linear-attention layers" in note
    assert f"holds {layout.num_slots} blocks ({layout.num_slots * 32} tokens" in note
    plain = KVGeometry.from_kv_cache_config(KVCacheConfig(
        num_blocks=8, kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["model.layers.0.self_attn.attn"],
                                          FullAttentionSpec(**SHAPE))]))
    pcodec = make_codec("tq4", plain)
    assert StagingLayout.build(plain, lambda i, t, h: chunk_nbytes(pcodec, plain, i, t, 0),
                               8 << 20).state_note(plain) is None


def test_speculative_decoding_on_a_hybrid_is_refused():
    with pytest.raises(GeometryError, match="speculative decoding on a hybrid model"):
        KVGeometry.from_kv_cache_config(hybrid_config(spec_blocks=2))


def test_only_the_block_with_the_state_at_the_prompts_end_moves():
    """vLLM keeps the running state in a state group's last block (mode 'align': the block of
    the last computed token; mode 'none': the request's one block); it moves at the position of
    the prompt's last block."""
    from turbowire.connector.geometry import keep_state_blocks
    from turbowire.kernels import NO_BLOCK

    align = [[NO_BLOCK, 7, 9], [1, 2, 3, 4]]
    assert keep_state_blocks(align, frozenset({0}), 3) == [[NO_BLOCK, NO_BLOCK, 9],
                                                           [1, 2, 3, 4]]
    assert keep_state_blocks([[5], [1, 2, 3]], frozenset({0}), 3)[0] == [NO_BLOCK, NO_BLOCK, 5]
    # a step that does not finish the prompt stages no state
    assert keep_state_blocks(align, frozenset({0}), 3, final=False)[0] == [NO_BLOCK] * 3
    assert keep_state_blocks(align, frozenset(), 3) is align


@pytest.mark.parametrize("transport", ["store", "both"])
def test_the_store_refuses_a_hybrid_model(transport):
    """A stored chunk carries K/V only; a later request could not resume the state from it."""
    from support.fakes import stand_in_configs

    from turbowire.connector.config import ConnectorConfigError, TurboWireConfig
    from turbowire.connector.spec import EngineSetup

    extra = {"preset": "tq4", "staging_bytes": "1MiB", "transport": transport,
             "store_url": "redis://127.0.0.1:1"}
    names = [f"model.layers.{i}.x" for i in range(4)]
    vcfg, _ = stand_in_configs(extra, names, block_size=32, num_kv_heads=2, head_size=64,
                               num_blocks=64, engine_id="e")
    vcfg.model_config.get_num_layers = lambda parallel_config: len(names)
    cfg = TurboWireConfig.from_extra_config(extra, environ={})
    with pytest.raises(ConnectorConfigError, match="does not serve hybrid models.*'nixl'"):
        EngineSetup.build(vcfg, hybrid_config(), cfg)



@pytest.mark.parametrize("head_size", [96, 100])
def test_other_head_sizes_are_served_and_the_ones_no_preset_codes_refused_at_start(head_size):
    """Phi-3's 96-wide heads are coded (the Lloyd-Max streams pad them to 128); a head size
    that is no multiple of 8 is refused when the engine starts, in turbowire's words."""
    from support.fakes import stand_in_configs

    from turbowire.codec import GeometryError as CodecGeometryError
    from turbowire.connector.config import TurboWireConfig
    from turbowire.connector.spec import EngineSetup

    extra = {"preset": "tq4", "staging_bytes": "1MiB"}
    names = [f"model.layers.{i}.self_attn.attn" for i in range(4)]
    vcfg, _ = stand_in_configs(extra, names, block_size=32, num_kv_heads=2,
                               head_size=head_size, num_blocks=64, engine_id="e")
    vcfg.model_config.get_num_layers = lambda parallel_config: len(names)
    spec = FullAttentionSpec(**{**SHAPE, "head_size": head_size})
    groups = get_kv_cache_groups(NO_HMA, dict.fromkeys(names, spec))
    kv = KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=groups)
    cfg = TurboWireConfig.from_extra_config(extra, environ={})
    if head_size % 8:
        with pytest.raises(CodecGeometryError, match=f"head_dim {head_size} is not supported"):
            EngineSetup.build(vcfg, kv, cfg)
    else:
        setup = EngineSetup.build(vcfg, kv, cfg)
        assert setup.geometry.head_dim == head_size and setup.codec.head_dim == head_size
