"""The GPU path of an MLA model (DeepSeek V2/V3): each layer's cache rows (a 512 latent + a
64-wide RoPE part, ``[num_blocks, 1, block_size, 576]`` as vLLM registers them) move as latent
chunks. The prefill worker must stage exactly the chunks the reference
(``turbowire.codec.latent``) encodes from those rows; the decode worker's loader must write
exactly the reference's decode into its own blocks (the RoPE part byte for byte) and leave every
other block and a partial block's slots past the loaded tokens untouched."""

from __future__ import annotations

from typing import Any

import torch

from bench.gpu_path import fakes
from bench.gpu_path.check import first_mismatch
from bench.gpu_path.rig import (
    BLOCK,
    DEVICE,
    SMOKE,
    attach_loader,
    drain,
    fill_recv,
    layer_names,
    sync,
)
from turbowire.codec.latent import decode_latent, encode_latent
from turbowire.connector.metadata import TurboWireConnectorMetadata

GUARD = 7.0
LATENT, ROPE = 512, 64


def _worker(preset: str, role: str, engine_id: str, nb: int, layers: int) -> Any:
    extra = {"preset": preset, "staging_bytes": 32 << 20, "recv_bytes": 32 << 20,
             "nixl_progress_delay_us": 0}
    return fakes.build_worker(extra, layer_names(layers), engine_id=engine_id, kv_role=role,
                              block_size=BLOCK, num_kv_heads=1, head_size=LATENT + ROPE,
                              num_blocks=nb, mla_rope_dim=ROPE)


def _caches(nb: int, layers: int, seed: int, guard: bool) -> dict[str, torch.Tensor]:
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    return {n: (torch.full((nb, 1, BLOCK, LATENT + ROPE), GUARD, device=DEVICE) if guard
                else torch.randn(nb, 1, BLOCK, LATENT + ROPE, generator=g, device=DEVICE)
                ).to(torch.bfloat16) for n in layer_names(layers)}


def _rows(cache: torch.Tensor, table: list[int], start: int, count: int) -> torch.Tensor:
    t = torch.arange(start, start + count)
    return cache[:, 0][torch.tensor(table)[t // BLOCK].to(cache.device),
                       (t % BLOCK).to(cache.device)]


def latent_check(preset: str, log: Any) -> dict[str, Any]:
    """See the module; ``ok`` is every part."""
    out: dict[str, Any] = {"preset": preset, "check": "latent_check"}
    layers, nb = (2, 16) if SMOKE else (4, 96)
    ntok = 70 if SMOKE else 600
    n_blocks = -(-ntok // BLOCK)
    perm = torch.randperm(nb, generator=torch.Generator().manual_seed(9)).tolist()
    src = _caches(nb, layers, 31, guard=False)
    p = _worker(preset, "kv_producer", "P-mla", nb, layers)
    p.register_kv_caches(src)
    out["coder"] = type(p.coder).__name__
    meta = TurboWireConnectorMetadata(saves=[fakes.save_request("m", perm[:n_blocks], ntok,
                                                                BLOCK)])
    save = meta.saves[0]
    p.wait_for_save(meta)
    sync()
    bad = []
    for layer, name in enumerate(layer_names(layers)):
        for b in save.blocks:
            rows = _rows(src[name], save.block_ids, b.index * BLOCK, b.num_tokens)
            ref = encode_latent(p.codec, layer, rows[:, :LATENT].contiguous(),
                                rows[:, LATENT:].contiguous(), tag=b.tag,
                                token_offset=b.index * BLOCK).data
            at = p.layout.chunk_offset(b.slot, layer)
            if first_mismatch(p.staging[at:at + ref.numel()], ref) is not None:
                bad.append((layer, b.index))
    out["encode_bitexact"] = not bad

    d = _worker(preset, "kv_consumer", "D-mla", nb, layers)
    dst = _caches(nb, layers, 32, guard=True)
    d.register_kv_caches(dst)
    attach_loader(d, p)
    rperm = torch.randperm(nb, generator=torch.Generator().manual_seed(10)).tolist()
    table = rperm[:n_blocks]
    load = fakes.load_request("dm", save, table, preset)
    landed = fill_recv(d, p, save)  # the READs' bytes, where the loader lands them
    offs, sizes = landed.offsets, landed.sizes
    d.start_load_kv(TurboWireConnectorMetadata(loads=[load]))
    fin, failed = drain(d)
    sync()
    out["load_finished"] = fin == {"dm"} and not failed
    bad_decode, rope_exact = [], True
    for layer, name in enumerate(layer_names(layers)):
        want = torch.full_like(dst[name], GUARD)
        for bi, b in enumerate(load.blocks):
            at, n = int(offs[layer, bi]), int(sizes[layer, bi])
            latent, rope = decode_latent(d.codec, layer, d.recv[at:at + n], LATENT, ROPE,
                                         expected_tag=b.tag)
            want[table[b.index], 0, :b.num_tokens] = torch.cat([latent, rope], dim=-1)
        if first_mismatch(dst[name], want) is not None:
            bad_decode.append(name)
        got = _rows(dst[name], table, 0, ntok)[:, LATENT:]
        rope_exact &= bool(torch.equal(got, _rows(src[name], save.block_ids, 0, ntok)[:,
                                                                                        LATENT:]))
    out["decode_bitexact"] = not bad_decode
    out["rope_exact"] = rope_exact
    out["ok"] = bool(out["encode_bitexact"] and out["load_finished"] and out["decode_bitexact"]
                     and rope_exact)
    log(f"[latent check] {preset}: ok={out['ok']} coder {out['coder']} {bad or ''}"
        f"{bad_decode or ''}")
    return out
