"""One benchmark case (tokens x preset): its config, the pair of workers it runs on, and the
save, load and timeline parts, each a function of its own returning its part of the result."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from bench.gpu_path import load as load_part
from bench.gpu_path import save as save_part
from bench.gpu_path.check import first_mismatch, reference_staging
from bench.gpu_path.rig import (
    BLOCK,
    DEVICE,
    MODEL,
    SMOKE,
    Forward,
    attach_loader,
    fill_recv,
    freeze_gc_heap,
    layer_names,
    make_worker,
    save_meta,
    sync,
    use_coder,
)
from bench.gpu_path.timeline import run_timeline
from turbowire.codec import Codec

Log = Any


@dataclass
class CaseConfig:
    tokens: int
    preset: str
    rounds: int  # paired rounds of the save variants
    loads: int  # loads per load kind
    encode_cap: int = 0  # also a save variant with the encoder capped at N registers
    decode_variants: list[str] = field(default_factory=list)
    timeline: bool = False

    @property
    def tag(self) -> str:
        return f"{self.tokens}_{self.preset}"


def case_ok(r: dict[str, Any]) -> bool:
    """Bit-exact: every save variant staged the same bytes, every load decoded what the
    one-launch decode does, the spot chunks equal the reference codec's."""
    spot = r.get("reference_spot_check", {})
    loads = [v for k, v in r.items() if k.startswith("decode_equal_")]
    return bool(r.get("staging_equal") and all(r["staging_equal"].values()) and loads
                and all(loads) and r.get("timeline", {}).get("decode_equal", True)
                and spot.get("encode_equal_reference") and spot.get("decode_equal_reference"))


def run_case(cfg: CaseConfig, log: Log) -> dict[str, Any]:
    """Prefill worker -> save rounds -> the request into the decode worker -> loads."""
    layers, heads, dim = MODEL["layers"], MODEL["kv_heads"], MODEL["head_dim"]
    names = layer_names(layers)
    nblk = (cfg.tokens + BLOCK - 1) // BLOCK
    nb = nblk + 64
    codec = Codec(cfg.preset, dim, layers)
    per_slot = sum(codec.encoded_nbytes(i, BLOCK, heads) + 64 for i in range(layers))
    pool = max(1 << 20, per_slot * (nblk + 8))  # the config's floor: 64 KiB
    g = torch.Generator(device=DEVICE).manual_seed(5)
    src = {n: torch.randn(2, nb, BLOCK, heads, dim, generator=g, device=DEVICE)
           .to(torch.bfloat16) for n in names}
    perm = torch.randperm(nb, generator=torch.Generator().manual_seed(7)).tolist()
    p_ids, d_ids = perm[:nblk], perm[::-1][:nblk]
    t = torch.arange(cfg.tokens)
    slot_mapping = (torch.tensor(p_ids)[t // BLOCK] * BLOCK + t % BLOCK).to(DEVICE)
    p = make_worker(cfg.preset, "kv_producer", f"P-{cfg.tag}", nb, pool, layers, heads, dim)
    p.register_kv_caches(src)
    d_caches = {n: torch.zeros(2, nb, BLOCK, heads, dim, device=DEVICE, dtype=torch.bfloat16)
                for n in names}
    d = make_worker(cfg.preset, "kv_consumer", f"D-{cfg.tag}", nb, pool, layers, heads, dim)
    d.register_kv_caches(d_caches)
    use_coder(d)
    transport = attach_loader(d, p)
    rid = f"req-{cfg.tokens}"
    saves = save_part.build(p, Forward(cfg.tokens, src, slot_mapping), rid, p_ids, cfg.tokens,
                            cfg.encode_cap)
    r: dict[str, Any] = {"tokens": cfg.tokens, "preset": cfg.preset,
                         "kernel_config": repr(saves.coders["layer"].kernel_config)}
    try:
        r.update(save_case(cfg, saves, log))
        r.update(load_case(cfg, saves, d, transport, d_ids, src, log))
    finally:
        for w in (p, d):
            w.shutdown()
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
    return r


def save_case(cfg: CaseConfig, saves: save_part.SaveRig, log: Log) -> dict[str, Any]:
    """The paired rounds of the save variants and the staged bytes of each."""
    p = saves.p
    assert p.staging is not None
    p.staging.fill_(0xA5)  # poisoned: padding bytes are never written
    saves.step("layer")()
    sync()
    reference = p.staging.clone()
    for v in [] if SMOKE else ["forward", *saves.coders]:  # warm: compiled, plans built
        saves.step(v)()
    sync()
    freeze_gc_heap()
    r = save_part.run_save(saves, cfg.rounds)
    r["staging_equal"] = save_part.staging_equal(saves, reference)
    p.staging.copy_(reference)  # what the decode worker's loads READ
    log(f"  {cfg.tag} save: forward {r['forward_ms']:.2f} ms, "
        + ", ".join(f"{v} {r[v + '_pct']:+.2f}%" for v in [*r["variants"], "legacy"])
        + f", A/A {r['aa_pct']:+.2f}%, alone {r['save_alone_ms'] or 0:.3f} ms")
    return r


def load_case(cfg: CaseConfig, saves: save_part.SaveRig, d: Any, transport: Any,
              d_ids: list[int], src: dict[str, torch.Tensor], log: Log) -> dict[str, Any]:
    """The request's staged bytes into the decode worker's receive buffer (its blocks at
    ``d_ids``), then the loads."""
    p = saves.p
    names = list(src)
    meta = save_meta(saves.rid, saves.block_ids, cfg.tokens)
    save = meta.saves[0]
    offsets = fill_recv(d, p, save)
    rig = load_part.build(d, transport, save, saves.rid, cfg.preset, d_ids, offsets, names)
    refs = reference_staging(p, save_meta(saves.rid, saves.block_ids, cfg.tokens), names, src)

    def encoded_equal(pick: list[int], layer: int) -> bool:
        wanted = {f"layer {layer} token {save.blocks[bi].index * BLOCK}" for bi in pick}
        assert p.staging is not None
        return all(first_mismatch(p.staging[at:at + n], ref[at:at + n]) is None
                   for label, ref, at, n in refs if label in wanted)

    freeze_gc_heap()
    r = load_part.run_load(rig, cfg.loads)
    r["reference_spot_check"] = load_part.spot_check(rig, encoded_equal)
    if cfg.decode_variants and cfg.tokens <= 8192:
        r["decode_variants"] = load_part.decode_variants(rig, cfg.decode_variants, log)
    if cfg.timeline:
        r["timeline"] = run_timeline(rig, cfg.tag, log, loads=2 if SMOKE else 12)
    log(f"  {cfg.tag} load: landed -> finished {r['load_ms']:.3f} ms ({r['load_launches']} "
        f"launches, to first {r['load_to_first_launch_ms'] or 0:.3f}, launch host "
        f"{r['load_launch_host_ms'] or 0:.3f}, after {r['load_after_last_launch_ms'] or 0:.3f})"
        f" vs one launch {r['decode_one_launch_ms']:.3f} ms = {r['load_vs_one_launch']:.2f}x; "
        f"at once {r['load_all_at_once_ms']:.3f} ms, two polls {r['load_two_polls_ms']:.3f} ms")
    return r

