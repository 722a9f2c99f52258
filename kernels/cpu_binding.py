"""The C codec for CPU paged caches (kernels/cpu/): gather+encode and verify+decode+scatter.

Same bytes as the reference codec (tests/unit/test_kernels_cpu.py holds them together) at about
two orders of magnitude the speed on one core: the reference pays torch op overhead per stage,
this does each vector in L1. The library is an extension module built by ``pip install -e .``
(setup.py) and called through ctypes; the GIL is released during the call. If it is missing or
stale the dispatch falls back to the reference with one warning.

Environment: ``TURBOWIRE_CPU_KERNEL=off`` forces the reference path;
``TURBOWIRE_CPU_ISA=base|v2|v3`` pins the instruction-set variant (default: the best the CPU
supports); ``TURBOWIRE_CPU_LIB=path`` loads another build of the library (a sanitizer build).
"""

from __future__ import annotations

import ctypes
import functools
import importlib.util
import logging
import os
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from turbowire.codec import (
    ChecksumError,
    Codec,
    FormatError,
    GeometryError,
    IncompatiblePayloadError,
    TruncatedPayloadError,
    UnsupportedVersionError,
)
from turbowire.codec.codebooks import GAUSSIAN_LLOYD_MAX, boundaries, centroids
from turbowire.codec.presets import LayerPolicy
from turbowire.codec.rotation import sign_tables
from turbowire.codec.streams import StreamSpec, stream_layout
from turbowire.codec.wire import DTYPE_CODES, parse_header, verify_body
from turbowire.errors import TurboWireError
from turbowire.kernels.cpu_attn_layout import CpuAttnKVLayout
from turbowire.kernels.items import (
    DecodeItem,
    EncodeItem,
    HeadWindow,
    check_chunk_heads,
    check_range,
)
from turbowire.kernels.paged import BlockIndexError, PagedKVLayout

logger = logging.getLogger(__name__)

C_HEAD_DIMS = (64, 128, 256)  # the head sizes the C codec codes (others: the reference codec)

ABI_VERSION = 3  # must equal TW_ABI_VERSION in kernels/cpu/twcpu.h
MODULE = "turbowire.kernels._twcpu"
ISA_NAMES = {0: "base", 2: "x86-64-v2", 3: "x86-64-v3"}
_ISA_CODES = {"base": 0, "v2": 2, "x86-64-v2": 2, "v3": 3, "x86-64-v3": 3}
_KINDS = {"raw": 0, "fp8": 1, "lloyd": 2}

(
    E_OK,
    E_ARG,
    E_BLOCK,
    E_RANGE,
    E_TRUNC,
    E_MAGIC,
    E_VERSION,
    E_HCHECK,
    E_FORMAT,
    E_INCOMPAT,
    E_BCHECK,
    E_NOMEM,
    E_HEADS,
) = range(13)


class _Spec(ctypes.Structure):
    _fields_ = [
        ("kind", ctypes.c_int32),
        ("bits", ctypes.c_int32),
        ("center", ctypes.c_int32),
        ("sink_tokens", ctypes.c_int32),
        ("hi_eighths", ctypes.c_int32),
        ("_pad", ctypes.c_int32),
    ]


_FloatP = ctypes.POINTER(ctypes.c_float)


class _Codec(ctypes.Structure):
    _fields_ = [
        ("preset_id", ctypes.c_int32),
        ("layer", ctypes.c_int32),
        ("num_layers", ctypes.c_int32),
        ("head_dim", ctypes.c_int32),
        ("k", _Spec),
        ("v", _Spec),
        ("s1", _FloatP),
        ("s2", _FloatP),
        ("levels", _FloatP * 8),
        ("bounds", _FloatP * 8),
    ]


class _Cache(ctypes.Structure):
    _fields_ = [
        ("k", ctypes.c_void_p),
        ("v", ctypes.c_void_p),
        ("k_stride", ctypes.c_int64 * 4),
        ("v_stride", ctypes.c_int64 * 4),
        ("num_blocks", ctypes.c_int64),
        ("block_size", ctypes.c_int64),
        ("num_heads", ctypes.c_int64),
        ("dtype", ctypes.c_int32),
        ("_pad", ctypes.c_int32),
        ("k_slot_off", ctypes.c_void_p),
        ("k_dim_off", ctypes.c_void_p),
        ("v_slot_off", ctypes.c_void_p),
        ("v_dim_off", ctypes.c_void_p),
    ]


class _Item(ctypes.Structure):
    _fields_ = [
        ("block_ids", ctypes.c_void_p),
        ("n_block_ids", ctypes.c_int64),
        ("token_start", ctypes.c_int64),
        ("num_tokens", ctypes.c_int64),
        ("offset", ctypes.c_int64),
        ("nbytes", ctypes.c_int64),
        ("tag", ctypes.c_uint64),
        ("check_tag", ctypes.c_int32),
        ("_pad", ctypes.c_int32),
    ]


class _Error(ctypes.Structure):
    _fields_ = [("code", ctypes.c_int32), ("item", ctypes.c_int32), ("detail", ctypes.c_int64)]


class CpuKernelError(TurboWireError, RuntimeError):
    """The C library refused a call for a reason the reference checks did not reproduce."""


@functools.lru_cache(maxsize=1)
def _library() -> ctypes.CDLL | None:
    """Load the extension once; None (and one warning) if it is absent, stale, or disabled."""
    if os.environ.get("TURBOWIRE_CPU_KERNEL", "auto").lower() in ("off", "0", "reference"):
        logger.info("TURBOWIRE_CPU_KERNEL=off: CPU caches use the reference codec")
        return None
    override = os.environ.get("TURBOWIRE_CPU_LIB")
    spec = (
        importlib.util.spec_from_file_location(MODULE, override)
        if override
        else importlib.util.find_spec(MODULE)
    )
    if spec is None or spec.origin is None:
        logger.warning(
            "turbowire C codec (%s) is not built: CPU KV transfers use the slow reference codec. "
            "Build it with `pip install --no-build-isolation -e .` (needs gcc and Python headers)",
            MODULE,
        )
        return None
    try:
        lib = ctypes.CDLL(spec.origin)
        abi = int(lib.tw_abi_version())
    except (OSError, AttributeError) as exc:
        logger.warning(
            "turbowire C codec at %s cannot be loaded (%s): using the reference codec",
            spec.origin,
            exc,
        )
        return None
    if abi != ABI_VERSION:
        logger.warning(
            "turbowire C codec at %s has ABI %d, this code expects %d (stale build): "
            "using the reference codec; rebuild with `pip install --no-build-isolation -e .`",
            spec.origin,
            abi,
            ABI_VERSION,
        )
        return None
    p = ctypes.POINTER
    lib.tw_encode.argtypes = [
        p(_Codec),
        p(_Cache),
        p(_Item),
        ctypes.c_int64,
        ctypes.c_void_p,
        ctypes.c_int64,
        p(_Error),
    ]
    lib.tw_decode.argtypes = lib.tw_encode.argtypes
    lib.tw_encode.restype = lib.tw_decode.restype = ctypes.c_int
    lib.tw_chunk_nbytes.argtypes = [p(_Codec), ctypes.c_int64, ctypes.c_int64, ctypes.c_int64]
    lib.tw_chunk_nbytes.restype = ctypes.c_int64
    lib.tw_convert_f32.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_void_p]
    lib.tw_convert_f32.restype = None
    lib.tw_wsum32.argtypes = [ctypes.c_void_p, ctypes.c_int64]
    lib.tw_wsum32.restype = ctypes.c_uint32
    lib.tw_set_isa.argtypes = [ctypes.c_int]
    wanted = os.environ.get("TURBOWIRE_CPU_ISA")
    if wanted:
        if wanted not in _ISA_CODES:
            logger.warning(
                "TURBOWIRE_CPU_ISA=%s is not one of %s; ignored", wanted, sorted(_ISA_CODES)
            )
        elif lib.tw_set_isa(_ISA_CODES[wanted]) != _ISA_CODES[wanted]:
            logger.warning(
                "TURBOWIRE_CPU_ISA=%s is not supported by this CPU; using %s",
                wanted,
                ISA_NAMES[lib.tw_isa()],
            )
    logger.debug("turbowire C codec loaded from %s (%s)", spec.origin, ISA_NAMES[lib.tw_isa()])
    return lib


def available() -> bool:
    """True when the C library is built, current and enabled."""
    return _library() is not None


def isa() -> str:
    """The instruction-set variant in use ("x86-64-v3", "x86-64-v2" or "base")."""
    lib = _library()
    return ISA_NAMES[lib.tw_isa()] if lib is not None else "unavailable"


def set_isa(name: str) -> str:
    """Pin the variant (tests compare them all); returns the one in use afterwards."""
    lib = _require()
    if name not in _ISA_CODES:
        raise ValueError(f"ISA must be one of {sorted(_ISA_CODES)}, got {name!r}")
    return ISA_NAMES[lib.tw_set_isa(_ISA_CODES[name])]


def supported_isas() -> list[str]:
    """Variants this CPU can run."""
    lib = _require()
    current = lib.tw_isa()
    names = [ISA_NAMES[code] for code in (0, 2, 3) if lib.tw_set_isa(code) == code]
    lib.tw_set_isa(current)
    return names


def _require() -> ctypes.CDLL:
    lib = _library()
    if lib is None:
        raise CpuKernelError(
            "the turbowire C codec is not available (see the warning logged at load)"
        )
    return lib


def _why_not(
    codec: Codec, kv_cache: torch.Tensor, layout: PagedKVLayout, buf: torch.Tensor
) -> str | None:
    if kv_cache.device.type != "cpu" or kv_cache.dtype not in DTYPE_CODES:
        return f"the cache is {kv_cache.dtype} on {kv_cache.device}, not a bf16/fp16 CPU tensor"
    if (
        buf.device.type != "cpu"
        or buf.dtype != torch.uint8
        or buf.dim() != 1
        or not buf.is_contiguous()
    ):
        return "the staging/source buffer is not a flat contiguous uint8 CPU tensor"
    if layout.head_dim != codec.head_dim:
        return f"cache head_dim {layout.head_dim} does not match the codec's {codec.head_dim}"
    if codec.head_dim not in C_HEAD_DIMS:  # Phi-3's 96, a tiny model's 32
        return (f"the C codec codes head_dim {', '.join(map(str, C_HEAD_DIMS))}, "
                f"not {codec.head_dim}")
    if isinstance(layout, CpuAttnKVLayout) and layout.path != "strided":
        if layout.path == "generic":
            return f"vLLM CPU attention (isa {layout.isa}) places KV {layout.describe()}"
        if not available():
            return "the C library is not built or disabled (see the warning logged at load)"
        return None
    k, v = layout.views(kv_cache)
    if k.shape != v.shape or k.dim() != 4:
        return "the K/V views are not [blocks, slots, heads, head_dim] of one shape"
    if min(k.stride()) < 1 or min(v.stride()) < 1:
        return "the K/V views have a zero or negative stride"
    if not available():
        return "the C library is not built or disabled (see the warning logged at load)"
    return None


def applies(codec: Codec, kv_cache: torch.Tensor, layout: PagedKVLayout, buf: torch.Tensor) -> bool:
    """Whether the C path serves this call: a CPU bf16/fp16 cache (any positive strides), a
    flat contiguous CPU uint8 buffer, and a built library (anything else: the reference)."""
    return _why_not(codec, kv_cache, layout, buf) is None


def served_by(layout: CpuAttnKVLayout) -> str:
    """Which implementation a vLLM CPU attention layout gets, in words (for the engine log)."""
    if layout.path == "generic":
        return "the reference codec through the probed table (generic gather/scatter, slower)"
    if layout.head_dim not in C_HEAD_DIMS:
        return (f"the reference codec (the C codec codes head_dim "
                f"{', '.join(map(str, C_HEAD_DIMS))}; torch gather/scatter, slower)")
    if not available():
        return "the reference codec (the C codec is not built or disabled)"
    how = "strides" if layout.path == "strided" else "slot/dim offset tables"
    return f"the C codec ({isa()}) in place through {how}"


def require_applicable(
    codec: Codec, kv_cache: torch.Tensor, layout: PagedKVLayout, buf: torch.Tensor
) -> None:
    """Raise CpuKernelError saying why the C path cannot serve this call (impl="cpu")."""
    reason = _why_not(codec, kv_cache, layout, buf)
    if reason is not None:
        raise CpuKernelError(f"the C codec cannot serve this call: {reason}")


# ---- structs -----------------------------------------------------------------------------
def _spec(s: StreamSpec) -> _Spec:
    return _Spec(_KINDS[s.kind], s.bits, int(s.center), s.sink_tokens, s.hi_eighths, 0)


def _f32_array(t: torch.Tensor) -> np.ndarray:
    return np.ascontiguousarray(t.detach().cpu().numpy().astype(np.float32, copy=False))


@functools.lru_cache(maxsize=256)
def _codec_struct(
    policy: LayerPolicy, preset_id: int, head_dim: int, num_layers: int, layer: int
) -> tuple[_Codec, list[np.ndarray]]:
    """The C view of one layer's policy (tables kept alive next to the struct)."""
    keep: list[np.ndarray] = []

    def ptr(a: np.ndarray) -> Any:
        keep.append(a)
        return a.ctypes.data_as(_FloatP)

    s1, s2 = sign_tables(head_dim)
    c = _Codec(
        preset_id=preset_id,
        layer=layer,
        num_layers=num_layers,
        head_dim=head_dim,
        k=_spec(policy.k),
        v=_spec(policy.v),
        s1=ptr(_f32_array(s1)),
        s2=ptr(_f32_array(s2)),
    )
    widths: set[int] = set()
    for s in (policy.k, policy.v):
        if s.kind == "lloyd":
            widths.add(s.bits)
            if s.hi_eighths:
                widths.add(s.bits + 1)
    for w in sorted(widths):
        if w not in GAUSSIAN_LLOYD_MAX:
            raise GeometryError(f"no Lloyd-Max table for {w} bits")
        c.levels[w] = ptr(_f32_array(centroids(w)))
        c.bounds[w] = ptr(_f32_array(boundaries(w)))
    return c, keep


def _codec_for(codec: Codec, layer: int) -> _Codec:
    if not 0 <= layer < codec.num_layers:
        raise GeometryError(f"layer {layer} out of range 0..{codec.num_layers - 1}")
    struct, _ = _codec_struct(
        codec.policy(layer), codec.preset.preset_id, codec.head_dim, codec.num_layers, layer
    )
    return struct


def _cache_struct(kv_cache: torch.Tensor, layout: PagedKVLayout) -> tuple[_Cache, list]:
    """The C view of the cache, and the offset tables it points into (keep them alive)."""
    if isinstance(layout, CpuAttnKVLayout) and layout.path == "tiled":
        return _tiled_cache_struct(kv_cache, layout)
    k, v = layout.views(kv_cache)
    c = _Cache(
        k=k.data_ptr(),
        v=v.data_ptr(),
        num_blocks=layout.num_blocks,
        block_size=layout.block_size,
        num_heads=layout.num_heads,
        dtype=DTYPE_CODES[kv_cache.dtype],
    )
    # views are [blocks, slots, heads, dim]; the C side takes all four strides (a dim stride
    # other than 1 is vLLM CPU attention's per-block transposed keys, gathered row by row)
    for i in range(4):
        c.k_stride[i] = k.stride(i)
        c.v_stride[i] = v.stride(i)
    return c, []


def _tiled_cache_struct(kv_cache: torch.Tensor, layout: CpuAttnKVLayout) -> tuple[_Cache, list]:
    """A CPU attention cache whose slot/dim placement is a table (vLLM's AMX layout)."""
    (kb, kst, kslot, kdim), (vb, vst, vslot, vdim) = layout.c_tables()
    s0 = layout.block_stride(kv_cache)
    elem = kv_cache.element_size()
    c = _Cache(
        k=kv_cache.data_ptr() + kb * elem,
        v=kv_cache.data_ptr() + vb * elem,
        num_blocks=layout.num_blocks,
        block_size=layout.block_size,
        num_heads=layout.num_heads,
        dtype=DTYPE_CODES[kv_cache.dtype],
    )
    keep = [t for t in (kslot, kdim, vslot, vdim) if t is not None]
    for i in range(4):
        c.k_stride[i] = s0 if i == 0 else kst[i]
        c.v_stride[i] = s0 if i == 0 else vst[i]
    c.k_slot_off = kslot.ctypes.data if kslot is not None else None
    c.k_dim_off = kdim.ctypes.data if kdim is not None else None
    c.v_slot_off = vslot.ctypes.data if vslot is not None else None
    c.v_dim_off = vdim.ctypes.data if vdim is not None else None
    return c, keep


def _head_run(cache: _Cache, start: int, count: int, elem: int) -> _Cache:
    """The cache's heads [start, start + count) as a cache of their own: its planes start
    ``start`` heads in, the strides (and a tiled layout's slot/dim tables) unchanged."""
    run = _Cache.from_buffer_copy(cache)
    run.k = cache.k + start * cache.k_stride[2] * elem
    run.v = cache.v + start * cache.v_stride[2] * elem
    run.num_heads = count
    return run


def whole_window(items: Sequence[DecodeItem]) -> HeadWindow | None:
    """The one head window every item of a decode call shares when the C decoder can write it:
    a whole chunk at an offset of the cache's heads (a run staged for this rank, or a narrower
    prefill rank's chunk); None otherwise (no window, windows that differ, or a part of the
    chunk's heads: the reference slices those)."""
    windows = {item.heads for item in items}
    if len(windows) != 1:
        return None
    (w,) = windows
    if w is None or w.src_start != 0 or w.count != w.src_heads:
        return None
    return w


def _ids(block_ids: Sequence[int] | torch.Tensor) -> np.ndarray:
    if isinstance(block_ids, torch.Tensor):
        return np.ascontiguousarray(block_ids.detach().reshape(-1).cpu().numpy().astype(np.int64))
    return np.ascontiguousarray(np.asarray(block_ids, dtype=np.int64).reshape(-1))


def _items(
    entries: Sequence[Any], offsets: list[int], sizes: list[int], tags: list[int | None]
) -> tuple[Any, list[np.ndarray]]:
    arr = (_Item * max(1, len(entries)))()
    keep = []
    converted: dict[int, tuple[Any, np.ndarray]] = {}  # the chunks of a request share its list
    for i, e in enumerate(entries):
        hit = converted.get(id(e.block_ids))
        if hit is None or hit[0] is not e.block_ids:
            hit = converted[id(e.block_ids)] = (e.block_ids, _ids(e.block_ids))
        ids = hit[1]
        keep.append(ids)
        it = arr[i]
        it.block_ids = ids.ctypes.data if ids.size else None
        it.n_block_ids = ids.size
        it.token_start = int(e.token_start)
        it.num_tokens = int(e.num_tokens)
        it.offset = offsets[i]
        it.nbytes = sizes[i]
        tag = tags[i]
        it.check_tag = tag is not None
        it.tag = tag or 0
    return arr, keep


def _fits_int64(*values: int) -> bool:
    return all(-(1 << 63) <= int(x) < (1 << 63) for x in values)


# ---- entry points --------------------------------------------------------------------------
def encode_into(
    codec: Codec,
    layer: int,
    kv_cache: torch.Tensor,
    layout: PagedKVLayout,
    items: Sequence[EncodeItem],
    staging: torch.Tensor,
) -> list[int]:
    """Gather and encode every item into ``staging`` (all validated before the first write).
    Items of a run of heads (``head_count``) are coded as a cache of those heads alone, one C
    call per distinct run."""
    if any(item.head_count for item in items):
        return _encode_runs(codec, layer, kv_cache, layout, items, staging)
    return _encode(codec, layer, kv_cache, layout, items, staging)


def _encode_runs(codec: Codec, layer: int, kv_cache: torch.Tensor, layout: PagedKVLayout,
                 items: Sequence[EncodeItem], staging: torch.Tensor) -> list[int]:
    runs: dict[tuple[int, int], list[int]] = {}
    for i, item in enumerate(items):
        count = item.head_count or layout.num_heads
        if item.head_start + count > layout.num_heads:
            raise GeometryError(f"heads {item.head_start}+{item.head_count} outside the "
                                f"cache's {layout.num_heads}")
        runs.setdefault((item.head_start, count), []).append(i)
    written = [0] * len(items)
    for (start, count), pick in runs.items():
        sizes = _encode(codec, layer, kv_cache, layout, [items[i] for i in pick], staging,
                        heads=(start, count))
        for i, n in zip(pick, sizes, strict=True):
            written[i] = n
    return written


def _encode(codec: Codec, layer: int, kv_cache: torch.Tensor, layout: PagedKVLayout,
            items: Sequence[EncodeItem], staging: torch.Tensor,
            heads: tuple[int, int] | None = None) -> list[int]:
    """One C call; ``heads``: (start, count) of the cache's heads the items code."""
    lib = _require()
    if not items:
        return []
    cstruct = _codec_for(codec, layer)
    for it in items:
        if not 0 <= int(it.tag) < 1 << 64:
            raise GeometryError("tag must fit in 64 unsigned bits")
        if not _fits_int64(it.token_start, it.num_tokens, it.out_offset):
            raise BlockIndexError(f"token range or offset out of range: {it}")
    arr, keep = _items(
        items, [int(i.out_offset) for i in items], [0] * len(items), [int(i.tag) for i in items]
    )
    cache, tables = _cache_struct(kv_cache, layout)
    if heads is not None:
        cache = _head_run(cache, heads[0], heads[1], kv_cache.element_size())
    err = _Error()
    rc = lib.tw_encode(
        ctypes.byref(cstruct),
        ctypes.byref(cache),
        arr,
        len(items),
        staging.data_ptr(),
        staging.numel(),
        ctypes.byref(err),
    )
    del keep, tables
    if rc:
        _raise_encode(codec, layout, items, staging, err)
    return [int(arr[i].nbytes) for i in range(len(items))]


def decode_into(
    codec: Codec,
    layer: int,
    kv_cache: torch.Tensor,
    layout: PagedKVLayout,
    items: Sequence[DecodeItem],
    source: torch.Tensor,
) -> None:
    """Verify every item (header, checksums, compatibility, destination), then decode and
    scatter them all; nothing is written if any item fails. Items with a head window must
    share one ``whole_window`` (the chunk's heads written at that offset of the cache's)."""
    lib = _require()
    if not items:
        return
    window = None
    if any(item.heads is not None for item in items):
        window = whole_window(items)
        if window is None:
            raise ValueError("the C decoder writes whole chunks: one shared window of a "
                             "chunk's every head (else the reference)")
        if window.dst_start + window.count > layout.num_heads:
            raise GeometryError(f"head window {window} outside the cache's "
                                f"{layout.num_heads} heads")
    cstruct = _codec_for(codec, layer)
    for it in items:
        if not _fits_int64(it.token_start, it.num_tokens, it.in_offset, it.nbytes):
            raise BlockIndexError(f"token range or byte range out of range: {it}")
    tags = [
        None if i.expected_tag is None else int(i.expected_tag) & 0xFFFFFFFFFFFFFFFF for i in items
    ]
    arr, keep = _items(
        items, [int(i.in_offset) for i in items], [int(i.nbytes) for i in items], tags
    )
    cache, tables = _cache_struct(kv_cache, layout)
    if window is not None:
        cache = _head_run(cache, window.dst_start, window.count, kv_cache.element_size())
    err = _Error()
    rc = lib.tw_decode(
        ctypes.byref(cstruct),
        ctypes.byref(cache),
        arr,
        len(items),
        source.data_ptr(),
        source.numel(),
        ctypes.byref(err),
    )
    del keep, tables
    if rc:
        _raise_decode(codec, layer, layout, items, source, err)


# ---- errors: reproduce the reference's exception (type and message) for the failing item -----
def _raise_common(code: int, detail: int) -> None:
    if code == E_NOMEM:
        raise MemoryError("turbowire C codec: out of memory for the chunk's work buffers")
    if code == E_ARG:
        raise GeometryError(
            f"the C codec refused the geometry (chunk of up to 65536 tokens, "
            f"token offsets below 2**32, bf16/fp16 cache; detail {detail})"
        )


def _raise_encode(
    codec: Codec,
    layout: PagedKVLayout,
    items: Sequence[EncodeItem],
    staging: torch.Tensor,
    err: _Error,
) -> None:
    _raise_common(err.code, err.detail)
    item = items[err.item] if 0 <= err.item < len(items) else None
    if item is not None and err.code == E_BLOCK:
        layout.token_index(item.block_ids, item.token_start, item.num_tokens)
        raise BlockIndexError(f"bad block ids or token range in item {err.item}")
    if item is not None and err.code == E_RANGE:
        check_range(staging, int(item.out_offset), int(err.detail), "staging")
    raise CpuKernelError(f"C encoder refused item {err.item} (code {err.code})")


def _raise_decode(
    codec: Codec,
    layer: int,
    layout: PagedKVLayout,
    items: Sequence[DecodeItem],
    source: torch.Tensor,
    err: _Error,
) -> None:
    _raise_common(err.code, err.detail)
    item = items[err.item] if 0 <= err.item < len(items) else None
    if item is None:
        raise CpuKernelError(f"C decoder refused the call (code {err.code})")
    where = f"item {err.item} (tokens {item.token_start}..{item.token_start + item.num_tokens})"
    if err.code == E_RANGE:
        check_range(source, int(item.in_offset), int(item.nbytes), "source")
    elif err.code == E_BLOCK:
        layout.token_index(item.block_ids, item.token_start, item.num_tokens)
        raise BlockIndexError(f"bad block ids or token range in {where}")
    elif err.code == E_HEADS:
        if item.heads is not None:  # the reference's words for a window's chunk
            check_chunk_heads(layer, int(err.detail), item.heads)
        raise IncompatiblePayloadError(
            f"chunk of {where} has {err.detail} KV heads, the cache has {layout.num_heads}"
        )
    else:
        # the reference's own checks give the exception type and message
        data = source[int(item.in_offset) : int(item.in_offset) + int(item.nbytes)]
        header = parse_header(data)
        codec.check_compatible(header, layer, item.expected_tag, item.num_tokens, item.token_start)
        verify_body(header, data)
        pol = codec.policy(layer)
        sizes = [
            stream_layout(
                s, header.num_tokens, header.num_heads, codec.head_dim, header.sequence_start
            ).nbytes
            for s in (pol.k, pol.v)
        ]
        if sum(sizes) != header.body_nbytes:
            raise IncompatiblePayloadError(
                f"body is {header.body_nbytes} bytes; preset {codec.preset.name} at this geometry "
                f"needs {sum(sizes)}"
            )
    exc: type[Exception] = {
        E_TRUNC: TruncatedPayloadError,
        E_MAGIC: FormatError,
        E_VERSION: UnsupportedVersionError,
        E_HCHECK: ChecksumError,
        E_FORMAT: FormatError,
        E_INCOMPAT: IncompatiblePayloadError,
        E_BCHECK: ChecksumError,
    }.get(err.code, CpuKernelError)
    raise exc(f"C decoder refused {where} (code {err.code})")


# ---- helpers for tests and benchmarks ---------------------------------------------------------
def chunk_nbytes(
    codec: Codec, layer: int, num_tokens: int, num_heads: int, token_offset: int
) -> int:
    """The chunk size as the C layout computes it (tests compare it with the reference)."""
    return int(
        _require().tw_chunk_nbytes(
            ctypes.byref(_codec_for(codec, layer)), num_tokens, num_heads, token_offset
        )
    )


def convert_f32(x: torch.Tensor, kind: str, scalar: bool = False) -> torch.Tensor:
    """The C conversions of fp32 values: kind "bf16", "fp16" (int16 bits) or "e4m3" (uint8), by
    the vector code of the current ISA or by the scalar code."""
    lib = _require()
    src = x.detach().to(torch.float32).contiguous().reshape(-1)
    code = {"bf16": 0, "fp16": 1, "e4m3": 2}[kind] + (3 if scalar else 0)
    out = torch.empty(src.numel(), dtype=torch.uint8 if kind == "e4m3" else torch.int16)
    lib.tw_convert_f32(src.data_ptr(), src.numel(), code, out.data_ptr())
    return out


def wsum32(data: torch.Tensor) -> int:
    """The C checksum of a flat uint8 tensor (tests compare it with codec.wire.wsum32)."""
    d = data.contiguous()
    return int(_require().tw_wsum32(d.data_ptr(), d.numel()))
