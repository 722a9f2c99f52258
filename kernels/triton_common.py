"""Host-side pieces shared by the Triton codec's two front ends: ``triton_launch`` (items of
one call) and ``triton_plans`` (arrays of a connector step): launch configuration and the
block-chunk launch shape, stream constants and codebook tables, cache geometry, size and scale
helpers, and the reference re-check that turns a refused chunk into the reference's exception.
"""


from __future__ import annotations

import functools
import logging
import math
import os
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from turbowire.codec import Codec, GeometryError, StreamSpec
from turbowire.codec.codebooks import GAUSSIAN_LLOYD_MAX, boundaries, centroids
from turbowire.codec.errors import ChecksumError
from turbowire.codec.packing import plane_widths
from turbowire.codec.rotation import sign_tables
from turbowire.codec.streams import stream_layout
from turbowire.errors import TurboWireError
from turbowire.kernels.fp8_cache import KVScales, is_fp8_cache
from turbowire.kernels.items import DecodeItem, check_chunk_heads, check_range
from turbowire.kernels.paged import NO_BLOCK, BlockIndexError, CacheLayoutError, PagedKVLayout
from turbowire.kernels.quant_lut import lut_tables

logger = logging.getLogger(__name__)

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.uint8)
_KIND_CODES = {"raw": 0, "fp8": 1, "lloyd": 2}
_MAX_LEVELS = 14  # binary-counter levels of the chunk-mean token fold (16384 tiles)


class StagingAlignmentError(TurboWireError, ValueError):
    """A chunk offset in the staging/receive buffer is not 16-byte aligned (kernels store words)."""


@dataclass(frozen=True)
class KernelConfig:
    """Launch shape of the kernels. ``lanes`` / ``decode_lanes``: threads sharing one head vector
    (None: ``lanes_for``'s default); ``qmode``: how the encoder finds a Lloyd-Max code: 0 binary
    search with gathered thresholds, 1 a select tree over the thresholds, 2 one gather from the
    bucketed table of kernels/quant_lut.py (code and squared level together); ``tile_rows``
    overrides the rows per tile (tests use small tiles to reach the multi-tile paths with few
    tokens); ``max_registers`` caps the registers per thread of every kernel (ptxas
    ``.maxnreg``; None: the compiler's choice); ``encode_max_registers`` caps the encoder alone
    when ``max_registers`` is None: "tuned" (the caps measured for the stock presets, see
    ``TUNED_ENCODE_REGISTERS``), an int, or None; ``sum_rows``: rows per tile of the chunk-mean
    pass (None: ``sum_rows_for``'s default); ``decode_split``: decode programs per chunk, 1 (one
    program verifies a chunk and decodes both streams) or 2 (one per stream, each verifying the
    whole chunk); ``verify_words``: words per step of the decode's checksum loop (None:
    ``verify_words_for``'s default); ``encode_stream_major``: launch every K program of an encode
    before every V program (True: concurrent programs share their code; False: a chunk's K and
    V programs side by side; None, the default: ``stream_major_for`` picks per layer policy);
    ``decode_heads_from``: chunks of at least this many tokens decode in two launches, a verify
    pass then one program per (chunk, stream, head) (``decode_heads_kernel``), shorter ones in the
    fused verify + decode kernel (None: always fused); ``verify_warps``: warps of that verify
    pass. Both defaults were measured on an H200 (bench/RESULTS.md, kernels against 12-01)."""

    num_warps: int = 4
    lanes: int | None = None
    decode_lanes: int | None = None
    qmode: int = 1
    tile_rows: int | None = None
    verify_words: int | None = None
    max_registers: int | None = None
    sum_rows: int | None = None
    encode_max_registers: int | str | None = "tuned"
    decode_split: int = 1
    encode_stream_major: bool | None = None
    decode_heads_from: int | None = 128
    verify_warps: int = 8

    def __post_init__(self) -> None:
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"num_warps must be a power of two up to 16, got {self.num_warps}")
        for lanes in (self.lanes, self.decode_lanes):
            if lanes is not None and lanes not in (1, 2, 4, 8, 16, 32):
                raise ValueError(f"lanes must be a power of two up to 32, got {lanes}")
        if self.qmode not in (0, 1, 2):
            raise ValueError(
                "qmode is 0 (gathered thresholds), 1 (select tree) or 2 (bucketed table)")
        if self.tile_rows is not None and (
                self.tile_rows < 1 or self.tile_rows & (self.tile_rows - 1)):
            raise ValueError("tile_rows must be a power of two")
        vw = self.verify_words
        if vw is not None and (vw < 16 or vw & (vw - 1)):
            raise ValueError("verify_words must be a power of two >= 16")
        if self.decode_split not in (1, 2):
            raise ValueError(f"decode_split is 1 or 2, got {self.decode_split}")
        if self.verify_warps not in (1, 2, 4, 8, 16):
            raise ValueError(
                f"verify_warps must be a power of two up to 16, got {self.verify_warps}")
        if self.decode_heads_from is not None and self.decode_heads_from < 1:
            raise ValueError(f"decode_heads_from is None or >= 1, got {self.decode_heads_from}")
        if self.sum_rows is not None and (self.sum_rows < 8 or self.sum_rows & (self.sum_rows - 1)):
            raise ValueError("sum_rows must be a power of two >= 8")
        if self.max_registers is not None and not 24 <= self.max_registers <= 255:
            raise ValueError(f"max_registers must be in 24..255, got {self.max_registers}")
        cap = self.encode_max_registers
        if cap is not None and cap != "tuned" and not (isinstance(cap, int) and 24 <= cap <= 255):
            raise ValueError(f"encode_max_registers is 'tuned', None or 24..255, got {cap!r}")

    def lanes_for(self, head_dim: int, encode: bool = True, transform: bool = True) -> int:
        """Threads sharing one row (one token's head vector). Default: head_dim/8 (each thread
        one 16-byte piece, a warp reads whole rows: coalesced) for launches without a lloyd
        stream (raw, fp8); with one (``transform``: the rotation runs), 4 lanes at head_dim 64
        and 128 and head_dim/8 = 32 at 256, the fastest shapes measured on the H200
        (bench/RESULTS.md, launch shapes): the butterfly stages above a thread's coordinates
        exchange values between lanes, which costs more than uncoalesced loads save there."""
        lanes = self.decode_lanes if not encode and self.decode_lanes is not None else self.lanes
        if lanes is None:
            lanes = (min(4, head_dim // 8) if transform and head_dim <= 128
                     else min(32, head_dim // 8))
        if lanes > head_dim // 8:
            raise ValueError(f"at most head_dim/8 = {head_dim // 8} lanes per row, got {lanes}")
        return lanes

    def verify_words_for(self) -> int:
        """Words per step of the decode kernel's checksum loop: ``verify_words``, else 16 per
        thread (four 16-byte loads in flight per thread, ~48 registers in a phase where none
        of the decode's are live)."""
        return self.verify_words or 16 * 32 * self.num_warps

    def tile_rows_for(self, head_dim: int, encode: bool = True, transform: bool = True) -> int:
        lanes = self.lanes_for(head_dim, encode, transform)
        return self.tile_rows or max(32 * self.num_warps // lanes, 1)

    def sum_rows_for(self, head_dim: int, transform: bool = True) -> int:
        """Rows per tile of the chunk-mean pass: ``sum_rows`` or ``tile_rows`` if set, else at
        least 32 (fewer, longer steps: 8-row tiles made the hd128 encoder 40% slower), and at
        least the rows its layout covers (the lanes of one warp not spent on channels, see
        triton_codec.sum_tile_rows)."""
        from turbowire.kernels.triton_codec import sum_tile_rows

        th = sum_tile_rows(head_dim, self.num_warps)
        rows = (self.sum_rows or self.tile_rows
                or max(self.tile_rows_for(head_dim, True, transform), 32))
        return max(rows, th)

    def encode_registers_for(
        self, kspec: StreamSpec, vspec: StreamSpec, head_dim: int
    ) -> int | None:
        """The encoder's register cap for one launch (``max_registers`` wins when set)."""
        if self.max_registers is not None:
            return self.max_registers
        if self.encode_max_registers != "tuned":
            return self.encode_max_registers  # type: ignore[return-value]
        if self.num_warps != 4 or self.lanes is not None or self.tile_rows is not None:
            return None  # the caps were measured at the default launch shape only
        return TUNED_ENCODE_REGISTERS.get((kspec, vspec, head_dim))

    def stream_major_for(self, kspec: StreamSpec, vspec: StreamSpec) -> bool:
        """Whether an encode launches every K program before every V program. Unset: when both
        streams are of one kind (tq4 at 256-token chunks 0.771 -> 0.664 ms on an H200); a K
        stream much cheaper than its V (k8v4's fp8 keys) balances better side by side
        (k8v4 0.488 -> 0.435 ms), the same on one-block chunks."""
        if self.encode_stream_major is not None:
            return self.encode_stream_major
        return kspec.kind == vspec.kind

    def decodes_by_head(self, max_tokens: int) -> bool:
        """Whether a decode launch whose longest chunk has ``max_tokens`` tokens runs as a verify
        pass then one program per (chunk, stream, head): on an H200 that is 7-10% faster than
        the fused kernel from 128-token chunks up, and up to 2x slower on one-block chunks,
        where the fused kernel's single launch wins."""
        return self.decode_heads_from is not None and max_tokens >= self.decode_heads_from

    def launch_options(self, max_registers: int | None = None) -> dict[str, Any]:
        """Triton launch options; ``max_registers`` (an encoder's cap) overrides the config's."""
        opts: dict[str, Any] = {"num_warps": self.num_warps}
        cap = self.max_registers if max_registers is None else max_registers
        if cap is not None and not interpreting():
            opts["maxnreg"] = cap
        return opts


def _tuned_encode_registers() -> dict[tuple[StreamSpec, StreamSpec, int], int]:
    """Encoder register caps measured on one H200 with triton 3.6 (bench/RESULTS.md, run 5 of
    the third pass: the same-run sweep of caps 128 and 168 over every stock preset at hd128).
    Uncapped, these encoders use 158-193 registers, 2 or 3 programs of 128 threads per SM; the
    cap that paid most is listed (tq3 0.825 -> 0.664 ms, k8v4 0.594 -> 0.435, k3v2 0.771 -> 0.612,
    tq2 0.563 -> 0.508, k5v4 1.100 -> 1.058). tq4 and k4v3 (138-141 registers) got slower with
    either cap and are not listed. Keyed by the layer policy's (K, V) stream specs."""
    from turbowire.codec.presets import get_preset

    caps = {"tq3": 128, "k3v2": 128, "tq2": 128, "k8v4": 128, "k5v4": 168}
    return {(get_preset(n).body.k, get_preset(n).body.v, 128): c for n, c in caps.items()}


TUNED_ENCODE_REGISTERS = _tuned_encode_registers()


DEFAULT_CONFIG = KernelConfig()


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@functools.lru_cache(maxsize=1)
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except Exception:  # pragma: no cover - triton is a dependency of the GPU extra
        return False
    return True


TRITON_HEAD_DIMS = (64, 128, 256)  # the head sizes the kernels code (others: the reference)


def applies(codec: Any, kv_cache: torch.Tensor) -> bool:
    """True where the Triton kernels serve: CUDA caches of bf16/fp16 (or fp8 e4m3 with the
    layer's scales) with a supported head_dim."""
    return (
        kv_cache.is_cuda
        and kv_cache.dtype in SUPPORTED_DTYPES
        and getattr(codec, "head_dim", None) in TRITON_HEAD_DIMS
        and triton_available()
    )


# ------------------------------------------------------------------------------------------
# constants of a stream spec / codebook tables
# ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _StreamConsts:
    kind: int
    bits: int
    center: int
    sink: int
    nhi: int
    words: int

    def prefixed(self, p: str) -> dict[str, int]:
        return {f"{p}_KIND": self.kind, f"{p}_BITS": self.bits, f"{p}_CENTER": self.center,
                f"{p}_SINK": self.sink, f"{p}_NHI": self.nhi, f"{p}_WORDS": self.words}


def _planes(spec: StreamSpec, dim: int) -> list[tuple[int, int, int, int]]:
    """(group start, group size, plane width, plane byte offset in the row) of a lloyd spec."""
    out = []
    g0 = 0
    off = 0
    for bits, count in spec.coord_bits(dim):
        for w in plane_widths(bits):
            out.append((g0, count, w, off))
            off += count * w // 8
        g0 += count
    return out


@functools.lru_cache(maxsize=None)
def _stream_consts(spec: StreamSpec, dim: int) -> _StreamConsts:
    kind = _KIND_CODES[spec.kind]
    if kind != 2:
        return _StreamConsts(kind, 0, 0, 0, 0, 0)
    if spec.bits + (1 if spec.hi_eighths else 0) not in GAUSSIAN_LLOYD_MAX:
        raise GeometryError(f"no codebook for {spec.bits}-bit lloyd streams")
    nhi = dim * spec.hi_eighths // 8
    words = all(
        off % 4 == 0 and (n * w // 8) % 4 == 0 and g0 % (32 // w) == 0
        for g0, n, w, off in _planes(spec, dim)
    )
    return _StreamConsts(kind, spec.bits, int(spec.center), spec.sink_tokens, nhi, int(words))


@functools.lru_cache(maxsize=None)
def _tables_cpu(dim: int) -> torch.Tensor:
    """fp32 table: s1, s2 (dim each), then per bit width b = 1..6 at table_offset(dim, b):
    2**b thresholds (last one +inf), 2**b levels, 2**b squared levels (fp32(c * c)); then, at
    lut_base(dim), the bucketed quantizer tables of kernels/quant_lut.py (int32 words)."""
    from turbowire.kernels.triton_codec import lut_base, table_offset

    s1, s2 = sign_tables(dim)
    size = table_offset(dim, max(GAUSSIAN_LLOYD_MAX) + 1)
    tab = torch.zeros(size, dtype=torch.float32)
    tab[:dim] = s1
    tab[dim : 2 * dim] = s2
    for b in GAUSSIAN_LLOYD_MAX:
        o = table_offset(dim, b)
        n = 1 << b
        tab[o : o + n - 1] = boundaries(b)
        tab[o + n - 1] = math.inf
        c = centroids(b)
        tab[o + n : o + 2 * n] = c
        tab[o + 2 * n : o + 3 * n] = c * c
    pad = torch.zeros(lut_base(dim) - size, dtype=torch.float32)
    return torch.cat([tab, pad, lut_tables().view(torch.float32)])


@functools.lru_cache(maxsize=None)
def _sign_mask(dim: int, which: int) -> int:
    """The sign table s1 (which=0) or s2 as an integer with bit d set where s[d] == -1 (kernels
    take it as a compile-time constant, so signs cost no registers)."""
    s = sign_tables(dim)[which]
    return sum(1 << d for d in range(dim) if float(s[d]) < 0)


def _block_size_arg(block_size: int) -> int:
    """The kernels' block_size argument: -log2(block_size) for a power of two (the kernels
    shift and mask), else the block size itself (integer division)."""
    if block_size > 1 and block_size & (block_size - 1) == 0:
        return -(block_size.bit_length() - 1)
    return block_size


_TABLE_CACHE: dict[tuple[int, str], torch.Tensor] = {}


def _tables(dim: int, device: torch.device) -> torch.Tensor:
    key = (dim, str(device))
    tab = _TABLE_CACHE.get(key)
    if tab is None:
        tab = _tables_cpu(dim).to(device)
        _TABLE_CACHE[key] = tab
    return tab


# ------------------------------------------------------------------------------------------
# geometry of one layer's cache
# ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _CacheGeom:
    k_off: int  # elements from the launch base pointer
    v_off: int
    strides: tuple[int, int, int]  # block, token, head (elements)


def _cache_geom(kv_cache: torch.Tensor, layout: PagedKVLayout, base: torch.Tensor) -> _CacheGeom:
    k, v = layout.views(kv_cache)
    if k.stride(-1) != 1 or v.stride(-1) != 1 or k.stride() != v.stride():
        raise CacheLayoutError(
            f"K/V views with strides {k.stride()} / {v.stride()}: the kernels need unit stride "
            "along head_dim and the same strides for K and V"
        )
    es = kv_cache.element_size()
    koff, krem = divmod(k.data_ptr() - base.data_ptr(), es)
    voff, vrem = divmod(v.data_ptr() - base.data_ptr(), es)
    strides = tuple(int(s) for s in k.stride()[:3])
    if krem or vrem or koff % 8 or voff % 8 or any(s % 8 for s in strides):
        raise CacheLayoutError(
            "cache planes must start at 16-byte aligned element offsets with strides that are "
            "multiples of 8 elements"
        )
    return _CacheGeom(koff, voff, strides)  # type: ignore[arg-type]


def _block_list(block_ids: Sequence[int] | torch.Tensor) -> list[int]:
    if isinstance(block_ids, torch.Tensor):
        return [int(b) for b in block_ids.reshape(-1).tolist()]
    return [int(b) for b in block_ids]


def _check_tokens(layout: PagedKVLayout, num_ids: int, token_start: int, num_tokens: int) -> None:
    if num_tokens <= 0 or token_start < 0:
        raise BlockIndexError(f"bad token range start={token_start} count={num_tokens}")
    last = token_start + num_tokens - 1
    if last // layout.block_size >= num_ids:
        raise BlockIndexError(
            f"tokens up to {last} need {last // layout.block_size + 1} blocks, "
            f"{num_ids} block ids given"
        )


def _check_block_ids(layout: PagedKVLayout, ids: list[int]) -> None:
    held = [b for b in ids if b != NO_BLOCK]
    if held and (min(held) < 0 or max(held) >= layout.num_blocks):
        raise BlockIndexError(
            f"block ids must be in 0..{layout.num_blocks - 1}, got {min(held)}..{max(held)}"
        )
    if len(set(held)) != len(held):
        raise BlockIndexError("repeated block ids in one request")


def _check_held(layout: PagedKVLayout, ids: list[int], token_start: int, num_tokens: int) -> None:
    """The tokens' blocks are held (no ``NO_BLOCK`` entry among them)."""
    bs = layout.block_size
    first, last = token_start // bs, (token_start + num_tokens - 1) // bs
    if NO_BLOCK in ids[first : last + 1]:
        raise BlockIndexError(
            f"tokens {token_start}..{token_start + num_tokens - 1} fall in a block the request "
            "does not hold"
        )


class _BlockTable:
    """The block ids of one launch, each distinct block list stored and validated once.

    The chunks of one request all carry the request's whole block list (the kernel finds a
    chunk's blocks from its token_start), so converting, validating and appending that list per
    chunk made plan building quadratic in the request length (2048 blocks x 128 chunks x 32
    layers took seconds of host time for a 32k-token request). Lists are recognised by object
    identity: the items keep them alive while the plan is built."""

    def __init__(self) -> None:
        self.ids: list[int] = []
        self._seen: dict[int, tuple[Any, int, list[int], PagedKVLayout]] = {}

    def add(self, layout: PagedKVLayout, block_ids: Sequence[int] | torch.Tensor, token_start: int,
            num_tokens: int) -> tuple[int, list[int]]:
        """Offset of this list in the table (validated for these tokens) and the list itself."""
        hit = self._seen.get(id(block_ids))
        if hit is None or hit[0] is not block_ids or hit[3] is not layout:
            ids = _block_list(block_ids)
            _check_block_ids(layout, ids)  # same refusals as PagedKVLayout.token_index
            hit = (block_ids, len(self.ids), ids, layout)
            self._seen[id(block_ids)] = hit
            self.ids.extend(ids)
        _, offset, ids, _ = hit
        _check_tokens(layout, len(ids), token_start, num_tokens)
        _check_held(layout, ids, token_start, num_tokens)
        return offset, ids


def _check_range(buf: torch.Tensor, offset: int, nbytes: int, what: str) -> None:
    """The front door's range check (``items.check_range``) plus the kernels' 16-byte alignment."""
    check_range(buf, offset, nbytes, what)
    if offset % 16:
        raise StagingAlignmentError(
            f"{what} offset {offset} is not a multiple of 16 bytes (the Triton kernels need it)"
        )


def _check_disjoint(spans: list[tuple[int, int, str]]) -> None:
    """Refuse overlapping [start, end) ranges (two chunks writing the same bytes or slots)."""
    spans = sorted(spans)
    for (a0, a1, what), (b0, _b1, _) in zip(spans, spans[1:]):
        if b0 < a1:
            raise BlockIndexError(f"two chunks write the same {what} ({a0}..{a1} overlaps {b0})")


def _slot_spans(
    layout: PagedKVLayout, ids: list[int], start: int, tokens: int
) -> list[tuple[int, int, str]]:
    bs = layout.block_size
    out = []
    t = start
    end = start + tokens
    while t < end:
        blk = ids[t // bs]
        lo = t % bs
        hi = min(bs, lo + end - t)
        out.append((blk * bs + lo, blk * bs + hi, "cache slots"))
        t += hi - lo
    return out


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@functools.lru_cache(maxsize=4096)
def _chunk_sizes(codec_key: tuple[Any, ...], codec: Codec, layer: int, tokens: int, heads: int,
                 start: bool) -> tuple[int, int]:
    """(chunk bytes, K stream bytes); cached per layer policy and token count."""
    lay = codec.layout(layer, tokens, heads, 0 if start else tokens)
    return lay.nbytes, lay.k.nbytes


def _sizes(codec: Codec, layer: int, tokens: int, heads: int, token_start: int) -> tuple[int, int]:
    pol = codec.policy(layer)
    key = (codec.preset.preset_id, codec.head_dim, codec.num_layers, pol.k, pol.v)
    return _chunk_sizes(key, codec, layer, tokens, heads, token_start == 0)


# ------------------------------------------------------------------------------------------
# plans: host-side validation and tables once, launches any number of times
# ------------------------------------------------------------------------------------------
@dataclass
class _Launch:
    """Items of one launch (one layer policy): rows of the int64 table and flat block ids."""

    rows: list[list[int]]
    blocks: _BlockTable = field(default_factory=_BlockTable)
    max_tokens: int = 1  # the largest chunk, rounded up to a power of two


def _transforms(kspec: StreamSpec, vspec: StreamSpec) -> bool:
    """Whether a launch runs the rotation (a lloyd stream): it picks the default lanes."""
    return "lloyd" in (kspec.kind, vspec.kind)


def _group_key(codec: Codec, layer: int) -> tuple[StreamSpec, StreamSpec]:
    pol = codec.policy(layer)
    return pol.k, pol.v


def _check_jobs(codec: Codec, jobs: Sequence[tuple[int, torch.Tensor, PagedKVLayout, Any]],
                buf: torch.Tensor, what: str) -> tuple[torch.Tensor, PagedKVLayout]:
    if buf.dtype != torch.uint8 or buf.dim() != 1:
        raise TypeError(f"{what} must be a 1-D uint8 tensor")
    base, lay0 = jobs[0][1], jobs[0][2]
    if lay0.head_dim != codec.head_dim:
        raise CacheLayoutError(f"cache head_dim {lay0.head_dim} != codec head_dim {codec.head_dim}")
    if base.dtype not in SUPPORTED_DTYPES:
        raise CacheLayoutError(
            f"the Triton kernels code bf16/fp16/fp8-e4m3 caches, got {base.dtype}")
    if buf.device != base.device:
        raise CacheLayoutError(f"{what} is on {buf.device}, the cache on {base.device}")
    for _layer, cache, layout, _items in jobs:
        if cache.dtype != base.dtype or cache.device != base.device or layout != lay0:
            raise CacheLayoutError("all layers of one call must share dtype, device and geometry")
    return base, lay0


def _scale_columns(base: torch.Tensor, n_jobs: int,
                   kv_scales: Sequence[KVScales | None] | None) -> list[tuple[int, int]]:
    """Per job, the (K, V) scale columns of the item table as fp32 bits: the layer's scales for
    fp8 caches (required), 1.0 otherwise (refused if given)."""
    one = _f32_bits(1.0)
    scales = list(kv_scales) if kv_scales is not None else [None] * n_jobs
    if len(scales) != n_jobs:
        raise ValueError(f"kv_scales has {len(scales)} entries for {n_jobs} layers")
    if not is_fp8_cache(base):
        if any(sc is not None for sc in scales):
            raise CacheLayoutError(
                f"kv_scales only apply to fp8 caches; this cache is {base.dtype}")
        return [(one, one)] * n_jobs
    cols = []
    for sc in scales:
        if sc is None:
            raise CacheLayoutError(
                f"a {base.dtype} cache is read as fp8 e4m3 and needs every layer's K/V scales")
        k, v = sc.as_fp32()
        cols.append((_f32_bits(k), _f32_bits(v)))
    return cols


def _f32_bits(x: float) -> int:
    return int(torch.tensor([x], dtype=torch.float32).view(torch.int32)[0])


def _kernel_cache(base: torch.Tensor) -> torch.Tensor:
    """The tensor handed to the kernels: fp8 caches as their uint8 bits."""
    return base.view(torch.uint8) if is_fp8_cache(base) else base


def _raise_like_reference(
    codec: Codec, layer: int, item: DecodeItem, layout: PagedKVLayout, source: torch.Tensor,
    code: int,
) -> None:
    """Re-check a chunk the GPU refused with the reference decoder to raise its exception."""
    data = source[item.in_offset : item.in_offset + item.nbytes].cpu()
    k, _v = codec.decode(
        layer, data, expected_tag=item.expected_tag, expected_tokens=item.num_tokens,
        expected_offset=item.token_start,
    )
    if item.heads is not None:  # a head window: the chunk's heads are the window's source's
        check_chunk_heads(layer, k.shape[1], item.heads)
    elif k.shape[1:] != (layout.num_heads, layout.head_dim):
        raise CacheLayoutError(
            f"scatter of {tuple(k.shape)} into a cache of {layout.num_heads} heads x "
            f"{layout.head_dim}"
        )
    raise ChecksumError(  # the reference accepted what the kernel refused: a kernel bug
        f"chunk at source offset {item.in_offset} failed GPU verification (status {code:#x}) "
        "but the reference decoder accepts it"
    )


# The block-chunk encoder's register cap (``block_kernel_config``): a 16-row program is
# latency-bound; the compiler's ~142 registers let 7 programs share an SM, 96 let 10 (H200,
# bench/RESULTS.md "GPU connector path", passes 1 and 9).
BLOCK_ENCODE_REGISTERS = 96


def block_kernel_config(block_size: int) -> KernelConfig | None:
    """The launch shape for block-sized chunks: 2 warps and 16-row tiles for blocks of <= 16
    tokens (the default 32-row tiles run half empty), the encoder capped at
    ``BLOCK_ENCODE_REGISTERS``; None (the kernels' default) for larger blocks."""
    if block_size > 16:
        return None
    return KernelConfig(num_warps=2, tile_rows=16, encode_max_registers=BLOCK_ENCODE_REGISTERS)


def cuda_serves(codec: Any, caches: Sequence[torch.Tensor]) -> bool:
    """Whether the Triton plans serve every one of these caches (all CUDA caches of a supported
    dtype and head_dim): the connector's one CUDA-or-host question."""
    return bool(caches) and all(applies(codec, t) for t in caches)


def _decode_calls(
    cfg: KernelConfig, kspec: StreamSpec, vspec: StreamSpec, dim: int, n: int, max_tokens: int,
    cache: torch.Tensor, source: torch.Tensor, table: torch.Tensor, blocks: torch.Tensor,
    tab: torch.Tensor, status: torch.Tensor, acc: torch.Tensor, fail: torch.Tensor,
    strides: tuple[int, ...], block_size: int, heads: int, preset_id: int, num_layers: int,
) -> list[tuple[Any, tuple[int, ...], tuple[Any, ...], dict[str, Any]]]:
    """The launches (kernel, grid, args, kwargs) that verify and decode the ``n`` chunks of one
    layer policy's table: the fused kernel, or for long chunks (``cfg.decodes_by_head``) the
    verify pass then the per-head decode. Either way a refused chunk writes nothing, the
    others are decoded, ``fail`` counts the refusals and ``status`` holds each chunk's bits;
    ``acc`` (two zeroed int32 per status slot, left zeroed) gathers the verify pass's sums."""
    from turbowire.kernels import triton_codec as tk

    tf = _transforms(kspec, vspec)
    shape = dict(D=dim, L=cfg.lanes_for(dim, False, tf), BT=cfg.tile_rows_for(dim, False, tf),
                 **_stream_consts(kspec, dim).prefixed("K"),
                 **_stream_consts(vspec, dim).prefixed("V"), MANUAL=interpreting(),
                 S1M=_sign_mask(dim, 0), S2M=_sign_mask(dim, 1), **cfg.launch_options(),
                 enable_fp_fusion=False)
    bs = _block_size_arg(block_size)
    if cfg.decodes_by_head(max_tokens):
        words = cfg.verify_words or 16 * 32 * cfg.verify_warps
        body = sum(stream_layout(spec, max_tokens, heads, dim, True).nbytes
                   for spec in (kspec, vspec))
        splits = max(-(-body // 4 // words), 1)
        return [
            (tk.verify_kernel, (n, splits),
             (source, table, acc, status, fail, heads, preset_id, num_layers),
             dict(D=dim, BLOCKW=words, num_warps=cfg.verify_warps)),
            (tk.decode_heads_kernel, (n * 2 * heads,),
             (cache, source, table, blocks, tab, status, *strides, bs, heads), shape),
        ]
    return [(tk.decode_kernel, (n * cfg.decode_split,),
             (cache, source, table, blocks, tab, status, fail, *strides, bs, heads, preset_id,
              num_layers),
             dict(shape, SPLIT=cfg.decode_split, BLOCKW=cfg.verify_words_for()))]


def kernel_constants(kspec: StreamSpec, vspec: StreamSpec, dim: int, cfg: KernelConfig,
                     encode: bool, max_tokens: int = 256) -> dict[str, Any]:
    """The compile-time arguments the plans give the encode kernel (``encode``) or the fused
    decode kernel for one layer policy, chunks of up to ``max_tokens`` tokens: what an
    ahead-of-time compile of the same kernels needs (bench/kernels_aot.py)."""
    tf = _transforms(kspec, vspec)
    cx: dict[str, Any] = {**_stream_consts(kspec, dim).prefixed("K"),
                          **_stream_consts(vspec, dim).prefixed("V"),
                          "D": dim, "L": cfg.lanes_for(dim, encode, tf),
                          "BT": cfg.tile_rows_for(dim, encode, tf),
                          "S1M": _sign_mask(dim, 0), "S2M": _sign_mask(dim, 1)}
    if encode:
        sbt = cfg.sum_rows_for(dim, tf)
        cx.update(SBT=sbt, LV=max(max_tokens // sbt, 1).bit_length() - 1, QMODE=cfg.qmode,
                  FP8_MANUAL=interpreting(), NUM_WARPS=cfg.num_warps,
                  SMAJOR=cfg.stream_major_for(kspec, vspec),
                  SQRT_D=float(torch.tensor(math.sqrt(dim), dtype=torch.float32)))
    else:
        cx.update(MANUAL=interpreting(), SPLIT=cfg.decode_split, BLOCKW=cfg.verify_words_for())
    return cx
