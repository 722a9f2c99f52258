"""The GPU path with several KV cache groups (vLLM's hybrid KV cache manager, ``SupportsHMA``):
sliding-window layers in a group of their own whose table holds ``NO_BLOCK`` where the window
left a block. The prefill worker's CUDA coder must stage every held chunk exactly as the
reference codec encodes it from that layer's own table and touch nothing of a chunk its group
does not hold; the decode worker's loader and CUDA coder must READ only the chunks the decode
side's groups hold and decode them exactly as the reference does, writing nothing else."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from bench.gpu_path.check import first_mismatch
from bench.gpu_path.fakes import load_request
from bench.gpu_path.rig import (
    BLOCK,
    DEVICE,
    SMOKE,
    attach_loader,
    drain,
    layer_names,
    make_worker,
    save_meta,
    sync,
    use_coder,
)
from turbowire.connector.metadata import TurboWireConnectorMetadata
from turbowire.connector.read_plan import chunk_sizes, held_chunks
from turbowire.kernels import NO_BLOCK, DecodeItem, EncodeItem, decode_into, encode_into

GUARD = 7.0


def tables(perm: list[int], n_blocks: int, skipped: int) -> list[list[int]]:
    """[full group's table, sliding group's table]: the window left the first ``skipped``."""
    full = perm[:n_blocks]
    sliding = [NO_BLOCK] * skipped + perm[n_blocks:2 * n_blocks - skipped]
    return [full, sliding]


def groups_check(preset: str, log: Any) -> dict[str, Any]:
    """See the module; ``ok`` is every part."""
    out: dict[str, Any] = {"preset": preset, "check": "groups_check"}
    layers, heads, dim, nb = (4, 1, 128, 64) if SMOKE else (4, 8, 128, 128)
    ntok = 70 if SMOKE else 600
    n_blocks = -(-ntok // BLOCK)
    names = layer_names(layers)
    sliding = (names[0], names[2])  # interleaved, as Gemma's and gpt-oss's
    g = torch.Generator(device=DEVICE).manual_seed(12)
    src = {n: (torch.randn(2, nb, BLOCK, heads, dim, generator=g, device=DEVICE) * 1.5
               + torch.linspace(-2, 2, dim, device=DEVICE)).to(torch.bfloat16) for n in names}
    perm = torch.randperm(nb, generator=torch.Generator().manual_seed(5)).tolist()
    p = make_worker(preset, "kv_producer", "P-groups", nb, 32 << 20, layers, heads, dim,
                    sliding=sliding)
    assert p.geometry.num_groups == 2
    p.register_kv_caches(src)
    use_coder(p, "layerwise")
    meta = save_meta("a", perm[:n_blocks], ntok)
    save = meta.saves[0]
    save.group_tables = tables(perm, n_blocks, 2)
    before = p.staging.clone()
    for name in names[:-1]:  # the last layer is left to wait_for_save
        p.save_kv_layer(name, src[name], meta)
    p.wait_for_save(meta)
    sync()
    bad_encode, touched = [], []
    ref = torch.zeros_like(p.staging)
    for layer in range(layers):
        table = save.table(p.geometry.layers[layer].group)
        for b in save.blocks:
            at = p.layout.chunk_offset(b.slot, layer)
            room = p.layout.full_chunk_bytes[layer]
            if table[b.index] == NO_BLOCK:
                if first_mismatch(p.staging[at:at + room], before[at:at + room]) is not None:
                    touched.append((layer, b.index))
                continue
            (n,) = encode_into(p.codec, layer, src[names[layer]], p.caches.layouts[layer],
                               [EncodeItem(table, b.index * BLOCK, b.num_tokens, at, b.tag)],
                               ref, impl="reference")
            if first_mismatch(p.staging[at:at + n], ref[at:at + n]) is not None:
                bad_encode.append((layer, b.index))
    out["encode_bitexact"] = not bad_encode
    out["unheld_chunks_untouched"] = not touched
    out["encode_mismatch"] = (bad_encode + touched)[:4]

    d = make_worker(preset, "kv_consumer", "D-groups", nb, 32 << 20, layers, heads, dim,
                    groups=2, sliding=sliding)
    dst = {n: torch.full((2, nb, BLOCK, heads, dim), GUARD, device=DEVICE).to(torch.bfloat16)
           for n in names}
    d.register_kv_caches(dst)
    use_coder(d)
    attach_loader(d, p)
    rperm = torch.randperm(nb, generator=torch.Generator().manual_seed(6)).tolist()
    d_tables = tables(rperm, n_blocks, 5)  # the decode side's window left more blocks
    load = load_request("da", save, d_tables[0], preset)
    load.group_tables = d_tables
    groups = [layer.group for layer in d.geometry.layers]
    sizes = chunk_sizes(load.blocks, layers, d.chunk_nbytes)
    sizes *= held_chunks(load.blocks, d_tables, groups)
    flat = sizes.reshape(-1)
    offs = (np.cumsum(flat) - flat).reshape(sizes.shape)
    for layer in range(layers):  # the READs' bytes, where the loader lands them
        for bi, b in enumerate(load.blocks):
            n = int(sizes[layer, bi])
            at = p.layout.chunk_offset(b.slot, layer)
            d.recv[int(offs[layer, bi]):int(offs[layer, bi]) + n] = p.staging[at:at + n]
    out["chunks_read"] = int((sizes > 0).sum())
    out["chunks_skipped"] = int((sizes == 0).sum())
    d.start_load_kv(TurboWireConnectorMetadata(loads=[load]))
    fin, failed = drain(d)
    sync()
    out["load_finished"] = fin == {"da"} and not failed
    bad_decode = []
    for layer, name in enumerate(names):
        table = d_tables[groups[layer]]
        want = torch.full_like(dst[name], GUARD)
        items = [DecodeItem(table, b.index * BLOCK, b.num_tokens, int(offs[layer, bi]),
                            int(sizes[layer, bi]), b.tag)
                 for bi, b in enumerate(load.blocks) if table[b.index] != NO_BLOCK]
        decode_into(d.codec, layer, want, d.caches.layouts[layer], items, d.recv,
                    impl="reference")
        if first_mismatch(dst[name], want) is not None:
            bad_decode.append(name)
    out["decode_bitexact"] = not bad_decode
    out["decode_mismatch"] = bad_decode
    out["ok"] = bool(out["encode_bitexact"] and out["unheld_chunks_untouched"]
                     and out["load_finished"] and out["decode_bitexact"]
                     and out["chunks_skipped"] > 0)
    log(f"[groups check] {preset}: ok={out['ok']} read {out['chunks_read']} chunks, skipped "
        f"{out['chunks_skipped']} {out['encode_mismatch'] or ''}{bad_decode or ''}")
    return out
