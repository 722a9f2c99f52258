"""Triton kernels of the codec fused with vLLM's paged KV layouts (encode, verify + decode).

An encode program owns one (chunk, stream, KV head), a decode program one chunk (or one of its
two streams, ``KernelConfig.decode_split``) whose heads it decodes one after another; either
walks a (stream, head)'s tokens in tiles of ``BT`` rows; each row (one token's vector of one
head) lives in ``L`` neighbouring lanes (lane l holds coordinates l*C .. l*C+C-1, C = D/L),
loaded straight from the paged cache through the block table. With C coordinates in registers
the randomized Hadamard butterfly, the pairwise norm folds and the bit-plane packing are
register-only work except the log2(L) top butterfly stages and folds across lanes (one exchange
per value and stage). With L = D/8 (C = 8, one 16-byte piece per lane) rows are loaded and
stored as ``[rows, D]`` tiles: a warp reads whole rows. The defaults (KernelConfig.lanes_for)
use that for raw/fp8 launches and 4 lanes (32 at head_dim 256) where a rotation runs, the faster
shapes measured on the H200 (bench/RESULTS.md).

Bit-exactness with ``turbowire.codec`` rests on doing the reference's fp32 operations in the
same order (FORMAT.md "Encode numerics"): the butterfly stages h = 1, 2, 4, ... (a recursive split
on the lowest coordinate bit does exactly that), adjacent-pair folds for the norms, the token
fold of the chunk mean as a binary tree over aligned tiles, IEEE division and square root
(``tl.div_rn`` / ``tl.sqrt_rn``), and kernels compiled with ``enable_fp_fusion=False`` so no
multiply-add is contracted. Decoding follows the reference's operation order as well, so decoded
values are bit-identical too.

Caches: bf16/fp16, or fp8 e4m3 (uint8 bits) with the layer's K/V scales carried in the item
table: values enter as bf16(fp32(q) * scale) and leave as e4m3(x / scale) (``_src_vals``,
``_fp8_cache_bits``; semantics in ``kernels/fp8_cache.py``). Pointer tensors are shaped for the
installed Triton's layout choice (``_rows_first``).

Checksums: each program adds the wsum32 contribution of every byte it writes (the checksum is
linear, so the pieces can be summed in any order mod 2**32) into a per-chunk accumulator; the
last program of a chunk (an acq_rel counter) writes the 48-byte header with both checksums.
The decode kernel verifies before it writes: each program recomputes the body checksum of the
chunk it owns and checks its header against what the decoder expects (``_verify_chunk``, the
reference decoder's checks), records the verdict, and decodes the chunk only if it passed. A
refused chunk is never written; the other chunks of the same launch are (one launch, no
separate verify pass: the caller learns of a refusal from the flag and the per-chunk status).
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

KIND_RAW = 0
KIND_FP8 = 1
KIND_LLOYD = 2

# Item table columns (int64). Host code indexes with the plain ints of ENCODE_FIELDS /
# DECODE_FIELDS; kernels read the tl.constexpr copies below.
ENCODE_FIELDS = ("koff", "voff", "start", "tokens", "pow2", "out", "blk", "tag_lo", "tag_hi",
                 "layer", "body", "kbytes", "kscale", "vscale")
DECODE_FIELDS = ("koff", "voff", "start", "tokens", "in", "nbytes", "blk", "tag_lo", "tag_hi",
                 "has_tag", "layer", "body", "kbytes", "status", "kscale", "vscale", "head0",
                 "heads")
E_KOFF = tl.constexpr(0)
E_VOFF = tl.constexpr(1)
E_START = tl.constexpr(2)
E_T = tl.constexpr(3)
E_P = tl.constexpr(4)
E_OUT = tl.constexpr(5)
E_BLK = tl.constexpr(6)
E_TAGLO = tl.constexpr(7)
E_TAGHI = tl.constexpr(8)
E_LAYER = tl.constexpr(9)
E_BODY = tl.constexpr(10)
E_KBYTES = tl.constexpr(11)
E_KSCALE = tl.constexpr(12)  # fp8 caches: the layer's K / V scale as fp32 bits (else 1.0)
E_VSCALE = tl.constexpr(13)
E_FIELDS = tl.constexpr(len(ENCODE_FIELDS))
D_KOFF = tl.constexpr(0)
D_VOFF = tl.constexpr(1)
D_START = tl.constexpr(2)
D_T = tl.constexpr(3)
D_IN = tl.constexpr(4)
D_NBYTES = tl.constexpr(5)
D_BLK = tl.constexpr(6)
D_TAGLO = tl.constexpr(7)
D_TAGHI = tl.constexpr(8)
D_HASTAG = tl.constexpr(9)
D_LAYER = tl.constexpr(10)
D_BODY = tl.constexpr(11)
D_KBYTES = tl.constexpr(12)
D_STATUS = tl.constexpr(13)  # where the chunk's verify status goes in the status array
D_KSCALE = tl.constexpr(14)
D_VSCALE = tl.constexpr(15)
# the chunk heads [head0, head0 + heads) a program writes (a head window: a decode rank of another
# TP size; else 0 and every head); koff / voff then point head0 heads before the cache's first
# written head, so chunk head h lands at cache head h - head0 + that head
D_HEAD0 = tl.constexpr(16)
D_HEADS = tl.constexpr(17)
D_FIELDS = tl.constexpr(len(DECODE_FIELDS))

# verify status bits (a failing chunk is re-checked by the reference on the host for the message)
ST_FORMAT = 1
ST_HEADER_CHECKSUM = 2
ST_INCOMPATIBLE = 4
ST_TRUNCATED = 8
ST_BODY_CHECKSUM = 16

MAGIC_WORD = tl.constexpr(0x564B5754)  # b"TWKV" little-endian


def _rows_first() -> bool:
    """How this Triton orders the dims of a load whose pointers are contiguous only in the last
    dim: 3.6 hands the threads to the lowest dims first, 3.8 and later to the highest. The row
    layout (a whole head vector per thread, rows across the threads) needs the rows' dim to come
    first in that order, so its pointer tensors put the rows first (3.6) or second (3.8+).
    Either shape computes the same bytes; the wrong one costs speed (lane shuffles, spills)."""
    forced = os.environ.get("TURBOWIRE_TRITON_ROWS_FIRST")
    if forced in ("0", "1"):
        return forced == "1"
    major, minor = (int(p) for p in triton.__version__.split(".")[:2])
    return (major, minor) < (3, 7)


ROWS_FIRST = tl.constexpr(_rows_first())
# rows over 1 or 2 lanes: in-thread butterfly stages and folds as two-element sums and the
# carried-threshold quantizer (False: the recursive split/join of wider lane counts)
STAGE_SUMS = tl.constexpr(True)


def table_offset(head_dim: int, bits: int) -> int:
    """Start of the ``bits``-bit codebook block in the fp32 table (after the two sign tables)."""
    return 2 * head_dim + 3 * ((1 << bits) - 2)


def lut_base(head_dim: int) -> int:
    """Start of the bucketed quantizer tables (kernels/quant_lut.py) in the table, in words:
    after the codebooks of bits 1..6, 32-byte aligned (the kernel computes the same from D)."""
    return (table_offset(head_dim, 7) + 7) // 8 * 8


# ------------------------------------------------------------------------------------------
# small helpers
# ------------------------------------------------------------------------------------------
@triton.jit
def _align16(n):
    return (n + 15) // 16 * 16


@triton.jit
def _sign_leaf(x, MASK: tl.constexpr, IDX: tl.constexpr, L: tl.constexpr, C: tl.constexpr):
    """x [L, BT, 1] times the sign of coordinate l*C + IDX (MASK bit set: -1). The signs are
    compile-time constants: a negation (folded into the next add) or nothing; only when the
    lanes of a row disagree (L > 1) does a per-lane factor (+-1, exact) remain."""
    S0: tl.constexpr = (MASK >> IDX) & 1
    if L == 1:
        if S0 == 1:
            return -x
        else:
            return x
    else:
        ln = tl.arange(0, L)[:, None, None]
        g = tl.where(ln == 0, 1.0 - 2.0 * S0, 1.0)
        for lane in tl.static_range(1, L):
            if ((MASK >> (lane * C + IDX)) & 1) == 1:
                g = tl.where(ln == lane, -1.0, g)
        return x * g


@triton.jit
def _sign_word(d, MASK: tl.constexpr, K: tl.constexpr, N: tl.constexpr):
    """The 32-bit word of the sign mask holding coordinate d's bit (d // 32 == K .. N-1)."""
    W: tl.constexpr = (MASK >> (32 * K)) & 0xFFFFFFFF
    WS: tl.constexpr = W - (1 << 32) if W >= (1 << 31) else W
    if K == N - 1:
        return tl.full(d.shape, WS, tl.int32)
    else:
        return tl.where(d // 32 == K, WS, _sign_word(d, MASK, K + 1, N))


@triton.jit
def _sign_vec(MASK: tl.constexpr, D: tl.constexpr):
    """+-1.0 per coordinate [D] of the D-bit sign mask. In the row layout every register's
    coordinate is a compile-time constant, so the product folds into the next add's sign."""
    d = tl.arange(0, D)
    w = _sign_word(d, MASK, 0, (D + 31) // 32)
    return 1.0 - 2.0 * ((w >> (d % 32)) & 1).to(tl.float32)


@triton.jit
def _bfly_stage(x, BT: tl.constexpr, D: tl.constexpr, H: tl.constexpr):
    """Butterfly stage h = H over rows x [BT, D] held by one thread each: (a + b, a - b) as a
    two-element sum and a sum with the second element negated (a + (-b) == a - b exactly), the
    pair axis in registers, so no value leaves its thread and no layout changes."""
    y = tl.reshape(x, [BT, D // (2 * H), 2, H])
    sg = tl.where(tl.arange(0, 2) == 0, 1.0, -1.0)[None, None, :, None]
    s = tl.sum(y, axis=2)
    d = tl.sum(y * sg, axis=2)
    lo = (tl.arange(0, 2) == 0)[None, None, :, None]
    return tl.reshape(tl.where(lo, tl.expand_dims(s, 2), tl.expand_dims(d, 2)), [BT, D])


@triton.jit
def _fwht_row(x, BT: tl.constexpr, D: tl.constexpr, H: tl.constexpr):
    """Stages h = H, 2H, ..., D/2 of the butterfly over rows x [BT, D] (one row per thread)."""
    if H >= D:
        return x
    else:
        return _fwht_row(_bfly_stage(x, BT, D, H), BT, D, H * 2)


@triton.jit
def _rotate_row(x, MASK_IN: tl.constexpr, MASK_OUT: tl.constexpr, BT: tl.constexpr,
                D: tl.constexpr):
    """s_out * FWHT(s_in * x) for x [1, BT, D], a whole row per thread."""
    y = tl.reshape(x, [BT, D]) * _sign_vec(MASK_IN, D)[None, :]
    y = _fwht_row(y, BT, D, 1) * _sign_vec(MASK_OUT, D)[None, :]
    return tl.reshape(y, [1, BT, D])


@triton.jit
def _signs(x, MASK: tl.constexpr, L: tl.constexpr, BT: tl.constexpr, N: tl.constexpr,
           IDX: tl.constexpr, STEP: tl.constexpr, C: tl.constexpr):
    """x [L, BT, N] (element j = coordinate IDX + j*STEP of each lane) times the sign table."""
    if N == 1:
        return _sign_leaf(x, MASK, IDX, L, C)
    else:
        a, b = tl.split(tl.reshape(x, [L, BT, N // 2, 2]))
        a = _signs(a, MASK, L, BT, N // 2, IDX, STEP * 2, C)
        b = _signs(b, MASK, L, BT, N // 2, IDX + STEP, STEP * 2, C)
        return tl.reshape(tl.join(a, b), [L, BT, N])


@triton.jit
def _fwht_rows(x, L: tl.constexpr, BT: tl.constexpr, N: tl.constexpr, IDX: tl.constexpr,
               STEP: tl.constexpr, C: tl.constexpr, MASK: tl.constexpr, SIGN: tl.constexpr):
    """Butterfly stages h = 1, 2, ..., N/2 over the last dim of x [L, BT, N] (in-thread).

    Splitting on the lowest coordinate bit gives stage h = 1 as (a + b, a - b); the rest of the
    transform acts on the halves independently (their lowest bit is the next coordinate bit).
    SIGN: multiply the outputs by the sign table MASK on the way out (at the leaves)."""
    if N == 1:
        if SIGN:
            return _sign_leaf(x, MASK, IDX, L, C)
        else:
            return x
    else:
        a, b = tl.split(tl.reshape(x, [L, BT, N // 2, 2]))
        lo = _fwht_rows(a + b, L, BT, N // 2, IDX, STEP * 2, C, MASK, SIGN)
        hi = _fwht_rows(a - b, L, BT, N // 2, IDX + STEP, STEP * 2, C, MASK, SIGN)
        return tl.reshape(tl.join(lo, hi), [L, BT, N])


@triton.jit
def _rotate(x, MASK_IN: tl.constexpr, MASK_OUT: tl.constexpr, L: tl.constexpr, BT: tl.constexpr,
            C: tl.constexpr):
    """s_out * FWHT(s_in * x) over the D = L*C coordinates of each row of x [L, BT, C]."""
    if L == 1:
        return _rotate_row(x, MASK_IN, MASK_OUT, BT, C)
    elif STAGE_SUMS and L <= 2:
        y = _signs(x, MASK_IN, L, BT, C, 0, 1, C)
        y = tl.reshape(_fwht_row(tl.reshape(y, [L * BT, C]), L * BT, C, 1), [L, BT, C])
        y = _fwht_lanes(y, L, BT, C, 1)
        return _signs(y, MASK_OUT, L, BT, C, 0, 1, C)
    else:
        y = _signs(x, MASK_IN, L, BT, C, 0, 1, C)
        y = _fwht_lanes(_fwht_rows(y, L, BT, C, 0, 1, C, MASK_OUT, False), L, BT, C, 1)
        return _signs(y, MASK_OUT, L, BT, C, 0, 1, C)


@triton.jit
def _fwht_lanes(x, L: tl.constexpr, BT: tl.constexpr, C: tl.constexpr, G: tl.constexpr):
    """Butterfly stages across the L lanes of a row (coordinate bits above log2(C)), G = 1, 2..

    One exchange per value: the 2-lane integer sum of the bit patterns minus the own pattern is
    the partner's value (exact mod 2**32); fma(+1, a, b) = a + b on the lower lane and
    fma(-1, b, a) = a - b on the upper one (a product by +-1 is exact, so each is rounded once,
    as the reference's add/subtract)."""
    if G >= L:
        return x
    else:
        y = tl.reshape(x, [L // (2 * G), 2, G, BT, C])
        yb = y.to(tl.int32, bitcast=True)
        tot = tl.sum(yb, axis=1).to(tl.int32)
        partner = (tl.expand_dims(tot, 1) - yb).to(tl.float32, bitcast=True)
        sgn = tl.where(tl.arange(0, 2) == 0, 1.0, -1.0)[None, :, None, None, None]
        r = tl.fma(sgn, y, partner)
        return _fwht_lanes(tl.reshape(r, [L, BT, C]), L, BT, C, G * 2)


@triton.jit
def _gather_rows(tab_ptr, idx, L: tl.constexpr, BT: tl.constexpr, C: tl.constexpr):
    """tab[idx] for idx [L, BT, C] in the row layout. With no contiguity to exploit, the
    compiler hands a gather's threads to the dims in its tie order (_rows_first): the indices
    go in as [L, BT, C] (3.6) or [C, BT, L] (3.8+), so the lanes of a row, then the rows, get
    the threads and C stays in registers: the row layout itself, with no shared-memory round
    trip around the gather."""
    if ROWS_FIRST:
        return tl.load(tab_ptr + idx)
    else:
        it = tl.permute(idx, (2, 1, 0))
        return tl.permute(tl.load(tab_ptr + it), (2, 1, 0))


@triton.jit
def _gather_quads(tab_ptr, idx, L: tl.constexpr, BT: tl.constexpr, C: tl.constexpr):
    """tab[idx + 0..3] for idx [L, BT, C] (a multiple of 4): one 16-byte load per value, the
    four words split back into [L, BT, C] tensors in the row layout (pointer order as in
    _gather_rows, the four words innermost)."""
    q = tl.arange(0, 4)
    if ROWS_FIRST:
        x = tl.load(tab_ptr + (idx[:, :, :, None] + q[None, None, None, :]))
    else:
        it = tl.permute(idx, (2, 1, 0))
        x = tl.load(tab_ptr + (it[:, :, :, None] + q[None, None, None, :]))
        x = tl.permute(x, (2, 1, 0, 3))
    e02, e13 = tl.split(tl.reshape(x, [L, BT, C, 2, 2]))
    w0, w2 = tl.split(e02)
    w1, w3 = tl.split(e13)
    return w0, w1, w2, w3


@triton.jit
def _gload_rows(ptrs, mask, L: tl.constexpr, BT: tl.constexpr, C: tl.constexpr):
    """Masked gather of pointers [L, BT, C] in the row layout (see _gather_rows)."""
    if ROWS_FIRST:
        return tl.load(ptrs, mask=mask, other=0)
    else:
        pt = tl.permute(ptrs, (2, 1, 0))
        mt = tl.permute(mask, (2, 1, 0))
        return tl.permute(tl.load(pt, mask=mt, other=0), (2, 1, 0))


@triton.jit
def _fold_rows(x, L: tl.constexpr, BT: tl.constexpr, N: tl.constexpr, K: tl.constexpr):
    """Add adjacent pairs along the last dim of x [L, BT, N], K times: [L, BT, N >> K]."""
    if K == 0:
        return x
    elif L == 1 or (STAGE_SUMS and L <= 2):
        return _fold_rows(tl.sum(tl.reshape(x, [L, BT, N // 2, 2]), axis=3), L, BT, N // 2, K - 1)
    else:
        a, b = tl.split(tl.reshape(x, [L, BT, N // 2, 2]))
        return _fold_rows(a + b, L, BT, N // 2, K - 1)


@triton.jit
def _fold_lanes(x, L: tl.constexpr, BT: tl.constexpr):
    """Adjacent-pair fold over the lane dim of x [L, BT] -> [BT]."""
    if L == 1:
        return tl.reshape(x, [BT])
    else:
        return _fold_lanes(tl.sum(tl.reshape(x, [L // 2, 2, BT]), axis=1), L // 2, BT)


@triton.jit
def _row_norm2(x, L: tl.constexpr, BT: tl.constexpr, C: tl.constexpr, LOGC: tl.constexpr):
    """Pairwise fold of x [L, BT, C] over the D = L*C coordinates of each row -> [BT]."""
    f = _fold_rows(x, L, BT, C, LOGC)
    return _fold_lanes(tl.reshape(f, [L, BT]), L, BT)


@triton.jit
def _mux_thr(tp, IDX: tl.constexpr, K: tl.constexpr, S: tl.constexpr, HALF: tl.constexpr,
             NB: tl.constexpr, p0, p1, p2, p3, p4):
    """Threshold bits tp[IDX + prefix + HALF - 1]: the prefix is the value of the already known
    search bits p_K..p_{S-1} (p0 the most significant of NB); a select tree over scalars."""
    if K == S:
        return tl.load(tp + (IDX + HALF - 1))
    else:
        if K == 0:
            p = p0
        elif K == 1:
            p = p1
        elif K == 2:
            p = p2
        elif K == 3:
            p = p3
        else:
            p = p4
        BV: tl.constexpr = 1 << (NB - 1 - K)
        return tl.where(p, _mux_thr(tp, IDX + BV, K + 1, S, HALF, NB, p0, p1, p2, p3, p4),
                        _mux_thr(tp, IDX, K + 1, S, HALF, NB, p0, p1, p2, p3, p4))


@triton.jit
def _quantize_carry(v, tab_ptr, BND: tl.constexpr, B: tl.constexpr):
    """QMODE 1's symmetric integer search (see _quantize) for B <= 4 bits, written so that no
    comparison result outlives the next step: each level picks the thresholds of the levels
    below it right away (a select per candidate) and the sign becomes a 0/-1 integer at once.
    With a whole row per thread, kept predicates would be packed into bit masks (two logic
    instructions per value and level); this form needs none."""
    H: tl.constexpr = 1 << (B - 1)
    bits = v.to(tl.int32, bitcast=True)
    neg = tl.where(v > 0.0, 0, -1)  # not v > 0 (zeros of both signs, NaN), as the reference
    a = (bits & 0x7FFFFFFF) + (neg & 1)  # |v|, one ulp up where v <= 0 (>= becomes >)
    tp = tab_ptr.to(tl.pointer_type(tl.int32), bitcast=True) + (BND + H)  # positive P_1..P_{H-1}
    if B == 1:
        n = tl.zeros(v.shape, tl.int32)
    elif B == 2:
        n = tl.where(a > tl.load(tp), 1, 0)
    elif B == 3:
        p0 = a > tl.load(tp + 1)
        t1 = tl.where(p0, tl.load(tp + 2), tl.load(tp))
        n = tl.where(p0, 2, 0)
        n += tl.where(a > t1, 1, 0)
    else:
        p0 = a > tl.load(tp + 3)
        t1 = tl.where(p0, tl.load(tp + 5), tl.load(tp + 1))
        t2a = tl.where(p0, tl.load(tp + 6), tl.load(tp + 2))
        t2b = tl.where(p0, tl.load(tp + 4), tl.load(tp))
        n = tl.where(p0, 4, 0)
        p1 = a > t1
        t2 = tl.where(p1, t2a, t2b)
        n += tl.where(p1, 2, 0)
        n += tl.where(a > t2, 1, 0)
    return (n + H) ^ (neg & (2 * H - 1))


@triton.jit
def _quantize(v, tab_ptr, BND: tl.constexpr, B: tl.constexpr, QMODE: tl.constexpr,
              L: tl.constexpr, BT: tl.constexpr, C: tl.constexpr):
    """code = #{k : v > boundary_k}, ties included, for the 2**B - 1 sorted boundaries at
    tab_ptr[BND..] (symmetric, the middle one exactly 0).

    QMODE 0: binary search with gathered thresholds. QMODE 1: for v > 0 the code is
    H + #{j : v > P_j} over the H - 1 positive boundaries P (H = 2**(B-1)); for v <= 0 it is
    H - 1 - #{j : |v| >= P_j} = H - 1 - #{j : next_up(|v|) > P_j}. Positive floats compare as
    their int32 bits, so one integer binary search (select tree over scalar thresholds) serves
    both signs."""
    if QMODE == 1 and STAGE_SUMS and L <= 2 and B <= 4:
        return _quantize_carry(v, tab_ptr, BND, B)
    elif QMODE == 0:
        code = tl.zeros(v.shape, tl.int32)
        for s in tl.static_range(B):
            half = 1 << (B - 1 - s)
            thr = _gather_rows(tab_ptr + (BND + half - 1), code, L, BT, C)
            code = code + tl.where(v > thr, half, 0)
        return code
    else:
        H: tl.constexpr = 1 << (B - 1)
        NB: tl.constexpr = B - 1
        pos = v > 0.0
        bits = v.to(tl.int32, bitcast=True)
        a = tl.where(pos, bits, (bits & 0x7FFFFFFF) + 1)
        tp = tab_ptr.to(tl.pointer_type(tl.int32), bitcast=True) + (BND + H)
        n = tl.zeros(v.shape, tl.int32)
        p0 = pos
        p1 = pos
        p2 = pos
        p3 = pos
        p4 = pos
        if NB > 0:
            p0 = a > _mux_thr(tp, 0, 0, 0, 1 << (NB - 1), NB, p0, p1, p2, p3, p4)
            n += tl.where(p0, 1 << (NB - 1), 0)
        if NB > 1:
            p1 = a > _mux_thr(tp, 0, 0, 1, 1 << (NB - 2), NB, p0, p1, p2, p3, p4)
            n += tl.where(p1, 1 << (NB - 2), 0)
        if NB > 2:
            p2 = a > _mux_thr(tp, 0, 0, 2, 1 << (NB - 3), NB, p0, p1, p2, p3, p4)
            n += tl.where(p2, 1 << (NB - 3), 0)
        if NB > 3:
            p3 = a > _mux_thr(tp, 0, 0, 3, 1 << (NB - 4), NB, p0, p1, p2, p3, p4)
            n += tl.where(p3, 1 << (NB - 4), 0)
        if NB > 4:
            p4 = a > _mux_thr(tp, 0, 0, 4, 1 << (NB - 5), NB, p0, p1, p2, p3, p4)
            n += tl.where(p4, 1 << (NB - 5), 0)
        return (n + H) ^ tl.where(pos, 0, 2 * H - 1)


@triton.jit
def _quantize_lut(v, tab_ptr, B: tl.constexpr, D: tl.constexpr, L: tl.constexpr, BT: tl.constexpr,
                  C: tl.constexpr):
    """(code, fp32 squared level) of v through the bucketed table of kernels/quant_lut.py: the
    sign is folded as in _quantize (a = |v| bits, one ulp up where v <= 0), a's top bits pick a
    cell (clamped to the last), the cell's single change point t gives n = #{j : a > P_j}.
    Bit-identical to #{k : v > boundary_k} for every float (NaN: code 0)."""
    H: tl.constexpr = 1 << (B - 1)
    QB: tl.constexpr = (2 * D + 3 * 126 + 7) // 8 * 8  # lut_base(D)
    QS: tl.constexpr = 24 - B  # quant_lut.lut_shift
    NC: tl.constexpr = 130 << (B - 1)  # quant_lut.lut_cells
    QOFF: tl.constexpr = QB + 4 * 130 * ((1 << (B - 1)) - 1)  # + quant_lut.lut_offset
    bits = v.to(tl.int32, bitcast=True)
    neg = tl.where(v > 0.0, 0, -1)  # not v > 0 (zeros of both signs, NaN), as the reference
    a = ((bits & 0x7FFFFFFF) + (neg & 1)).to(tl.uint32, bitcast=True)
    cell = tl.minimum(a >> QS, NC - 1).to(tl.int32, bitcast=True)
    tp = tab_ptr.to(tl.pointer_type(tl.int32), bitcast=True)
    t, n_lo, c2lo, c2hi = _gather_quads(tp, cell * 4 + QOFF, L, BT, C)
    p = a > t.to(tl.uint32, bitcast=True)
    n = n_lo + p.to(tl.int32)
    code = (n + H) ^ (neg & (2 * H - 1))
    return code, tl.where(p, c2hi, c2lo).to(tl.float32, bitcast=True)


@triton.jit
def _e4m3_bits(v):
    """Round-to-nearest-even fp32 -> float8 e4m3fn bits for |v| <= 448 (integer arithmetic; the
    interpreter's cast carries wrongly into the exponent, the GPU's cvt.rn.satfinite agrees)."""
    bits = v.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    a = bits & 0x7FFFFFFF
    # normal range (|v| >= 2**-6): round the 23-bit mantissa to 3 bits, re-bias 127 -> 7
    r = (a + 0x7FFFF + ((a >> 20) & 1)) >> 20
    normal = r - 960
    # subnormal range: the nearest even multiple of 2**-9 (8 is the smallest normal, 0x08)
    q = tl.abs(v) * 512.0
    sub = ((q + 8388608.0) - 8388608.0).to(tl.int32)
    code = tl.where(a < 0x3C800000, sub, normal)
    return (code | sign).to(tl.uint8)


@triton.jit
def _scale_at(ip, FIELD: tl.constexpr):
    """An fp32 stored as its bits in the int64 item table."""
    return tl.load(ip + FIELD).to(tl.int32).to(tl.float32, bitcast=True)


@triton.jit
def _src_vals(x, scale, MANUAL: tl.constexpr):
    """Cache values as the chunk's source values. An fp8 cache (uint8 bits of e4m3, with the
    layer's scale) becomes bf16(fp32(q) * scale), rounded to nearest even
    (kernels/fp8_cache.py); bf16/fp16 caches are their own source values."""
    if x.dtype == tl.uint8:
        return _cvt(x.to(tl.float8e4nv, bitcast=True).to(tl.float32) * scale, tl.bfloat16, MANUAL)
    else:
        return x


@triton.jit
def _fp8_cache_bits(x, scale, MANUAL: tl.constexpr):
    """Source values (fp32) -> e4m3 bits of x / scale, clamped to +-448, as vLLM's fp8 cache
    writer stores them."""
    v = tl.minimum(tl.maximum(tl.div_rn(x, scale), -448.0), 448.0)
    if MANUAL:
        return _e4m3_bits(v)
    else:
        return v.to(tl.float8e4nv).to(tl.uint8, bitcast=True)


@triton.jit
def _wsum_words(words, word_idx):
    """wsum32 contribution (mod 2**32, as int32) of words at body word indices word_idx."""
    prod = words.to(tl.int32) * (word_idx.to(tl.int32) * 2 + 1)
    return tl.sum(tl.reshape(prod, [prod.numel]), axis=0).to(tl.int32)


@triton.jit
def _wsum_rows(words, word_idx):
    """Per-(lane, row) wsum32 contribution of words [L, BT, N] (in-thread sum over N)."""
    return tl.sum(words.to(tl.int32) * (word_idx.to(tl.int32) * 2 + 1), axis=2).to(tl.int32)


@triton.jit
def _lane0(v, L: tl.constexpr):
    """A per-row [BT] value as [L, BT], counted once (on lane 0)."""
    return tl.where(tl.arange(0, L)[:, None] == 0, v[None, :], 0).to(tl.int32)


@triton.jit
def _bits16(x):
    """The 16 raw bits of an fp16/bf16 tensor as int32 in 0..65535."""
    return x.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF


@triton.jit
def _pair_words(h, L: tl.constexpr, BT: tl.constexpr, C: tl.constexpr):
    """Join adjacent 16-bit values h [L, BT, C] (int32) into little-endian words [L, BT, C/2]."""
    a, b = tl.split(tl.reshape(h, [L, BT, C // 2, 2]))
    return a | (b << 16)


@triton.jit
def _quad_words(b8, L: tl.constexpr, BT: tl.constexpr, C: tl.constexpr):
    """Join 4 adjacent bytes b8 [L, BT, C] (int32 0..255) into words [L, BT, C/4]."""
    sh = (tl.arange(0, C) % 4) * 8
    v = b8 << sh[None, None, :]
    return _fold_rows(v, L, BT, C, 2)


@triton.jit
def _load_rows(kv_ptr, row_off, valid, L: tl.constexpr, BT: tl.constexpr, C: tl.constexpr):
    """Load rows [L, BT, C] of the cache: row r of lane l starts at row_off[r] + l*C.

    C == 8 (L = D/8: each lane holds one 16-byte piece): the pointers are laid out [BT, D] and
    the result permuted, so the compiler sees D contiguous elements per row and puts the D/8
    lanes of a row side by side in one warp (coalesced, and the lane butterfly stages stay
    inside the warp). Otherwise each thread loads whole 16-byte pieces of its own lane row: the
    pointers are shaped [L, BT, C/8, 8] (3.6) or [C/8, BT, L, 8] (3.8+) so that the compiler's
    tie order (_rows_first) gives the threads to the lanes, then the rows."""
    if C == 8:
        d = tl.arange(0, L * C)[None, :]
        x = tl.load(kv_ptr + (row_off[:, None] + d), mask=valid[:, None], other=0.0)
        return tl.permute(tl.reshape(x, [BT, L, C]), (1, 0, 2))
    elif ROWS_FIRST:
        ln = tl.arange(0, L)[:, None, None, None]
        a = tl.arange(0, C // 8)[None, None, :, None]
        b = tl.arange(0, 8)[None, None, None, :]
        ptrs = kv_ptr + (row_off[None, :, None, None] + ln * C + a * 8 + b)
        x = tl.load(ptrs, mask=valid[None, :, None, None], other=0.0)
        return tl.reshape(x, [L, BT, C])
    else:
        a = tl.arange(0, C // 8)[:, None, None, None]
        ln = tl.arange(0, L)[None, None, :, None]
        b = tl.arange(0, 8)[None, None, None, :]
        ptrs = kv_ptr + (row_off[None, :, None, None] + ln * C + a * 8 + b)
        x = tl.load(ptrs, mask=valid[None, :, None, None], other=0.0)
        return tl.reshape(tl.permute(x, (2, 1, 0, 3)), [L, BT, C])


@triton.jit
def _store_rows(ptr, row_off, valid, x, L: tl.constexpr, BT: tl.constexpr, C: tl.constexpr):
    """Store rows [L, BT, C] (pointer shapes as in _load_rows)."""
    if C == 8:
        d = tl.arange(0, L * C)[None, :]
        y = tl.reshape(tl.permute(x, (1, 0, 2)), [BT, L * C])
        tl.store(ptr + (row_off[:, None] + d), y, mask=valid[:, None])
    elif ROWS_FIRST:
        ln = tl.arange(0, L)[:, None, None, None]
        a = tl.arange(0, C // 8)[None, None, :, None]
        b = tl.arange(0, 8)[None, None, None, :]
        ptrs = ptr + (row_off[None, :, None, None] + ln * C + a * 8 + b)
        tl.store(ptrs, tl.reshape(x, [L, BT, C // 8, 8]), mask=valid[None, :, None, None])
    else:
        a = tl.arange(0, C // 8)[:, None, None, None]
        ln = tl.arange(0, L)[None, None, :, None]
        b = tl.arange(0, 8)[None, None, None, :]
        ptrs = ptr + (row_off[None, :, None, None] + ln * C + a * 8 + b)
        y = tl.permute(tl.reshape(x, [L, BT, C // 8, 8]), (2, 1, 0, 3))
        tl.store(ptrs, y, mask=valid[None, :, None, None])


@triton.jit
def _tile_rows(kv_ptr, blocks_ptr, blk0, start, T, t0, layer_off, h, stride_blk, stride_tok,
               stride_head, block_size, L: tl.constexpr, BT: tl.constexpr, C: tl.constexpr):
    """Rows t0..t0+BT of head h [L, BT, C] (0 past T). (Loading the next tile before the
    current one is transformed did not help on the H200: bench/RESULTS.md.)"""
    t = t0 + tl.arange(0, BT)
    valid = t < T
    row = _row_offsets(blocks_ptr, blk0, start, t, valid, layer_off, h, stride_blk, stride_tok,
                       stride_head, block_size)
    return _load_rows(kv_ptr, row, valid, L, BT, C)


@triton.jit
def _row_offsets(blocks_ptr, blk0, start, t, valid, layer_off, h, stride_blk, stride_tok,
                 stride_head, block_size):
    """Element offsets of rows t (chunk-relative tokens) of head h, through the block table.
    block_size < 0 stands for a power-of-two block size 2**-block_size (``_block_size_arg``):
    a shift and a mask instead of an integer division (~20 instructions per row)."""
    p = start + t
    if block_size < 0:
        sh = -block_size
        bi = p >> sh
        slot = p & ((1 << sh) - 1)
    else:
        bi = p // block_size
        slot = p % block_size
    blk = tl.load(blocks_ptr + blk0 + bi, mask=valid, other=0).to(tl.int64)
    off = layer_off + blk * stride_blk + slot.to(tl.int64) * stride_tok + h * stride_head
    return tl.multiple_of(off, 8)


# ------------------------------------------------------------------------------------------
# chunk mean (pairwise fold over tokens, binary tree over aligned tiles)
# ------------------------------------------------------------------------------------------
@triton.jit
def _fold_t(x, A1: tl.constexpr, TH: tl.constexpr, A2: tl.constexpr, N: tl.constexpr):
    """Pairwise fold of x [A1, TH, A2, N, 8] over dim 3 (registers) -> [A1, TH, A2, 8]."""
    if N == 1:
        return tl.reshape(x, [A1, TH, A2, 8])
    else:
        return _fold_t(tl.sum(tl.reshape(x, [A1, TH, A2, N // 2, 2, 8]), axis=4), A1, TH, A2,
                       N // 2)


@triton.jit
def _fold_th(x, A1: tl.constexpr, N: tl.constexpr, A2: tl.constexpr):
    """Pairwise fold of x [A1, N, A2, 8] over dim 1 (lanes of one warp) -> [A1, A2, 8]."""
    if N == 1:
        return tl.reshape(x, [A1, A2, 8])
    else:
        return _fold_th(tl.sum(tl.reshape(x, [A1, N // 2, 2, A2, 8]), axis=2), A1, N // 2, A2)


@triton.jit
def _merge(lv, carry, done, bit):
    """One level of the binary counter over tile sums (left subtree + right subtree)."""
    store_here = (done == 0) & (bit == 0)
    merge = (done == 0) & (bit == 1)
    new_lv = tl.where(store_here, carry, lv)
    new_carry = tl.where(merge, lv + carry, carry)
    new_done = done | store_here.to(tl.int32)
    return new_lv, new_carry, new_done


@triton.jit
def _sum_tile(kv_ptr, blocks_ptr, blk0, start, T, t0, layer_off, h, stride_blk, stride_tok,
              stride_head, block_size, BT: tl.constexpr, A1: tl.constexpr, TH: tl.constexpr,
              A2: tl.constexpr, TL_: tl.constexpr):
    """Rows t0..t0+BT of head h as [A1, TH, A2, TL, 8] (the chunk-mean tile layout), 0 past T:
    row t = th*TL + tl, channel (a2*A1 + a1)*8 + k. A warp's lanes take A1 channel pieces x TH
    rows, the warps the A2 pieces, so the token fold never leaves a warp (no shared memory)."""
    t1 = t0 + tl.arange(0, BT)
    v1 = t1 < T
    row1 = _row_offsets(blocks_ptr, blk0, start, t1, v1, layer_off, h, stride_blk, stride_tok,
                        stride_head, block_size)
    b = tl.arange(0, 8)[None, None, None, None, :]
    if ROWS_FIRST:
        a1 = tl.arange(0, A1)[:, None, None, None, None]
        a2 = tl.arange(0, A2)[None, None, :, None, None]
        row = tl.multiple_of(tl.reshape(row1, [1, TH, 1, TL_, 1]), [8, 8, 8, 8, 8])
        valid = tl.reshape(v1, [1, TH, 1, TL_, 1])
        return tl.load(kv_ptr + (row + (a2 * A1 + a1) * 8 + b), mask=valid, other=0.0)
    else:
        # [TL, A2, TH, A1, 8] pointers: the 3.8+ tie order gives the threads to A1, then TH,
        # the warps to A2, as 3.6 does for [A1, TH, A2, TL, 8] (see _rows_first)
        a1 = tl.arange(0, A1)[None, None, None, :, None]
        a2 = tl.arange(0, A2)[None, :, None, None, None]
        rowt = tl.multiple_of(tl.permute(tl.reshape(row1, [1, TH, 1, TL_, 1]), (3, 2, 1, 0, 4)),
                              [8, 8, 8, 8, 8])
        validt = tl.permute(tl.reshape(v1, [1, TH, 1, TL_, 1]), (3, 2, 1, 0, 4))
        x = tl.load(kv_ptr + (rowt + (a2 * A1 + a1) * 8 + b), mask=validt, other=0.0)
        return tl.permute(x, (3, 2, 1, 0, 4))


def sum_tile_rows(head_dim: int, num_warps: int) -> int:
    """Rows one chunk-mean tile spans across lanes: the lanes of a warp not spent on channel
    pieces (_chunk_sum's A1; the host picks tiles at least this tall)."""
    q = head_dim // 8 // num_warps
    return 32 // (4 if q >= 4 else (2 if q >= 2 else 1))


@triton.jit
def _chunk_sum(kv_ptr, blocks_ptr, blk0, start, T, P, layer_off, h, stride_blk, stride_tok,
               stride_head, block_size, D: tl.constexpr, BT: tl.constexpr, LV: tl.constexpr,
               NUM_WARPS: tl.constexpr, sc, MANUAL: tl.constexpr):
    """Per-channel sum of the chunk's T tokens of head h in the reference's order: tokens padded
    with +0 to P = next power of two, adjacent pairs folded. Tiles of BT aligned rows are exact
    subtrees; a binary counter (LV levels) folds the tile sums. The tile is laid out with tokens
    t = th*TL + tl, the low token bits in registers (cheap first fold levels), the next ones
    across TH lanes of a warp (shuffles) and the channels across the other lanes and the warps
    (see _sum_tile; the counter keeps [A1, A2, 8]). Returns [D/8, 8] fp32."""
    A: tl.constexpr = D // 8
    # lanes per warp along the channel pieces: 4 (8 rows per warp), fewer when the warps would
    # run out of pieces (sum_tile_rows mirrors this on the host)
    A1: tl.constexpr = 4 if A // NUM_WARPS >= 4 else (2 if A // NUM_WARPS >= 2 else 1)
    A2: tl.constexpr = A // A1
    TH: tl.constexpr = 32 // A1
    TL_: tl.constexpr = BT // TH
    b = tl.arange(0, 8)[None, None, None, None, :]
    lv0 = tl.zeros([A1, A2, 8], tl.float32)
    lv1 = tl.zeros([A1, A2, 8], tl.float32)
    lv2 = tl.zeros([A1, A2, 8], tl.float32)
    lv3 = tl.zeros([A1, A2, 8], tl.float32)
    lv4 = tl.zeros([A1, A2, 8], tl.float32)
    lv5 = tl.zeros([A1, A2, 8], tl.float32)
    lv6 = tl.zeros([A1, A2, 8], tl.float32)
    lv7 = tl.zeros([A1, A2, 8], tl.float32)
    lv8 = tl.zeros([A1, A2, 8], tl.float32)
    lv9 = tl.zeros([A1, A2, 8], tl.float32)
    lv10 = tl.zeros([A1, A2, 8], tl.float32)
    lv11 = tl.zeros([A1, A2, 8], tl.float32)
    lv12 = tl.zeros([A1, A2, 8], tl.float32)
    lv13 = tl.zeros([A1, A2, 8], tl.float32)
    carry = tl.zeros([A1, A2, 8], tl.float32)
    n_tiles = tl.maximum(P // BT, 1)
    for i in range(0, n_tiles):
        t = tl.reshape(i * BT + tl.arange(0, BT), [1, TH, 1, TL_, 1])
        m = (t < T) & (b < 8)
        x = _src_vals(_sum_tile(kv_ptr, blocks_ptr, blk0, start, T, i * BT, layer_off, h,
                                stride_blk, stride_tok, stride_head, block_size, BT, A1, TH, A2,
                                TL_),
                      sc, MANUAL).to(tl.float32)
        # rows in [T, P) are the reference's +0 padding; rows past P (P < BT) must not change
        # any sum, so they are -0 (x + -0 == x for every x, +0 included)
        pad = tl.where(t < P, 0.0, -0.0)
        x = tl.where(m, x, pad)
        s = _fold_th(_fold_t(x, A1, TH, A2, TL_), A1, TH, A2)
        carry = s
        done = tl.full([], 0, tl.int32)
        if LV > 0:
            lv0, carry, done = _merge(lv0, carry, done, (i >> 0) & 1)
        if LV > 1:
            lv1, carry, done = _merge(lv1, carry, done, (i >> 1) & 1)
        if LV > 2:
            lv2, carry, done = _merge(lv2, carry, done, (i >> 2) & 1)
        if LV > 3:
            lv3, carry, done = _merge(lv3, carry, done, (i >> 3) & 1)
        if LV > 4:
            lv4, carry, done = _merge(lv4, carry, done, (i >> 4) & 1)
        if LV > 5:
            lv5, carry, done = _merge(lv5, carry, done, (i >> 5) & 1)
        if LV > 6:
            lv6, carry, done = _merge(lv6, carry, done, (i >> 6) & 1)
        if LV > 7:
            lv7, carry, done = _merge(lv7, carry, done, (i >> 7) & 1)
        if LV > 8:
            lv8, carry, done = _merge(lv8, carry, done, (i >> 8) & 1)
        if LV > 9:
            lv9, carry, done = _merge(lv9, carry, done, (i >> 9) & 1)
        if LV > 10:
            lv10, carry, done = _merge(lv10, carry, done, (i >> 10) & 1)
        if LV > 11:
            lv11, carry, done = _merge(lv11, carry, done, (i >> 11) & 1)
        if LV > 12:
            lv12, carry, done = _merge(lv12, carry, done, (i >> 12) & 1)
        if LV > 13:
            lv13, carry, done = _merge(lv13, carry, done, (i >> 13) & 1)
    return tl.reshape(tl.permute(carry, (1, 0, 2)), [A, 8])


# ------------------------------------------------------------------------------------------
# encode
# ------------------------------------------------------------------------------------------
@triton.jit
def _store_words(base, row_byte, valid, w, LO: tl.constexpr, HI: tl.constexpr,
                 L: tl.constexpr, BT: tl.constexpr, NWR: tl.constexpr):
    """Store words w [L, BT, NWR] (word j of lane l is word l*NWR + j of the row) at
    base + row_byte[r] + 4*(word - LO) for words in [LO, HI). The [L, BT, NWR/4, 4] pointer
    shape ([NWR/4, BT, L, 4] on 3.8+, see _load_rows) keeps each row's words in its own thread
    as 16-byte vector stores."""
    if NWR >= 4:
        if ROWS_FIRST:
            ln = tl.arange(0, L)[:, None, None, None]
            q = tl.arange(0, NWR // 4)[None, None, :, None]
            r = tl.arange(0, 4)[None, None, None, :]
            m = ln * NWR + q * 4 + r
            ok = valid[None, :, None, None] & (m >= LO) & (m < HI)
            p32 = (base + row_byte[None, :, None, None]).to(tl.pointer_type(tl.int32))
            tl.store(p32 + (m - LO), tl.reshape(w, [L, BT, NWR // 4, 4]), mask=ok)
        else:
            q = tl.arange(0, NWR // 4)[:, None, None, None]
            ln = tl.arange(0, L)[None, None, :, None]
            r = tl.arange(0, 4)[None, None, None, :]
            m = ln * NWR + q * 4 + r
            ok = valid[None, :, None, None] & (m >= LO) & (m < HI)
            p32 = (base + row_byte[None, :, None, None]).to(tl.pointer_type(tl.int32))
            wt = tl.permute(tl.reshape(w, [L, BT, NWR // 4, 4]), (2, 1, 0, 3))
            tl.store(p32 + (m - LO), wt, mask=ok)
    else:
        if ROWS_FIRST:
            m3 = tl.arange(0, L)[:, None, None] * NWR + tl.arange(0, NWR)[None, None, :]
            ok3 = valid[None, :, None] & (m3 >= LO) & (m3 < HI)
            p32 = (base + row_byte[None, :, None]).to(tl.pointer_type(tl.int32))
            tl.store(p32 + (m3 - LO), w, mask=ok3)
        else:
            m3 = tl.arange(0, NWR)[:, None, None] + tl.arange(0, L)[None, None, :] * NWR
            ok3 = valid[None, :, None] & (m3 >= LO) & (m3 < HI)
            p32 = (base + row_byte[None, :, None]).to(tl.pointer_type(tl.int32))
            tl.store(p32 + (m3 - LO), tl.permute(w, (2, 1, 0)), mask=ok3)


@triton.jit
def _pack_store(code, out_ptr, row_byte, valid, G0: tl.constexpr, NG: tl.constexpr,
                SHIFT: tl.constexpr, W: tl.constexpr, POFF: tl.constexpr, WORDS: tl.constexpr,
                L: tl.constexpr, BT: tl.constexpr, C: tl.constexpr):
    """Pack one bit plane (width W, code bits SHIFT.., coordinates G0..G0+NG) of code [L, BT, C]
    into its bytes at out_ptr + row_byte[r] + POFF (row_byte: byte offset of the row in the
    body, out_ptr: the body); returns the plane's wsum32 contribution per (lane, row).
    WORDS: whole little-endian words (32/W codes each), else single bytes (8/W codes)."""
    d = tl.arange(0, L)[:, None, None] * C + tl.arange(0, C)[None, None, :]
    ing = (d >= G0) & (d < G0 + NG)
    pv = (code >> SHIFT) & ((1 << W) - 1)
    FITS: tl.constexpr = C >= 32 // W  # a lane holds whole words of this plane
    if WORDS and FITS:
        PER: tl.constexpr = 32 // W
        LOGP: tl.constexpr = PER.bit_length() - 1
        NWR: tl.constexpr = C // PER
        if NG == L * C:
            v = pv << ((d % PER) * W)
        else:
            v = tl.where(ing, pv << ((d % PER) * W), 0)
        w = _fold_rows(v, L, BT, C, LOGP)  # [L, BT, NWR]
        _store_words(out_ptr + POFF, row_byte, valid, w, G0 // PER, (G0 + NG) // PER, L, BT, NWR)
        m = tl.arange(0, L)[:, None, None] * NWR + tl.arange(0, NWR)[None, None, :]
        ok = valid[None, :, None] & (m >= G0 // PER) & (m < (G0 + NG) // PER)
        wi = (row_byte[None, :, None] + POFF) // 4 + (m - G0 // PER)
        return _wsum_rows(tl.where(ok, w, 0), wi)
    else:
        PER: tl.constexpr = 8 // W
        LOGP: tl.constexpr = PER.bit_length() - 1
        v = tl.where(ing, pv << ((d % PER) * W), 0)
        w = _fold_rows(v, L, BT, C, LOGP)  # [L, BT, C/PER] byte values
        m = tl.arange(0, L)[:, None, None] * (C // PER) + tl.arange(0, C // PER)[None, None, :]
        ok = valid[None, :, None] & (m >= G0 // PER) & (m < (G0 + NG) // PER)
        bidx = m - G0 // PER
        tl.store(out_ptr + row_byte[None, :, None] + POFF + bidx, w.to(tl.uint8), mask=ok)
        pos = row_byte[None, :, None] + POFF + bidx
        wv = tl.where(ok, w << ((pos % 4) * 8).to(tl.int32), 0)
        return _wsum_rows(wv, pos // 4)


@triton.jit
def _pack_group(code, out_ptr, row_byte, valid, G0: tl.constexpr, NG: tl.constexpr,
                B: tl.constexpr, POFF: tl.constexpr, WORDS: tl.constexpr, L: tl.constexpr,
                BT: tl.constexpr, C: tl.constexpr):
    """Bit planes 4/2/1 from the least significant bit (packing.py), planes back to back."""
    if B == 1:
        cs = _pack_store(code, out_ptr, row_byte, valid, G0, NG, 0, 1, POFF, WORDS, L, BT, C)
    elif B == 2:
        cs = _pack_store(code, out_ptr, row_byte, valid, G0, NG, 0, 2, POFF, WORDS, L, BT, C)
    elif B == 3:
        cs = _pack_store(code, out_ptr, row_byte, valid, G0, NG, 0, 2, POFF, WORDS, L, BT, C)
        cs += _pack_store(code, out_ptr, row_byte, valid, G0, NG, 2, 1, POFF + NG // 4, WORDS,
                          L, BT, C)
    elif B == 4:
        cs = _pack_store(code, out_ptr, row_byte, valid, G0, NG, 0, 4, POFF, WORDS, L, BT, C)
    elif B == 5:
        cs = _pack_store(code, out_ptr, row_byte, valid, G0, NG, 0, 4, POFF, WORDS, L, BT, C)
        cs += _pack_store(code, out_ptr, row_byte, valid, G0, NG, 4, 1, POFF + NG // 2, WORDS,
                          L, BT, C)
    elif B == 6:
        cs = _pack_store(code, out_ptr, row_byte, valid, G0, NG, 0, 4, POFF, WORDS, L, BT, C)
        cs += _pack_store(code, out_ptr, row_byte, valid, G0, NG, 4, 2, POFF + NG // 2, WORDS,
                          L, BT, C)
    else:
        cs = _pack_store(code, out_ptr, row_byte, valid, G0, NG, 0, 4, POFF, WORDS, L, BT, C)
        cs += _pack_store(code, out_ptr, row_byte, valid, G0, NG, 4, 2, POFF + NG // 2, WORDS,
                          L, BT, C)
        cs += _pack_store(code, out_ptr, row_byte, valid, G0, NG, 6, 1, POFF + NG // 2 + NG // 4,
                          WORDS, L, BT, C)
    return cs


@triton.jit
def _enc_raw(kv_ptr, out_ptr, blocks_ptr, blk0, start, T, layer_off, h, H, body0, s_off,
             stride_blk, stride_tok, stride_head, block_size, D: tl.constexpr, L: tl.constexpr,
             BT: tl.constexpr, sc, MANUAL: tl.constexpr):
    C: tl.constexpr = D // L
    cs = tl.zeros([L, BT], tl.int32)
    wcol = tl.arange(0, L)[:, None, None] * (C // 2) + tl.arange(0, C // 2)[None, None, :]
    for t0 in range(0, T, BT):
        t = t0 + tl.arange(0, BT)
        valid = t < T
        x = _src_vals(_tile_rows(kv_ptr, blocks_ptr, blk0, start, T, t0, layer_off, h,
                                 stride_blk, stride_tok, stride_head, block_size, L, BT, C),
                      sc, MANUAL)
        rb = s_off + (t.to(tl.int64) * H + h) * (D * 2)  # body byte offset of each row
        dst = (out_ptr + body0).to(tl.pointer_type(x.dtype))
        _store_rows(dst, rb // 2, valid, x, L, BT, C)
        words = _pair_words(_bits16(x), L, BT, C)
        cs += _wsum_rows(tl.where(valid[None, :, None], words, 0), rb[None, :, None] // 4 + wcol)
    return tl.sum(tl.reshape(cs, [L * BT]), axis=0).to(tl.int32)


@triton.jit
def _enc_fp8(kv_ptr, out_ptr, blocks_ptr, blk0, start, T, layer_off, h, H, body0, s_off,
             stride_blk, stride_tok, stride_head, block_size, D: tl.constexpr, L: tl.constexpr,
             BT: tl.constexpr, FP8_MANUAL: tl.constexpr, sc):
    C: tl.constexpr = D // L
    scales_off = s_off
    codes_off = tl.multiple_of(s_off + _align16(T * H * 2), 16)
    cs = tl.zeros([L, BT], tl.int32)
    wcol = tl.arange(0, L)[:, None, None] * (C // 4) + tl.arange(0, C // 4)[None, None, :]
    for t0 in range(0, T, BT):
        t = t0 + tl.arange(0, BT)
        valid = t < T
        row = _row_offsets(blocks_ptr, blk0, start, t, valid, layer_off, h, stride_blk, stride_tok,
                           stride_head, block_size)
        x = _src_vals(_load_rows(kv_ptr, row, valid, L, BT, C), sc, FP8_MANUAL).to(tl.float32)
        amax = tl.max(tl.max(tl.abs(x), axis=2), axis=0)  # [BT]
        scale = tl.minimum(tl.div_rn(amax, 448.0), 65504.0).to(tl.float16)
        s32 = scale.to(tl.float32)
        inv = tl.where(s32 > 0, tl.div_rn(tl.full([BT], 1.0, tl.float32), s32), 0.0)
        v = tl.minimum(tl.maximum(x * inv[None, :, None], -448.0), 448.0)
        if FP8_MANUAL:
            q = _e4m3_bits(v)
        else:
            q = v.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
        ri = t.to(tl.int64) * H + h
        # scales [T, H] fp16
        sp = (out_ptr + body0 + scales_off).to(tl.pointer_type(tl.float16))
        tl.store(sp + ri, scale, mask=valid)
        sb = scales_off + ri * 2
        sw = tl.where(valid, _bits16(scale) << ((sb % 4) * 8).to(tl.int32), 0)
        cs += _lane0(sw * ((sb // 4).to(tl.int32) * 2 + 1), L)
        # codes [T, H, D] bytes
        cb = codes_off + ri * D
        _store_rows(out_ptr + body0, cb, valid, q, L, BT, C)
        words = _quad_words(q.to(tl.int32), L, BT, C)
        cs += _wsum_rows(tl.where(valid[None, :, None], words, 0), cb[None, :, None] // 4 + wcol)
    # zero the padding after the scales (written once per stream, by head 0)
    if h == 0:
        e = scales_off + T * H * 2
        z = e + tl.arange(0, 16)
        tl.store(out_ptr + body0 + z, tl.zeros([16], tl.uint8), mask=z < _align16(e))
    return tl.sum(tl.reshape(cs, [L * BT]), axis=0).to(tl.int32)


@triton.jit
def _enc_lloyd(kv_ptr, out_ptr, tab_ptr, blocks_ptr, blk0, start, T, P, layer_off, h, H, body0,
               s_off, stride_blk, stride_tok, stride_head, block_size, D: tl.constexpr,
               L: tl.constexpr, BT: tl.constexpr, SBT: tl.constexpr, LV: tl.constexpr,
               BITS: tl.constexpr,
               CENTER: tl.constexpr, SINK: tl.constexpr, NHI: tl.constexpr, WORDS: tl.constexpr,
               QMODE: tl.constexpr, SQRT_D: tl.constexpr, S1M: tl.constexpr, S2M: tl.constexpr,
               NUM_WARPS: tl.constexpr, sc, MANUAL: tl.constexpr):
    C: tl.constexpr = D // L
    LOGC: tl.constexpr = C.bit_length() - 1
    R: tl.constexpr = (NHI * (BITS + 1) + (D - NHI) * BITS) // 8
    S = tl.where(start == 0, tl.minimum(T, SINK), 0)
    off = s_off
    mean_off = off
    if CENTER:
        off += H * D * 2
    sink_off = off
    off += S * H * D * 2
    codes_off = tl.multiple_of(off, 16)
    scales_off = tl.multiple_of(_align16(off + T * H * R), 16)
    cs = tl.zeros([L, BT], tl.int32)
    cs0 = tl.full([], 0, tl.int32)
    dcol = tl.arange(0, L)[:, None, None] * C + tl.arange(0, C)[None, None, :]  # [L, 1, C]
    wcol = tl.arange(0, L)[:, None, None] * (C // 2) + tl.arange(0, C // 2)[None, None, :]
    zrow = tl.zeros([BT], tl.int64)
    mp = (out_ptr + body0 + mean_off).to(tl.pointer_type(tl.float16)) + h * D
    if CENTER:
        tot = _chunk_sum(kv_ptr, blocks_ptr, blk0, start, T, P, layer_off, h, stride_blk,
                         stride_tok, stride_head, block_size, D, SBT, LV, NUM_WARPS, sc, MANUAL)
        mean16 = tl.div_rn(tot, T.to(tl.float32)).to(tl.float16)  # [D/8, 8]
        md = tl.arange(0, D // 8)[:, None] * 8 + tl.arange(0, 8)[None, :]
        tl.store(mp + md, mean16)
        ma, mb = tl.split(tl.reshape(_bits16(mean16), [D // 8, 4, 2]))
        mwi = ((mean_off + h * D * 2) // 4 + tl.arange(0, D // 8)[:, None] * 4
               + tl.arange(0, 4)[None, :])
        cs0 += _wsum_words(ma | (mb << 16), mwi)
        # the tiles re-read the mean from the staging buffer in their own (row) layout
        tl.debug_barrier()
    for t0 in range(0, T, BT):
        t = t0 + tl.arange(0, BT)
        valid = t < T
        x16 = _src_vals(_tile_rows(kv_ptr, blocks_ptr, blk0, start, T, t0, layer_off, h,
                                   stride_blk, stride_tok, stride_head, block_size, L, BT, C),
                        sc, MANUAL)
        ri = t.to(tl.int64) * H + h
        if SINK > 0:
            if t0 < S:
                sv = valid & (t < S)
                sb = sink_off + ri * (D * 2)
                dst = (out_ptr + body0).to(tl.pointer_type(x16.dtype))
                _store_rows(dst, sb // 2, sv, x16, L, BT, C)
                words = _pair_words(_bits16(x16), L, BT, C)
                cs += _wsum_rows(tl.where(sv[None, :, None], words, 0),
                                 sb[None, :, None] // 4 + wcol)
        x = x16.to(tl.float32)
        if CENTER:
            x = x - _load_rows(mp, zrow, valid, L, BT, C).to(tl.float32)
        n2 = _row_norm2(x * x, L, BT, C, LOGC)
        u = _rotate(x, S1M, S2M, L, BT, C)
        norm = tl.sqrt_rn(n2)
        inv = tl.where(norm > 0, tl.div_rn(tl.full([BT], 1.0, tl.float32), norm), 0.0)
        v = u * inv[None, :, None]
        LO: tl.constexpr = 2 * D + 3 * ((1 << BITS) - 2)
        if QMODE == 2:
            code, sq = _quantize_lut(v, tab_ptr, BITS, D, L, BT, C)
            if NHI > 0:
                code_hi, sq_hi = _quantize_lut(v, tab_ptr, BITS + 1, D, L, BT, C)
                ishi = dcol < NHI
                code = tl.where(ishi, code_hi, code)
                sq = tl.where(ishi, sq_hi, sq)
        elif NHI > 0:
            code = _quantize(v, tab_ptr, LO, BITS, QMODE, L, BT, C)
            HI: tl.constexpr = 2 * D + 3 * ((1 << (BITS + 1)) - 2)
            code_hi = _quantize(v, tab_ptr, HI, BITS + 1, QMODE, L, BT, C)
            ishi = dcol < NHI
            code = tl.where(ishi, code_hi, code)
            sq = tl.where(ishi,
                          _gather_rows(tab_ptr + (HI + 2 * (1 << (BITS + 1))), code, L, BT, C),
                          _gather_rows(tab_ptr + (LO + 2 * (1 << BITS)), code, L, BT, C))
        else:
            code = _quantize(v, tab_ptr, LO, BITS, QMODE, L, BT, C)
            sq = _gather_rows(tab_ptr + (LO + 2 * (1 << BITS)), code, L, BT, C)
        cn = tl.sqrt_rn(_row_norm2(sq, L, BT, C, LOGC))
        scale = tl.minimum(tl.div_rn(norm, SQRT_D * cn), 65504.0).to(tl.float16)
        # codes [T, H, R]
        cb = codes_off + ri * R
        if NHI > 0:
            cs += _pack_group(code, out_ptr + body0, cb, valid, 0, NHI, BITS + 1, 0, WORDS,
                              L, BT, C)
            cs += _pack_group(code, out_ptr + body0, cb, valid, NHI, D - NHI, BITS,
                              NHI * (BITS + 1) // 8, WORDS, L, BT, C)
        else:
            cs += _pack_group(code, out_ptr + body0, cb, valid, 0, D, BITS, 0, WORDS, L, BT, C)
        # scales [T, H] fp16
        sp = (out_ptr + body0 + scales_off).to(tl.pointer_type(tl.float16))
        tl.store(sp + ri, scale, mask=valid)
        sb = scales_off + ri * 2
        sw = tl.where(valid, _bits16(scale) << ((sb % 4) * 8).to(tl.int32), 0)
        cs += _lane0(sw * ((sb // 4).to(tl.int32) * 2 + 1), L)
    if h == 0:
        z = tl.arange(0, 16)
        e1 = codes_off + T * H * R
        tl.store(out_ptr + body0 + e1 + z, tl.zeros([16], tl.uint8), mask=e1 + z < scales_off)
        e2 = scales_off + T * H * 2
        tl.store(out_ptr + body0 + e2 + z, tl.zeros([16], tl.uint8), mask=e2 + z < _align16(e2))
    return cs0 + tl.sum(tl.reshape(cs, [L * BT]), axis=0).to(tl.int32)


@triton.jit
def _enc_stream(kv_ptr, out_ptr, tab_ptr, blocks_ptr, blk0, start, T, P, layer_off, h, H, body0,
                s_off, stride_blk, stride_tok, stride_head, block_size, D: tl.constexpr,
                L: tl.constexpr, BT: tl.constexpr, SBT: tl.constexpr, LV: tl.constexpr,
                KIND: tl.constexpr,
                BITS: tl.constexpr, CENTER: tl.constexpr, SINK: tl.constexpr, NHI: tl.constexpr,
                WORDS: tl.constexpr, QMODE: tl.constexpr, FP8_MANUAL: tl.constexpr,
                SQRT_D: tl.constexpr, S1M: tl.constexpr, S2M: tl.constexpr,
                NUM_WARPS: tl.constexpr, sc):
    if KIND == 0:
        return _enc_raw(kv_ptr, out_ptr, blocks_ptr, blk0, start, T, layer_off, h, H, body0, s_off,
                        stride_blk, stride_tok, stride_head, block_size, D, L, BT, sc, FP8_MANUAL)
    elif KIND == 1:
        return _enc_fp8(kv_ptr, out_ptr, blocks_ptr, blk0, start, T, layer_off, h, H, body0, s_off,
                        stride_blk, stride_tok, stride_head, block_size, D, L, BT, FP8_MANUAL, sc)
    else:
        return _enc_lloyd(kv_ptr, out_ptr, tab_ptr, blocks_ptr, blk0, start, T, P, layer_off, h, H,
                          body0, s_off, stride_blk, stride_tok, stride_head, block_size, D, L, BT,
                          SBT, LV, BITS, CENTER, SINK, NHI, WORDS, QMODE, SQRT_D, S1M, S2M,
                          NUM_WARPS, sc, FP8_MANUAL)


@triton.jit
def _write_header(out_ptr, out_off, preset_id, layer, num_layers, H, D: tl.constexpr, dtype_code,
                  T, start, body, tag_lo, tag_hi, body_sum):
    """The 48-byte chunk header (wire.py) with its wsum32 over bytes 0..43."""
    i = tl.arange(0, 16)
    flags = tl.where(start == 0, 1, 0)
    w = tl.where(i == 0, MAGIC_WORD, 0)
    w = tl.where(i == 1, 1 | (3 << 8) | (preset_id << 16), w)
    w = tl.where(i == 2, layer | (num_layers << 16), w)
    w = tl.where(i == 3, H | (D << 16), w)
    w = tl.where(i == 4, dtype_code | (flags << 8), w)
    w = tl.where(i == 5, T, w)
    w = tl.where(i == 6, start, w)
    w = tl.where(i == 7, body, w)
    w = tl.where(i == 8, tag_lo, w)
    w = tl.where(i == 9, tag_hi, w)
    w = tl.where(i == 10, body_sum, w)
    hsum = tl.sum(tl.where(i < 11, w * (2 * i + 1), 0), axis=0)
    w = tl.where(i == 11, hsum, w)
    p32 = (out_ptr + out_off).to(tl.pointer_type(tl.int32))
    tl.store(p32 + i, w, mask=i < 12)


# runtime ints that vary between models must not select a separately compiled kernel
_RUNTIME_INTS = ["block_size", "H", "preset_id", "num_layers", "dtype_code", "n_items"]


@triton.jit
def _enc_item(kv_ptr, out_ptr, items_ptr, blocks_ptr, tab_ptr, acc_ptr, item, s, h,
              stride_blk, stride_tok, stride_head, block_size, H, preset_id, num_layers,
              dtype_code, D: tl.constexpr, L: tl.constexpr, BT: tl.constexpr, SBT: tl.constexpr,
              LV: tl.constexpr, K_KIND: tl.constexpr, K_BITS: tl.constexpr,
              K_CENTER: tl.constexpr, K_SINK: tl.constexpr, K_NHI: tl.constexpr,
              K_WORDS: tl.constexpr, V_KIND: tl.constexpr, V_BITS: tl.constexpr,
              V_CENTER: tl.constexpr, V_SINK: tl.constexpr, V_NHI: tl.constexpr,
              V_WORDS: tl.constexpr, QMODE: tl.constexpr, FP8_MANUAL: tl.constexpr,
              SQRT_D: tl.constexpr, S1M: tl.constexpr, S2M: tl.constexpr, NUM_WARPS: tl.constexpr):
    """Stream s, head h of chunk ``item``; the chunk's last program writes its header."""
    ip = items_ptr + item * E_FIELDS
    start = tl.load(ip + E_START).to(tl.int32)
    T = tl.load(ip + E_T).to(tl.int32)
    P = tl.load(ip + E_P).to(tl.int32)
    out_off = tl.multiple_of(tl.load(ip + E_OUT), 16)
    blk0 = tl.load(ip + E_BLK)
    body0 = out_off + 48
    if s == 0:
        layer_off = tl.multiple_of(tl.load(ip + E_KOFF), 16)
        cs = _enc_stream(kv_ptr, out_ptr, tab_ptr, blocks_ptr, blk0, start, T, P, layer_off, h, H,
                         body0, 0, stride_blk, stride_tok, stride_head, block_size, D, L, BT, SBT,
                         LV, K_KIND, K_BITS, K_CENTER, K_SINK, K_NHI, K_WORDS, QMODE, FP8_MANUAL,
                         SQRT_D, S1M, S2M, NUM_WARPS, _scale_at(ip, E_KSCALE))
    else:
        layer_off = tl.multiple_of(tl.load(ip + E_VOFF), 16)
        s_off = tl.multiple_of(tl.load(ip + E_KBYTES), 16)
        cs = _enc_stream(kv_ptr, out_ptr, tab_ptr, blocks_ptr, blk0, start, T, P, layer_off, h, H,
                         body0, s_off, stride_blk, stride_tok, stride_head, block_size, D, L, BT,
                         SBT, LV, V_KIND, V_BITS, V_CENTER, V_SINK, V_NHI, V_WORDS, QMODE,
                         FP8_MANUAL, SQRT_D, S1M, S2M, NUM_WARPS, _scale_at(ip, E_VSCALE))
    tl.atomic_add(acc_ptr + item * 2, cs, sem="relaxed")
    done = tl.atomic_add(acc_ptr + item * 2 + 1, 1, sem="acq_rel")
    if done == 2 * H - 1:
        body_sum = tl.atomic_xchg(acc_ptr + item * 2, 0, sem="acq_rel")
        tl.atomic_xchg(acc_ptr + item * 2 + 1, 0, sem="relaxed")
        _write_header(out_ptr, out_off, preset_id, tl.load(ip + E_LAYER).to(tl.int32), num_layers,
                      H, D, dtype_code, T, start, tl.load(ip + E_BODY).to(tl.int32),
                      tl.load(ip + E_TAGLO).to(tl.int32), tl.load(ip + E_TAGHI).to(tl.int32),
                      body_sum)


@triton.jit(do_not_specialize=_RUNTIME_INTS)
def encode_kernel(
    kv_ptr, out_ptr, items_ptr, blocks_ptr, tab_ptr, acc_ptr,
    stride_blk, stride_tok, stride_head, block_size, H, preset_id, num_layers, dtype_code, n_items,
    D: tl.constexpr, L: tl.constexpr, BT: tl.constexpr, SBT: tl.constexpr, LV: tl.constexpr,
    K_KIND: tl.constexpr, K_BITS: tl.constexpr, K_CENTER: tl.constexpr, K_SINK: tl.constexpr,
    K_NHI: tl.constexpr, K_WORDS: tl.constexpr,
    V_KIND: tl.constexpr, V_BITS: tl.constexpr, V_CENTER: tl.constexpr, V_SINK: tl.constexpr,
    V_NHI: tl.constexpr, V_WORDS: tl.constexpr,
    QMODE: tl.constexpr, FP8_MANUAL: tl.constexpr, SQRT_D: tl.constexpr, S1M: tl.constexpr,
    S2M: tl.constexpr, NUM_WARPS: tl.constexpr, SMAJOR: tl.constexpr,
):
    """Grid: items x 2 streams x H heads; a program codes one (stream, head) of one item (chunk),
    written at its staging offset. SMAJOR: every K program before every V program, so the
    programs an SM runs at once mostly run one stream's code (a K and a V program share no
    instructions: interleaved, block-sized chunks spent a third of their cycles on instruction
    fetch); else a chunk's K and V heads side by side."""
    pid = tl.program_id(0)
    h = pid % H
    if SMAJOR:
        s = pid // (n_items * H)
        item = (pid % (n_items * H)) // H
    else:
        s = (pid // H) % 2
        item = pid // (2 * H)
    _enc_item(kv_ptr, out_ptr, items_ptr, blocks_ptr, tab_ptr, acc_ptr, item, s, h,
              stride_blk, stride_tok, stride_head, block_size, H, preset_id, num_layers,
              dtype_code, D, L, BT, SBT, LV, K_KIND, K_BITS, K_CENTER, K_SINK, K_NHI, K_WORDS,
              V_KIND, V_BITS, V_CENTER, V_SINK, V_NHI, V_WORDS, QMODE, FP8_MANUAL, SQRT_D,
              S1M, S2M, NUM_WARPS)


# ------------------------------------------------------------------------------------------
# verify (fused into the decode kernel: each program checks the chunk it decodes)
# ------------------------------------------------------------------------------------------
@triton.jit
def _verify_chunk(src_ptr, ip, in_off, H, preset_id, num_layers, D: tl.constexpr,
                  BLOCKW: tl.constexpr):
    """Status bits of one chunk (0: valid), the checks of the reference decoder (wire.py
    ``parse_header`` / ``verify_body``, ``Codec.check_compatible``): magic, version, header
    checksum, format fields, the geometry, layer, token range and tag the item expects, the body
    length the codec gives, the bytes handed over, and the body's wsum32 (over the body the
    header announces, within those bytes), summed BLOCKW words at a time."""
    p32 = (src_ptr + in_off).to(tl.pointer_type(tl.int32))
    nw = _checked_words(p32, ip)
    acc = tl.zeros([BLOCKW], tl.int32)  # per-lane wsum32 terms, mod 2**32
    for wb in range(0, nw, BLOCKW):
        wi = wb + tl.arange(0, BLOCKW)
        w = tl.load(p32 + 12 + wi, mask=wi < nw, other=0)
        acc += w * (wi.to(tl.int32) * 2 + 1)
    total = tl.sum(acc, axis=0).to(tl.int32)
    return _header_status(p32, ip, total, H, preset_id, num_layers, D)


@triton.jit
def _checked_words(p32, ip):
    """Words of body the checksum covers: the body the header announces, within the bytes the
    caller handed over."""
    hbody = tl.load(p32 + 7).to(tl.int64) & 0xFFFFFFFF
    return tl.minimum(hbody, tl.load(ip + D_NBYTES) - 48) // 4


@triton.jit
def _header_status(p32, ip, total, H, preset_id, num_layers, D: tl.constexpr):
    """The header's checks given the body's wsum32 ``total`` (see ``_verify_chunk``)."""
    nbytes = tl.load(ip + D_NBYTES)
    exp_body = tl.load(ip + D_BODY)
    hw = tl.arange(0, 16)
    hdr = tl.load(p32 + hw, mask=hw < 12, other=0)
    hbody = tl.sum(tl.where(hw == 7, hdr, 0), axis=0).to(tl.int64) & 0xFFFFFFFF
    w0 = tl.sum(tl.where(hw == 0, hdr, 0), axis=0)
    w1 = tl.sum(tl.where(hw == 1, hdr, 0), axis=0)
    w2 = tl.sum(tl.where(hw == 2, hdr, 0), axis=0)
    w3 = tl.sum(tl.where(hw == 3, hdr, 0), axis=0)
    w4 = tl.sum(tl.where(hw == 4, hdr, 0), axis=0)
    w5 = tl.sum(tl.where(hw == 5, hdr, 0), axis=0)
    w6 = tl.sum(tl.where(hw == 6, hdr, 0), axis=0)
    w8 = tl.sum(tl.where(hw == 8, hdr, 0), axis=0)
    w9 = tl.sum(tl.where(hw == 9, hdr, 0), axis=0)
    w10 = tl.sum(tl.where(hw == 10, hdr, 0), axis=0)
    w11 = tl.sum(tl.where(hw == 11, hdr, 0), axis=0)
    hsum = tl.sum(tl.where(hw < 11, hdr * (2 * hw + 1), 0), axis=0)
    st = tl.zeros([1], tl.int32)
    version = w1 & 0xFF
    hunits = (w1 >> 8) & 0xFF
    preset = (w1 >> 16) & 0xFFFF
    layer = w2 & 0xFFFF
    nlayers = (w2 >> 16) & 0xFFFF
    heads = w3 & 0xFFFF
    hdim = (w3 >> 16) & 0xFFFF
    dcode = w4 & 0xFF
    flags = (w4 >> 8) & 0xFF
    reserved = (w4 >> 16) & 0xFFFF
    st |= tl.where(w0 != MAGIC_WORD, 1, 0)
    st |= tl.where(version != 1, 1, 0)
    st |= tl.where(hsum != w11, 2, 0)
    st |= tl.where((hunits != 3) | (reserved != 0), 1, 0)
    st |= tl.where((dcode != 1) & (dcode != 2), 1, 0)
    st |= tl.where(((flags & 1) == 1) != (w6 == 0), 1, 0)
    st |= tl.where((flags & 0xFE) != 0, 1, 0)
    st |= tl.where((hbody % 16) != 0, 1, 0)
    st |= tl.where((layer >= nlayers) | (heads == 0) | (hdim == 0) | (w5 == 0), 1, 0)
    st |= tl.where(preset != preset_id, 4, 0)
    st |= tl.where(layer != tl.load(ip + D_LAYER).to(tl.int32), 4, 0)
    st |= tl.where(nlayers != num_layers, 4, 0)
    st |= tl.where(hdim != D, 4, 0)
    st |= tl.where(heads != H, 4, 0)
    st |= tl.where(w5 != tl.load(ip + D_T).to(tl.int32), 4, 0)
    st |= tl.where(w6 != tl.load(ip + D_START).to(tl.int32), 4, 0)
    has_tag = tl.load(ip + D_HASTAG) != 0
    tag_bad = ((w8 != tl.load(ip + D_TAGLO).to(tl.int32))
               | (w9 != tl.load(ip + D_TAGHI).to(tl.int32)))
    st |= tl.where(has_tag & tag_bad, 4, 0)
    st |= tl.where(hbody != exp_body, 4, 0)
    st |= tl.where(nbytes < 48 + hbody, 8, 0)
    st |= tl.where(total != w10, 16, 0)
    return tl.sum(st, axis=0)


# ------------------------------------------------------------------------------------------
# decode
# ------------------------------------------------------------------------------------------
@triton.jit
def _unpack_plane(src, row_byte, valid, G0: tl.constexpr, NG: tl.constexpr, SHIFT: tl.constexpr,
                  W: tl.constexpr, POFF: tl.constexpr, WORDS: tl.constexpr, L: tl.constexpr,
                  BT: tl.constexpr, C: tl.constexpr):
    """Code bits SHIFT..SHIFT+W of coordinates G0..G0+NG from one bit plane -> [L, BT, C]."""
    d = tl.arange(0, L)[:, None, None] * C + tl.arange(0, C)[None, None, :]
    ing = (d >= G0) & (d < G0 + NG)
    FITS: tl.constexpr = C >= 32 // W  # a lane holds whole words of this plane
    if WORDS and FITS:
        PER: tl.constexpr = 32 // W
        NWR: tl.constexpr = C // PER  # words of this plane per lane row
        # [L, BT, NWR/4, 4] pointers ([NWR/4, BT, L, 4] on 3.8+, see _load_rows) keep each
        # row's words in its own thread
        if NWR >= 4:
            if ROWS_FIRST:
                ln = tl.arange(0, L)[:, None, None, None]
                q = tl.arange(0, NWR // 4)[None, None, :, None]
                r = tl.arange(0, 4)[None, None, None, :]
                m = ln * NWR + q * 4 + r - G0 // PER
                ok = valid[None, :, None, None] & (m >= 0) & (m < NG // PER)
                p32 = (src + row_byte[None, :, None, None] + POFF).to(tl.pointer_type(tl.int32))
                w = tl.reshape(tl.load(p32 + m, mask=ok, other=0), [L, BT, NWR])
            else:
                q = tl.arange(0, NWR // 4)[:, None, None, None]
                ln = tl.arange(0, L)[None, None, :, None]
                r = tl.arange(0, 4)[None, None, None, :]
                m = ln * NWR + q * 4 + r - G0 // PER
                ok = valid[None, :, None, None] & (m >= 0) & (m < NG // PER)
                p32 = (src + row_byte[None, :, None, None] + POFF).to(tl.pointer_type(tl.int32))
                w = tl.load(p32 + m, mask=ok, other=0)
                w = tl.reshape(tl.permute(w, (2, 1, 0, 3)), [L, BT, NWR])
        else:
            if ROWS_FIRST:
                m = (tl.arange(0, L)[:, None, None] * NWR + tl.arange(0, NWR)[None, None, :]
                     - G0 // PER)
                ok = valid[None, :, None] & (m >= 0) & (m < NG // PER)
                p32 = (src + row_byte[None, :, None] + POFF).to(tl.pointer_type(tl.int32))
                w = tl.load(p32 + m, mask=ok, other=0)
            else:
                m = (tl.arange(0, NWR)[:, None, None] + tl.arange(0, L)[None, None, :] * NWR
                     - G0 // PER)
                ok = valid[None, :, None] & (m >= 0) & (m < NG // PER)
                p32 = (src + row_byte[None, :, None] + POFF).to(tl.pointer_type(tl.int32))
                w = tl.permute(tl.load(p32 + m, mask=ok, other=0), (2, 1, 0))
        sh = tl.arange(0, PER) * W
        vals = (w[:, :, :, None] >> sh[None, None, None, :]) & ((1 << W) - 1)
        vals = tl.reshape(vals, [L, BT, C])
    else:
        PER: tl.constexpr = 8 // W
        pos = tl.where(ing, d - G0, 0)
        bp = src + row_byte[None, :, None] + POFF + pos // PER
        byte = _gload_rows(bp, valid[None, :, None] & ing, L, BT, C).to(tl.int32)
        vals = (byte >> ((pos % PER) * W)) & ((1 << W) - 1)
    return tl.where(ing, vals << SHIFT, 0)


@triton.jit
def _unpack_group(src, row_byte, valid, G0: tl.constexpr, NG: tl.constexpr, B: tl.constexpr,
                  POFF: tl.constexpr, WORDS: tl.constexpr, L: tl.constexpr, BT: tl.constexpr,
                  C: tl.constexpr):
    if B == 1:
        code = _unpack_plane(src, row_byte, valid, G0, NG, 0, 1, POFF, WORDS, L, BT, C)
    elif B == 2:
        code = _unpack_plane(src, row_byte, valid, G0, NG, 0, 2, POFF, WORDS, L, BT, C)
    elif B == 3:
        code = _unpack_plane(src, row_byte, valid, G0, NG, 0, 2, POFF, WORDS, L, BT, C)
        code |= _unpack_plane(src, row_byte, valid, G0, NG, 2, 1, POFF + NG // 4, WORDS, L, BT, C)
    elif B == 4:
        code = _unpack_plane(src, row_byte, valid, G0, NG, 0, 4, POFF, WORDS, L, BT, C)
    elif B == 5:
        code = _unpack_plane(src, row_byte, valid, G0, NG, 0, 4, POFF, WORDS, L, BT, C)
        code |= _unpack_plane(src, row_byte, valid, G0, NG, 4, 1, POFF + NG // 2, WORDS, L, BT, C)
    elif B == 6:
        code = _unpack_plane(src, row_byte, valid, G0, NG, 0, 4, POFF, WORDS, L, BT, C)
        code |= _unpack_plane(src, row_byte, valid, G0, NG, 4, 2, POFF + NG // 2, WORDS, L, BT, C)
    else:
        code = _unpack_plane(src, row_byte, valid, G0, NG, 0, 4, POFF, WORDS, L, BT, C)
        code |= _unpack_plane(src, row_byte, valid, G0, NG, 4, 2, POFF + NG // 2, WORDS, L, BT, C)
        code |= _unpack_plane(src, row_byte, valid, G0, NG, 6, 1, POFF + NG // 2 + NG // 4,
                              WORDS, L, BT, C)
    return code


@triton.jit
def _cvt(x, DT: tl.constexpr, MANUAL: tl.constexpr):
    """fp32 -> DT with round-to-nearest-even. MANUAL: integer RNE for bf16 (the interpreter's
    bf16 cast truncates; the GPU's cvt.rn agrees with this)."""
    if MANUAL and DT == tl.bfloat16:
        bits = x.to(tl.int32, bitcast=True)
        r = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        return r.to(tl.int16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(DT)


@triton.jit
def _to_cache(xf, SRC_FP16: tl.constexpr, OUT_DTYPE: tl.constexpr, MANUAL: tl.constexpr, sc):
    """Round fp32 to the chunk's source dtype (as the reference does), then to the cache's
    (uint8: an fp8 e4m3 cache with scale sc, see _fp8_cache_bits)."""
    if OUT_DTYPE == tl.uint8:
        if SRC_FP16:
            xs = _cvt(xf, tl.float16, MANUAL).to(tl.float32)
        else:
            xs = _cvt(xf, tl.bfloat16, MANUAL).to(tl.float32)
        y = _fp8_cache_bits(xs, sc, MANUAL)
    elif SRC_FP16:
        if OUT_DTYPE == tl.float16:
            y = _cvt(xf, tl.float16, MANUAL)
        else:
            y = _cvt(_cvt(xf, tl.float16, MANUAL).to(tl.float32), OUT_DTYPE, MANUAL)
    else:
        if OUT_DTYPE == tl.bfloat16:
            y = _cvt(xf, tl.bfloat16, MANUAL)
        else:
            y = _cvt(_cvt(xf, tl.bfloat16, MANUAL).to(tl.float32), OUT_DTYPE, MANUAL)
    return y


@triton.jit
def _from_bits(bits16, SRC_FP16: tl.constexpr, OUT_DTYPE: tl.constexpr, MANUAL: tl.constexpr, sc):
    """Source-dtype values given as int16 bits -> the cache's dtype."""
    if OUT_DTYPE == tl.uint8:
        if SRC_FP16:
            xs = bits16.to(tl.float16, bitcast=True).to(tl.float32)
        else:
            xs = bits16.to(tl.bfloat16, bitcast=True).to(tl.float32)
        y = _fp8_cache_bits(xs, sc, MANUAL)
    elif SRC_FP16:
        if OUT_DTYPE == tl.float16:
            y = bits16.to(tl.float16, bitcast=True)
        else:
            y = _cvt(bits16.to(tl.float16, bitcast=True).to(tl.float32), OUT_DTYPE, MANUAL)
    else:
        if OUT_DTYPE == tl.bfloat16:
            y = bits16.to(tl.bfloat16, bitcast=True)
        else:
            y = _cvt(bits16.to(tl.bfloat16, bitcast=True).to(tl.float32), OUT_DTYPE, MANUAL)
    return y


@triton.jit
def _dec_stream(kv_ptr, src_ptr, tab_ptr, blocks_ptr, blk0, start, T, layer_off, h, H, body0,
                s_off, SRC_FP16: tl.constexpr, stride_blk, stride_tok, stride_head, block_size,
                D: tl.constexpr, L: tl.constexpr, BT: tl.constexpr, KIND: tl.constexpr,
                BITS: tl.constexpr, CENTER: tl.constexpr, SINK: tl.constexpr, NHI: tl.constexpr,
                WORDS: tl.constexpr, MANUAL: tl.constexpr, S1M: tl.constexpr, S2M: tl.constexpr,
                sc):
    C: tl.constexpr = D // L
    OUT_DTYPE: tl.constexpr = kv_ptr.dtype.element_ty
    dcol = tl.arange(0, L)[:, None, None] * C + tl.arange(0, C)[None, None, :]
    if KIND == 2:
        R: tl.constexpr = (NHI * (BITS + 1) + (D - NHI) * BITS) // 8
        S = tl.where(start == 0, tl.minimum(T, SINK), 0)
        off = s_off
        mean_off = off
        if CENTER:
            off += H * D * 2
        sink_off = off
        off += S * H * D * 2
        codes_off = off
        scales_off = _align16(off + T * H * R)
        mp = (src_ptr + body0 + mean_off).to(tl.pointer_type(tl.float16)) + h * D
        zrow = tl.zeros([BT], tl.int64)
    for t0 in range(0, T, BT):
        t = t0 + tl.arange(0, BT)
        valid = t < T
        row = _row_offsets(blocks_ptr, blk0, start, t, valid, layer_off, h, stride_blk, stride_tok,
                           stride_head, block_size)
        ri = t.to(tl.int64) * H + h
        if KIND == 0:
            rb = s_off + ri * (D * 2)
            bits = _load_rows((src_ptr + body0).to(tl.pointer_type(tl.int16)), rb // 2, valid,
                              L, BT, C)
            y = _from_bits(bits, SRC_FP16, OUT_DTYPE, MANUAL, sc)
        elif KIND == 1:
            sp = (src_ptr + body0 + s_off).to(tl.pointer_type(tl.float16))
            s32 = tl.load(sp + ri, mask=valid, other=0.0).to(tl.float32)
            cb = s_off + _align16(T * H * 2) + ri * D
            q = _load_rows(src_ptr + body0, cb, valid, L, BT, C)
            xf = q.to(tl.float8e4nv, bitcast=True).to(tl.float32) * s32[None, :, None]
            y = _to_cache(xf, SRC_FP16, OUT_DTYPE, MANUAL, sc)
        else:
            cb = codes_off + ri * R
            if NHI > 0:
                code = _unpack_group(src_ptr + body0, cb, valid, 0, NHI, BITS + 1, 0, WORDS,
                                     L, BT, C)
                code |= _unpack_group(src_ptr + body0, cb, valid, NHI, D - NHI, BITS,
                                      NHI * (BITS + 1) // 8, WORDS, L, BT, C)
                LOH: tl.constexpr = 2 * D + 3 * ((1 << (BITS + 1)) - 2) + (1 << (BITS + 1))
                LOL: tl.constexpr = 2 * D + 3 * ((1 << BITS) - 2) + (1 << BITS)
                c = tl.where(dcol < NHI, _gather_rows(tab_ptr + LOH, code, L, BT, C),
                             _gather_rows(tab_ptr + LOL, code, L, BT, C))
            else:
                code = _unpack_group(src_ptr + body0, cb, valid, 0, D, BITS, 0, WORDS, L, BT, C)
                LEV: tl.constexpr = 2 * D + 3 * ((1 << BITS) - 2) + (1 << BITS)
                c = _gather_rows(tab_ptr + LEV, code, L, BT, C)
            sp = (src_ptr + body0 + scales_off).to(tl.pointer_type(tl.float16))
            s32 = tl.load(sp + ri, mask=valid, other=0.0).to(tl.float32)
            xf = _rotate(c, S2M, S1M, L, BT, C)
            xf = xf * s32[None, :, None]
            if CENTER:
                xf = xf + _load_rows(mp, zrow, valid, L, BT, C).to(tl.float32)
            y = _to_cache(xf, SRC_FP16, OUT_DTYPE, MANUAL, sc)
            if SINK > 0:
                if t0 < S:
                    sv = valid & (t < S)
                    sb = sink_off + ri * (D * 2)
                    sbits = _load_rows((src_ptr + body0).to(tl.pointer_type(tl.int16)), sb // 2,
                                       sv, L, BT, C)
                    sink = _from_bits(sbits, SRC_FP16, OUT_DTYPE, MANUAL, sc)
                    y = tl.where(sv[None, :, None], sink, y)
        _store_rows(kv_ptr, row, valid, y, L, BT, C)


@triton.jit(do_not_specialize=["block_size", "H", "preset_id", "num_layers"])
def decode_kernel(
    kv_ptr, src_ptr, items_ptr, blocks_ptr, tab_ptr, status_ptr, fail_ptr,
    stride_blk, stride_tok, stride_head, block_size, H, preset_id, num_layers,
    D: tl.constexpr, L: tl.constexpr, BT: tl.constexpr,
    K_KIND: tl.constexpr, K_BITS: tl.constexpr, K_CENTER: tl.constexpr, K_SINK: tl.constexpr,
    K_NHI: tl.constexpr, K_WORDS: tl.constexpr,
    V_KIND: tl.constexpr, V_BITS: tl.constexpr, V_CENTER: tl.constexpr, V_SINK: tl.constexpr,
    V_NHI: tl.constexpr, V_WORDS: tl.constexpr, MANUAL: tl.constexpr, S1M: tl.constexpr,
    S2M: tl.constexpr, SPLIT: tl.constexpr, BLOCKW: tl.constexpr,
):
    """Grid: items x SPLIT. Each program verifies its item's chunk (``_verify_chunk``: header,
    expectations, body checksum), records the status (``status_ptr[items.status]``; a refusal
    also counts in ``*fail_ptr``) and, only if the chunk is valid, decodes it: both streams, every
    head (SPLIT 1), or one stream (SPLIT 2: program s of an item decodes stream s; both verify
    the whole chunk and record the same status). A refused chunk writes nothing; the other
    chunks of the launch are decoded regardless. Only the item's window of heads is written
    (``D_HEAD0``: every head but for a decode rank of another TP size)."""
    pid = tl.program_id(0)
    item = pid // SPLIT
    part = pid % SPLIT
    ip = items_ptr + item * D_FIELDS
    in_off = tl.multiple_of(tl.load(ip + D_IN), 16)
    stv = _verify_chunk(src_ptr, ip, in_off, H, preset_id, num_layers, D, BLOCKW)
    tl.store(status_ptr + tl.load(ip + D_STATUS), stv)
    if stv != 0:
        tl.atomic_add(fail_ptr, 1, sem="relaxed")
    else:
        start = tl.load(ip + D_START).to(tl.int32)
        T = tl.load(ip + D_T).to(tl.int32)
        blk0 = tl.load(ip + D_BLK)
        body0 = in_off + 48
        k_off = tl.multiple_of(tl.load(ip + D_KOFF), 16)
        v_off = tl.multiple_of(tl.load(ip + D_VOFF), 16)
        s_off = tl.multiple_of(tl.load(ip + D_KBYTES), 16)
        ksc = _scale_at(ip, D_KSCALE)
        vsc = _scale_at(ip, D_VSCALE)
        h0 = tl.load(ip + D_HEAD0).to(tl.int32)
        hn = tl.load(ip + D_HEADS).to(tl.int32)
        do_k = part == 0
        do_v = part == SPLIT - 1
        # the chunk's source dtype (verified: 1 bf16, 2 fp16) selects a specialised copy of the
        # tile loop: a runtime test inside it cost ~3 instructions per value (both roundings
        # computed, then selected)
        if tl.load(src_ptr + in_off + 16) == 2:
            if do_k:
                for h in range(h0, h0 + hn):
                    _dec_stream(kv_ptr, src_ptr, tab_ptr, blocks_ptr, blk0, start, T, k_off, h,
                                H, body0, 0, True, stride_blk, stride_tok, stride_head,
                                block_size, D, L, BT, K_KIND, K_BITS, K_CENTER, K_SINK, K_NHI,
                                K_WORDS, MANUAL, S1M, S2M, ksc)
            if do_v:
                for h in range(h0, h0 + hn):
                    _dec_stream(kv_ptr, src_ptr, tab_ptr, blocks_ptr, blk0, start, T, v_off, h,
                                H, body0, s_off, True, stride_blk, stride_tok, stride_head,
                                block_size, D, L, BT, V_KIND, V_BITS, V_CENTER, V_SINK, V_NHI,
                                V_WORDS, MANUAL, S1M, S2M, vsc)
        else:
            if do_k:
                for h in range(h0, h0 + hn):
                    _dec_stream(kv_ptr, src_ptr, tab_ptr, blocks_ptr, blk0, start, T, k_off, h,
                                H, body0, 0, False, stride_blk, stride_tok, stride_head,
                                block_size, D, L, BT, K_KIND, K_BITS, K_CENTER, K_SINK, K_NHI,
                                K_WORDS, MANUAL, S1M, S2M, ksc)
            if do_v:
                for h in range(h0, h0 + hn):
                    _dec_stream(kv_ptr, src_ptr, tab_ptr, blocks_ptr, blk0, start, T, v_off, h,
                                H, body0, s_off, False, stride_blk, stride_tok, stride_head,
                                block_size, D, L, BT, V_KIND, V_BITS, V_CENTER, V_SINK, V_NHI,
                                V_WORDS, MANUAL, S1M, S2M, vsc)


# ------------------------------------------------------------------------------------------
# verify, then decode per (chunk, stream, head): the variant for long chunks
# ------------------------------------------------------------------------------------------
@triton.jit
def verify_kernel(src_ptr, items_ptr, acc_ptr, status_ptr, fail_ptr, H, preset_id, num_layers,
                  D: tl.constexpr, BLOCKW: tl.constexpr):
    """Grid: items x splits. ``decode_kernel``'s first phase alone, a chunk's body checksum
    spread over the programs of its row (BLOCKW words each, as many as the expected body
    needs) so a few long chunks still fill the GPU. Each adds its part of the wsum32 to the
    chunk's pair in ``acc_ptr`` (zero before, zero again after); the last to arrive checks the
    header and records the chunk's status (a refusal also counts in ``*fail_ptr``).
    ``decode_heads_kernel``, launched after it on the same stream, decodes only the chunks
    whose status is 0."""
    ip = items_ptr + tl.program_id(0) * D_FIELDS
    split = tl.program_id(1)
    nsplit = tl.maximum((tl.load(ip + D_BODY) // 4 + BLOCKW - 1) // BLOCKW, 1).to(tl.int32)
    if split < nsplit:
        in_off = tl.multiple_of(tl.load(ip + D_IN), 16)
        p32 = (src_ptr + in_off).to(tl.pointer_type(tl.int32))
        nw = _checked_words(p32, ip)
        wi = split.to(tl.int64) * BLOCKW + tl.arange(0, BLOCKW)
        w = tl.load(p32 + 12 + wi, mask=wi < nw, other=0)
        part = tl.sum(w * (wi.to(tl.int32) * 2 + 1), axis=0).to(tl.int32)
        slot = tl.load(ip + D_STATUS)
        tl.atomic_add(acc_ptr + 2 * slot, part, sem="relaxed")
        done = tl.atomic_add(acc_ptr + 2 * slot + 1, 1, sem="acq_rel")
        if done == nsplit - 1:
            total = tl.atomic_xchg(acc_ptr + 2 * slot, 0, sem="acq_rel")
            tl.atomic_xchg(acc_ptr + 2 * slot + 1, 0, sem="relaxed")
            stv = _header_status(p32, ip, total, H, preset_id, num_layers, D)
            tl.store(status_ptr + slot, stv)
            if stv != 0:
                tl.atomic_add(fail_ptr, 1, sem="relaxed")


@triton.jit
def decode_heads_kernel(
    kv_ptr, src_ptr, items_ptr, blocks_ptr, tab_ptr, status_ptr,
    stride_blk, stride_tok, stride_head, block_size, H,
    D: tl.constexpr, L: tl.constexpr, BT: tl.constexpr,
    K_KIND: tl.constexpr, K_BITS: tl.constexpr, K_CENTER: tl.constexpr, K_SINK: tl.constexpr,
    K_NHI: tl.constexpr, K_WORDS: tl.constexpr,
    V_KIND: tl.constexpr, V_BITS: tl.constexpr, V_CENTER: tl.constexpr, V_SINK: tl.constexpr,
    V_NHI: tl.constexpr, V_WORDS: tl.constexpr, MANUAL: tl.constexpr, S1M: tl.constexpr,
    S2M: tl.constexpr,
):
    """Grid: items x 2 streams x H heads. Program (item, s, h) decodes head h of stream s of a
    chunk ``verify_kernel`` passed (status 0), if h is in the item's window (``D_HEAD0``), and
    writes nothing otherwise. A long chunk is
    then spread over 2H programs instead of one: the same arithmetic as ``decode_kernel``'s
    (``_dec_stream``), so the caches written are bit-identical."""
    pid = tl.program_id(0)
    per_item = 2 * H
    item = pid // per_item
    s = (pid % per_item) // H
    h = pid % H
    ip = items_ptr + item * D_FIELDS
    h0 = tl.load(ip + D_HEAD0).to(tl.int32)
    mine = (h >= h0) & (h < h0 + tl.load(ip + D_HEADS).to(tl.int32))  # else outside its window
    if mine & (tl.load(status_ptr + tl.load(ip + D_STATUS)) == 0):
        in_off = tl.multiple_of(tl.load(ip + D_IN), 16)
        start = tl.load(ip + D_START).to(tl.int32)
        T = tl.load(ip + D_T).to(tl.int32)
        blk0 = tl.load(ip + D_BLK)
        body0 = in_off + 48
        fp16 = tl.load(src_ptr + in_off + 16) == 2
        if s == 0:
            k_off = tl.multiple_of(tl.load(ip + D_KOFF), 16)
            ksc = _scale_at(ip, D_KSCALE)
            if fp16:
                _dec_stream(kv_ptr, src_ptr, tab_ptr, blocks_ptr, blk0, start, T, k_off, h, H,
                            body0, 0, True, stride_blk, stride_tok, stride_head, block_size,
                            D, L, BT, K_KIND, K_BITS, K_CENTER, K_SINK, K_NHI, K_WORDS, MANUAL,
                            S1M, S2M, ksc)
            else:
                _dec_stream(kv_ptr, src_ptr, tab_ptr, blocks_ptr, blk0, start, T, k_off, h, H,
                            body0, 0, False, stride_blk, stride_tok, stride_head, block_size,
                            D, L, BT, K_KIND, K_BITS, K_CENTER, K_SINK, K_NHI, K_WORDS, MANUAL,
                            S1M, S2M, ksc)
        else:
            v_off = tl.multiple_of(tl.load(ip + D_VOFF), 16)
            s_off = tl.multiple_of(tl.load(ip + D_KBYTES), 16)
            vsc = _scale_at(ip, D_VSCALE)
            if fp16:
                _dec_stream(kv_ptr, src_ptr, tab_ptr, blocks_ptr, blk0, start, T, v_off, h, H,
                            body0, s_off, True, stride_blk, stride_tok, stride_head, block_size,
                            D, L, BT, V_KIND, V_BITS, V_CENTER, V_SINK, V_NHI, V_WORDS, MANUAL,
                            S1M, S2M, vsc)
            else:
                _dec_stream(kv_ptr, src_ptr, tab_ptr, blocks_ptr, blk0, start, T, v_off, h, H,
                            body0, s_off, False, stride_blk, stride_tok, stride_head,
                            block_size, D, L, BT, V_KIND, V_BITS, V_CENTER, V_SINK, V_NHI,
                            V_WORDS, MANUAL, S1M, S2M, vsc)
