"""Regenerate the recorded vLLM CPU attention element maps in this folder (README.md says why).

    PYTHONPATH=tests .venv/bin/python tests/data/vllm_cpu_attn/record.py [--keep-refused] \
        [--derive-amx-from-source]

(``tests/`` on the path, for ``support.vllm_cpu_attn``, as pytest puts it there for the tests.)

Probes vLLM's live cache-write op (turbowire's own probe, ``probe_layout``) for every entry of
ENTRIES and rewrites the entries it captured live, keeping the others as recorded. An entry whose
ISA the op refuses on this CPU stops the run with nothing written, unless told otherwise:
``--keep-refused`` keeps such entries as they are; ``--derive-amx-from-source`` writes the
refused ``amx`` entries from vLLM's source (:func:`amx_offsets`), marked as not yet confirmed
live. Where the op accepts ``amx``, the live capture always wins (with the flag given, the
derivation is compared with it and the result printed), and a live capture already recorded is
never replaced by a derivation.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
from pathlib import Path

import numpy as np
import torch
from support.vllm_cpu_attn import (
    DTYPES,
    MANIFEST_FILE,
    MAPS_FILE,
    entry_name,
)

from turbowire.kernels.cpu_attn_layout import CpuCacheLayoutError, probe_layout

H = 3
BF16, FP16 = torch.bfloat16, torch.float16
# (isa, dtype, heads, block size, head_dim): every geometry the tests write with
ENTRIES: list[tuple[str, torch.dtype, int, int, int]] = [
    *[(isa, BF16, H, bs, d)
      for isa in ("vec", "vec16")
      for bs, d in ((16, 64), (32, 64), (32, 128), (128, 128), (128, 64))],
    ("vec", FP16, H, 128, 64),
    ("vec16", FP16, H, 128, 64),
    *[("amx", BF16, H, bs, d) for bs, d in ((32, 64), (32, 128), (128, 128), (128, 64))],
]

DERIVED = (
    "derived from vLLM 0.32.0 csrc/cpu/cpu_attn_amx.hpp reshape_and_cache; not yet confirmed live"
)
DERIVATION_NOTE = (
    "source read at vllm-project/vllm commits 0e1ce52 and deae5aa (the same placement in both); "
    "the store offsets agree with objdump's disassembly of vllm-cpu 0.32.0's _C.abi3.so "
    "(AttentionImpl<ISA::AMX, BFloat16, 64 and 128>::reshape_and_cache)"
)


def amx_offsets(heads: int, block_size: int, head_dim: int) -> tuple[np.ndarray, np.ndarray]:
    """vLLM's AMX placement for 2-byte scalars, read off ``AttentionImpl<ISA::AMX>::
    reshape_and_cache``. Per (block, head) the op gets a key cache (the first block_size*head_dim
    elements) and a value cache (the next ones); heads are 2*block_size*head_dim apart. Keys go in
    groups of 16 tokens, each token's dims as 4-byte pairs 16 pairs apart: key (s, d) at
    (s//16)*16*D + 2*(s%16) + 32*(d//2) + d%2. Values go in groups of 16 dims, block_size*16
    apart, each holding token pairs: value (s, d) at (s//2)*32 + s%2 + (d//16)*block_size*16
    + 2*(d%16)."""
    if block_size % 32 or head_dim % 32:
        raise ValueError("vLLM's amx write needs block_size and head_dim divisible by 32")
    s = np.arange(block_size)[:, None, None]
    h = np.arange(heads)[None, :, None]
    d = np.arange(head_dim)[None, None, :]
    head = h * 2 * block_size * head_dim
    k = head + (s // 16) * 16 * head_dim + 2 * (s % 16) + 32 * (d // 2) + d % 2
    v = (head + block_size * head_dim + (s // 2) * 32 + s % 2 + (d // 16) * block_size * 16
         + 2 * (d % 16))
    return k, v


def vec_offsets(heads: int, block_size: int, head_dim: int) -> tuple[np.ndarray, np.ndarray]:
    """vLLM's ``vec`` placement read off its source the same way (keys [D, block_size], values
    token-major): only to check the method against the live op where both run."""
    s = np.arange(block_size)[:, None, None]
    h = np.arange(heads)[None, :, None]
    d = np.arange(head_dim)[None, None, :]
    head = h * 2 * block_size * head_dim
    return head + s + d * block_size, head + block_size * head_dim + s * head_dim + d


def cpu_description() -> str:
    model, flags = "an unknown CPU", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, val = line.partition(":")
            if key.strip() == "model name" and model == "an unknown CPU":
                model = val.strip()
            elif key.strip() == "flags" and not flags:
                flags = set(val.split())
    except OSError:
        model = platform.processor() or model
    wanted = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")
    have = [f for f in wanted if f in flags]
    lacks = [f for f in wanted if f not in flags]
    return f"{model} (flags: {' '.join(have) or 'none of interest'}; lacks: {' '.join(lacks)})"


def vllm_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("vllm-cpu", "vllm"):
        try:
            return f"{dist} {version(dist)}"
        except PackageNotFoundError:
            continue
    return "unknown"


def load_existing() -> tuple[dict[str, dict], dict[str, np.ndarray]]:
    if not MANIFEST_FILE.exists() or not MAPS_FILE.exists():
        return {}, {}
    entries = json.loads(MANIFEST_FILE.read_text())["entries"]
    with np.load(MAPS_FILE, allow_pickle=False) as arrays:
        return entries, {k: arrays[k] for k in arrays.files}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--keep-refused", action="store_true",
                    help="keep the recorded entries of ISAs vLLM's op refuses here")
    ap.add_argument("--derive-amx-from-source", action="store_true",
                    help="write refused amx entries from vLLM's source (not confirmed live)")
    args = ap.parse_args()

    manifest, arrays = load_existing()
    today = datetime.datetime.now(datetime.timezone.utc).date().isoformat()
    common = {"vllm": vllm_version(), "torch": torch.__version__, "date": today}
    cpu = cpu_description()
    live, derived, kept, refused = [], [], [], {}
    for isa, dtype, heads, bs, d in ENTRIES:
        name = entry_name(isa, dtype, heads, bs, d)
        meta = {"isa": isa, "dtype": str(dtype).removeprefix("torch."), "heads": heads,
                "block_size": bs, "head_dim": d}
        assert DTYPES[meta["dtype"]] == dtype
        try:
            k_map, v_map = probe_layout(dtype, heads, bs, d, isa).maps
        except CpuCacheLayoutError as exc:
            recorded_live = manifest.get(name, {}).get("source") == "live"
            if isa == "amx" and args.derive_amx_from_source and not recorded_live:
                k, v = amx_offsets(heads, bs, d)
                manifest[name] = {**meta, **common, "source": "derived", "captured": DERIVED,
                                  "derivation": DERIVATION_NOTE}
                arrays[f"{name}.k"], arrays[f"{name}.v"] = k.astype(np.int32), v.astype(np.int32)
                derived.append(name)
            elif name in manifest and (args.keep_refused or (
                    recorded_live and args.derive_amx_from_source)):
                kept.append(name)
            else:
                refused[name] = str(exc)
            continue
        k, v = k_map.offsets.numpy(), v_map.offsets.numpy()
        checks = {"amx": amx_offsets, "vec": vec_offsets}
        if args.derive_amx_from_source and isa in checks:
            want_k, want_v = checks[isa](heads, bs, d)
            same = np.array_equal(want_k, k) and np.array_equal(want_v, v)
            print(f"{name}: the reading of vLLM's source {'matches' if same else 'DIFFERS FROM'} "
                  "the live op")
        manifest[name] = {**meta, **common, "source": "live",
                          "captured": f"live: vLLM's cpu_attn_reshape_and_cache on {cpu}",
                          "cpu": cpu}
        arrays[f"{name}.k"], arrays[f"{name}.v"] = k.astype(np.int32), v.astype(np.int32)
        live.append(name)

    if refused:
        print(f"vLLM's cache write refuses these entries on this CPU, {cpu}; nothing was "
              "written:", file=sys.stderr)
        for name, why in refused.items():
            print(f"  {name}: {why}", file=sys.stderr)
        print("pass --keep-refused to keep their recorded maps, or (amx) "
              "--derive-amx-from-source to write them from vLLM's source", file=sys.stderr)
        return 2
    known = {entry_name(*e) for e in ENTRIES}
    manifest = {k: manifest[k] for k in sorted(manifest) if k in known}
    arrays = {k: arrays[k] for k in sorted(arrays) if k.rsplit(".", 1)[0] in known}
    MAPS_FILE.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(MAPS_FILE, **arrays)
    about = (
        "Where vLLM CPU attention's cache write (cpu_attn_reshape_and_cache) puts each "
        "(slot, head, dim) of K and V inside one block: element_maps.npz holds '<name>.k' and "
        "'<name>.v', int32 [block_size, heads, head_dim], in elements from the block start "
        "(turbowire's ElementMap.offsets). 'source' is 'live' (read from vLLM's op) or 'derived' "
        "(from vLLM's source). Regenerate with record.py (README.md)."
    )
    MANIFEST_FILE.write_text(json.dumps({"about": about, "entries": manifest}, indent=1) + "\n")
    print(f"captured live on {cpu}: {', '.join(live) or 'none'}")
    print(f"derived from vLLM's source (not confirmed live): {', '.join(derived) or 'none'}")
    print(f"kept as recorded (refused here): {', '.join(kept) or 'none'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
