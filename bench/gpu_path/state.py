"""The GPU path of a hybrid model (Mamba / gated-delta-net layers beside attention): each state
layer's state moves raw, one state chunk from the block its group's table keeps (the state at
the prompt's end), beside the attention layers' coded chunks. The prefill worker must stage the
state chunk exactly as the reference (``turbowire.codec.state``) builds it from that block and
the attention chunks as the reference codec encodes them; the decode worker's loader must write
the state byte for byte into its own block and nowhere else, decode the attention chunks as
the reference does, and clear a partial block's slots past the loaded tokens."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from bench.gpu_path import fakes
from bench.gpu_path.check import first_mismatch
from bench.gpu_path.rig import BLOCK, DEVICE, SMOKE, attach_loader, drain, layer_names, sync
from turbowire.codec.state import encode_state, state_chunk_nbytes
from turbowire.connector.geometry import keep_state_blocks
from turbowire.connector.metadata import TurboWireConnectorMetadata
from turbowire.connector.read_plan import chunk_sizes, held_chunks
from turbowire.kernels import DecodeItem, EncodeItem, decode_into, encode_into

GUARD = 7.0
GDN = ("model.layers.90.linear_attn", "model.layers.91.linear_attn")


def _worker(preset: str, role: str, engine_id: str, nb: int, heads: int, dim: int) -> Any:
    extra = {"preset": preset, "staging_bytes": 32 << 20, "recv_bytes": 32 << 20,
             "nixl_progress_delay_us": 0}
    return fakes.build_worker(extra, layer_names(2) + list(GDN), engine_id=engine_id,
                              kv_role=role, block_size=BLOCK, num_kv_heads=heads, head_size=dim,
                              num_blocks=nb, state=GDN)


def _caches(nb: int, heads: int, dim: int, seed: int, guard: bool) -> dict[str, torch.Tensor]:
    """Attention in vLLM's GPU layout; a state layer as vLLM hands it to a connector: an int8
    view of each block's state bytes inside a page padded to 2x."""
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    out = {n: (torch.full((2, nb, BLOCK, heads, dim), GUARD, device=DEVICE) if guard
               else torch.randn(2, nb, BLOCK, heads, dim, generator=g, device=DEVICE)
               ).to(torch.bfloat16) for n in layer_names(2)}
    for n in GDN:
        pages = torch.randint(-128, 127, (nb, 2 * fakes.STATE_BYTES), dtype=torch.int8,
                              generator=g, device=DEVICE)
        out[n] = pages[:, :fakes.STATE_BYTES].view(nb, 1, 1, fakes.STATE_BYTES)
    return out


def state_check(preset: str, log: Any) -> dict[str, Any]:
    """See the module; ``ok`` is every part."""
    out: dict[str, Any] = {"preset": preset, "check": "state_check"}
    heads, dim, nb = (1, 128, 32) if SMOKE else (8, 128, 128)
    ntok = 70 if SMOKE else 600
    n_blocks = -(-ntok // BLOCK)
    perm = torch.randperm(nb, generator=torch.Generator().manual_seed(7)).tolist()
    src = _caches(nb, heads, dim, 21, guard=False)
    p = _worker(preset, "kv_producer", "P-state", nb, heads, dim)
    p.register_kv_caches(src)
    out["coder"] = type(p.coder).__name__
    state_group = p.geometry.layers[-1].group
    meta = TurboWireConnectorMetadata(
        saves=[fakes.save_request("a", perm[:n_blocks], ntok, BLOCK)])
    save = meta.saves[0]
    raw = [perm[:n_blocks], perm[n_blocks:2 * n_blocks]]
    tables = [raw[1] if g == state_group else raw[0] for g in range(2)]
    save.group_tables = keep_state_blocks(tables, frozenset({state_group}), n_blocks)
    p.wait_for_save(meta)
    sync()
    bad = []
    for layer, spec in enumerate(p.geometry.layers):
        table = save.table(spec.group)
        for b in save.blocks:
            if table[b.index] < 0:
                continue
            at = p.layout.chunk_offset(b.slot, layer)
            ref = torch.zeros(p.layout.full_chunk_bytes[layer], dtype=torch.uint8, device=DEVICE)
            if spec.is_state:
                page = src[spec.name][table[b.index]].reshape(-1).view(torch.uint8)
                n = encode_state(layer, p.geometry.num_layers, [page], b.tag, ref)
            else:
                (n,) = encode_into(p.codec, layer, src[spec.name], p.caches.layouts[layer],
                                   [EncodeItem(table, b.index * BLOCK, b.num_tokens, 0, b.tag)],
                                   ref, impl="reference")
            if first_mismatch(p.staging[at:at + n], ref[:n]) is not None:
                bad.append((layer, b.index))
    out["encode_bitexact"] = not bad
    out["state_chunk_bytes"] = state_chunk_nbytes(fakes.STATE_BYTES)

    d = _worker(preset, "kv_consumer", "D-state", nb, heads, dim)
    dst = _caches(nb, heads, dim, 22, guard=True)
    kept = {n: dst[n].clone() for n in GDN}
    d.register_kv_caches(dst)
    attach_loader(d, p)
    rperm = torch.randperm(nb, generator=torch.Generator().manual_seed(8)).tolist()
    d_raw = [rperm[:n_blocks], rperm[n_blocks:2 * n_blocks]]
    d_tables = keep_state_blocks([d_raw[1] if g == state_group else d_raw[0] for g in range(2)],
                                 frozenset({state_group}), n_blocks)
    load = fakes.load_request("da", save, d_tables[0], preset)
    load.group_tables = d_tables
    groups = [layer.group for layer in d.geometry.layers]
    sizes = chunk_sizes(load.blocks, len(groups), d.chunk_nbytes)
    sizes *= held_chunks(load.blocks, d_tables, groups)
    flat = sizes.reshape(-1)
    offs = (np.cumsum(flat) - flat).reshape(sizes.shape)
    for layer in range(len(groups)):  # the READs' bytes, where the loader lands them
        for bi, b in enumerate(load.blocks):
            n = int(sizes[layer, bi])
            at = p.layout.chunk_offset(b.slot, layer)
            d.recv[int(offs[layer, bi]):int(offs[layer, bi]) + n] = p.staging[at:at + n]
    out["chunks_read"] = int((sizes > 0).sum())
    d.start_load_kv(TurboWireConnectorMetadata(loads=[load]))
    fin, failed = drain(d)
    sync()
    out["load_finished"] = fin == {"da"} and not failed
    last = d_tables[state_group][n_blocks - 1]
    src_last = tables[state_group][n_blocks - 1]
    others = [b for b in range(nb) if b != last]
    out["state_moved"] = all(torch.equal(dst[n][last], src[n][src_last]) for n in GDN)
    out["other_state_untouched"] = all(torch.equal(dst[n][others], kept[n][others]) for n in GDN)
    bad_decode = []
    for layer, name in enumerate(layer_names(2)):
        table = d_tables[groups[layer]]
        want = torch.full_like(dst[name], GUARD)
        partial = [table[b.index] for b in load.blocks if b.num_tokens < BLOCK]
        d.caches.layouts[layer].zero_blocks(want, partial)
        items = [DecodeItem(table, b.index * BLOCK, b.num_tokens, int(offs[layer, bi]),
                            int(sizes[layer, bi]), b.tag) for bi, b in enumerate(load.blocks)]
        decode_into(d.codec, layer, want, d.caches.layouts[layer], items, d.recv,
                    impl="reference")
        if first_mismatch(dst[name], want) is not None:
            bad_decode.append(name)
    out["decode_bitexact"] = not bad_decode
    out["ok"] = bool(out["encode_bitexact"] and out["load_finished"] and out["state_moved"]
                     and out["other_state_untouched"] and out["decode_bitexact"])
    log(f"[state check] {preset}: ok={out['ok']} coder {out['coder']}, read "
        f"{out['chunks_read']} chunks {bad or ''}{bad_decode or ''}")
    return out
