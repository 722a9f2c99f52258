/* The hot loops of the CPU codec, compiled once per ISA variant (twcpu_base.c, twcpu_v2.c,
 * twcpu_v3.c define TW_VARIANT and a target pragma, then include this file).
 *
 * Numerics follow codec/FORMAT.md operation by operation: every float operation is one IEEE
 * fp32 operation (the build disables FMA contraction and fast-math), sums are the fixed pairwise
 * folds, the butterfly runs its stages in the reference order, and sqrt/division are the
 * correctly rounded hardware instructions. Vectors hold 8 consecutive coordinates of one head
 * vector (GCC/Clang vector extensions; AVX2 permutes for table lookups in the v3 build); lanes
 * never change which numbers are added together, only how many additions run at once.
 * Any change here must keep the bytes identical to the PyTorch reference
 * (tests/unit/test_kernels_cpu.py checks every preset on every variant).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "twcpu.h"

#if defined(TW_HAVE_AVX2)
#include <immintrin.h>
#endif

#define TW_CAT2(a, b) a##_##b
#define TW_CAT(a, b) TW_CAT2(a, b)
#define TW_FN(name) TW_CAT(name, TW_VARIANT)
#define TW_AI static inline __attribute__((always_inline))
#define TW_MAXD 256
#define TW_MAXV (TW_MAXD / 8)

typedef float vf __attribute__((vector_size(32)));
typedef int32_t vi __attribute__((vector_size(32)));
typedef uint32_t vu __attribute__((vector_size(32)));
typedef uint16_t vh __attribute__((vector_size(16)));
typedef uint8_t vb __attribute__((vector_size(8)));

#if defined(__clang__)
#define SHUF(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define SHUF(a, b, ...) __builtin_shuffle(a, b, (vi){__VA_ARGS__})
#endif
#define EVENS 0, 2, 4, 6, 8, 10, 12, 14
#define ODDS 1, 3, 5, 7, 9, 11, 13, 15

/* ---------------------------------------------------------------- scalar conversions */
TW_AI uint32_t f2u(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
TW_AI float u2f(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

TW_AI float bf16_f32(uint16_t h) { return u2f((uint32_t)h << 16); }

/* round to nearest even; NaN -> 0xFFFF (torch's vectorised conversion; NaN is outside the
 * bit-exact contract anyway) */
TW_AI uint16_t f32_bf16(float f) {
    uint32_t u = f2u(f);
    uint32_t r = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
    return (uint16_t)((u & 0x7FFFFFFFu) > 0x7F800000u ? 0xFFFFu : r);
}

/* exact (torch's fp16_ieee_to_fp32_value) */
TW_AI float f16_f32(uint16_t h) {
    uint32_t w = (uint32_t)h << 16;
    uint32_t sign = w & 0x80000000u;
    uint32_t two_w = w + w;
    float normalized = u2f((two_w >> 4) + (0xE0u << 23)) * 0x1.0p-112f;
    float denormalized = u2f((two_w >> 17) | (126u << 23)) - 0.5f;
    uint32_t bits = two_w < (1u << 27) ? f2u(denormalized) : f2u(normalized);
    return u2f(sign | bits);
}

/* IEEE round to nearest even, overflow to inf, subnormals kept (what F16C and torch do) */
TW_AI uint16_t f32_f16(float f) {
    uint32_t x = f2u(f);
    uint32_t sign = (x >> 16) & 0x8000u;
    uint32_t ax = x & 0x7FFFFFFFu;
    uint32_t r;
    if (ax > 0x7F800000u) {
        r = 0x7E00u | ((ax >> 13) & 0x3FFu);
    } else if (ax >= 0x477FF000u) {
        r = 0x7C00u;
    } else if (ax >= 0x38800000u) {
        uint32_t v = ax - 0x38000000u;
        r = (v + 0xFFFu + ((v >> 13) & 1u)) >> 13;
    } else {
        /* subnormal or zero: |f| in units of 2^-24, rounded to an integer (RNE) by adding 2^23 */
        r = f2u(u2f(ax) * 0x1.0p24f + 0x1.0p23f) - 0x4B000000u;
    }
    return (uint16_t)(sign | r);
}

/* torch's float -> float8_e4m3fn (RNE; NaN -> 0x7F; beyond 464 saturates to 448 = 0x7E). The
 * codec clamps to +-448 first, so only the saturation-free part matters for the bytes. */
TW_AI uint8_t f32_e4m3(float f) {
    uint32_t fb = f2u(f);
    uint32_t sign = fb & 0x80000000u;
    uint32_t r;
    fb ^= sign;
    if (fb > 0x43E80000u) { /* |f| > 464 */
        r = fb > 0x7F800000u ? 0x7Fu : 0x7Eu;
    } else if (fb < (121u << 23)) {
        const uint32_t dm = 141u << 23;
        r = (uint8_t)(f2u(u2f(fb) + u2f(dm)) - dm);
    } else {
        uint32_t odd = (fb >> 20) & 1u;
        fb += ((uint32_t)(7 - 127) << 23) + 0x7FFFFu;
        fb += odd;
        r = (uint8_t)(fb >> 20);
    }
    return (uint8_t)(r | (sign >> 24));
}

TW_AI uint16_t ld16(const uint8_t *p) { uint16_t v; memcpy(&v, p, 2); return v; }
TW_AI void st16(uint8_t *p, uint16_t v) { memcpy(p, &v, 2); }

/* ---------------------------------------------------------------- vector helpers */
TW_AI vf ldf(const float *p) { vf v; memcpy(&v, p, sizeof v); return v; }
TW_AI void stf(float *p, vf v) { memcpy(p, &v, sizeof v); }
TW_AI vf bcast(float x) { return (vf){x, x, x, x, x, x, x, x}; }
TW_AI vu sel(vi m, vu a, vu b) { return ((vu)m & a) | (~(vu)m & b); } /* m ? a : b */

TW_AI vf ld_bf16(const uint16_t *p) {
    vh h;
    memcpy(&h, p, sizeof h);
    return (vf)(__builtin_convertvector(h, vu) << 16);
}

TW_AI vf ld_f16(const uint16_t *p) {
    vh h;
    memcpy(&h, p, sizeof h);
    const vu w = __builtin_convertvector(h, vu) << 16;
    const vu sign = w & 0x80000000u;
    const vu two_w = w + w;
    const vf normalized = (vf)((two_w >> 4) + (0xE0u << 23)) * bcast(0x1.0p-112f);
    const vf denormalized = (vf)((two_w >> 17) | (126u << 23)) - bcast(0.5f);
    return (vf)(sign | sel((vi)(two_w < (1u << 27)), (vu)denormalized, (vu)normalized));
}

TW_AI vf ld_row(const uint16_t *p, int dtype) { return dtype == TW_BF16 ? ld_bf16(p) : ld_f16(p); }

TW_AI vu to_bf16(vf v) {
    const vu u = (vu)v;
    const vu r = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
    return sel((vi)((u & 0x7FFFFFFFu) > 0x7F800000u), (vu){0xFFFF, 0xFFFF, 0xFFFF, 0xFFFF, 0xFFFF, 0xFFFF, 0xFFFF, 0xFFFF}, r);
}

TW_AI vu to_f16(vf v) {
    const vu x = (vu)v;
    const vu sign = (x >> 16) & 0x8000u;
    const vu ax = x & 0x7FFFFFFFu;
    const vu nan = 0x7E00u | ((ax >> 13) & 0x3FFu);
    const vu nv = ax - 0x38000000u;
    const vu normal = (nv + 0xFFFu + ((nv >> 13) & 1u)) >> 13;
    const vu sub = (vu)((vf)ax * bcast(0x1.0p24f) + bcast(0x1.0p23f)) - 0x4B000000u;
    vu r = sel((vi)(ax >= 0x38800000u), normal, sub);
    r = sel((vi)(ax >= 0x477FF000u), (vu){0x7C00, 0x7C00, 0x7C00, 0x7C00, 0x7C00, 0x7C00, 0x7C00, 0x7C00}, r);
    r = sel((vi)(ax > 0x7F800000u), nan, r);
    return sign | r;
}

TW_AI void st_h(uint16_t *p, vu r) {
    vh h = __builtin_convertvector(r, vh);
    memcpy(p, &h, sizeof h);
}

/* 8 bytes <-> 8 int32 lanes (lanes < 256) */
TW_AI vi widen8(const uint8_t *p) {
#if defined(TW_HAVE_AVX2)
    return (vi)_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
#else
    vb b;
    memcpy(&b, p, 8);
    return __builtin_convertvector(b, vi);
#endif
}

TW_AI void narrow8(uint8_t *p, vi q) {
#if defined(TW_HAVE_AVX2)
    const __m256i x = (__m256i)q;
    const __m128i w = _mm_packus_epi32(_mm256_castsi256_si128(x), _mm256_extracti128_si256(x, 1));
    _mm_storel_epi64((__m128i *)p, _mm_packus_epi16(w, w));
#else
    vb b = __builtin_convertvector(q, vb);
    memcpy(p, &b, 8);
#endif
}

/* round to the chunk dtype, then store in the cache dtype (double rounding as the reference) */
TW_AI void st_row(uint16_t *p, vf v, int src, int dst) {
    if (src == TW_BF16 && dst == TW_BF16) {
        st_h(p, to_bf16(v));
    } else if (src == TW_F16 && dst == TW_F16) {
        st_h(p, to_f16(v));
    } else if (src == TW_BF16) {
        st_h(p, to_f16((vf)(to_bf16(v) << 16)));
    } else {
        uint16_t tmp[8];
        st_h(tmp, to_f16(v));
        st_h(p, to_bf16(ld_f16(tmp)));
    }
}

/* a row stored in the chunk dtype (raw data, sink rows) copied into the cache dtype */
TW_AI void copy_row(const uint8_t *src, int src_dtype, int dst_dtype, uint16_t *dst, int D) {
    if (src_dtype == dst_dtype) {
        memcpy(dst, src, (size_t)D * 2);
        return;
    }
    for (int j = 0; j < D / 8; j++) {
        uint16_t tmp[8];
        memcpy(tmp, src + 16 * j, 16);
        st_row(dst + 8 * j, ld_row(tmp, src_dtype), dst_dtype, dst_dtype);
    }
}

/* code[lane] -> tab[code[lane]] for a table of n = 2^w floats held as n/8 vectors (n >= 8) */
TW_AI vf lookup(const vf *tab, int n, vi idx) {
#if defined(TW_HAVE_AVX2)
    const __m256i ii = (__m256i)idx;
    __m256 r[8];
    for (int k = 0; k < n / 8; k++) r[k] = _mm256_permutevar8x32_ps((__m256)tab[k], ii);
    for (int bit = 3, m = n / 8; m > 1; bit++, m >>= 1) {
        const __m256 sel_hi = _mm256_castsi256_ps(_mm256_slli_epi32(ii, 31 - bit));
        for (int k = 0; k < m / 2; k++) r[k] = _mm256_blendv_ps(r[2 * k], r[2 * k + 1], sel_hi);
    }
    return (vf)r[0];
#else
    const float *t = (const float *)tab;
    vf r;
    for (int l = 0; l < 8; l++) r[l] = t[idx[l]];
    (void)n;
    return r;
#endif
}

/* Sylvester butterfly over nv vectors, stages h = 1, 2, 4 (inside a vector: a - b is a + (-b)
 * exactly), then h = 8, 16, ... across vectors: the reference's stages in the reference order. */
TW_AI void vfwht(vf *x, int nv) {
    const vu m1 = {0, 0x80000000u, 0, 0x80000000u, 0, 0x80000000u, 0, 0x80000000u};
    const vu m2 = {0, 0, 0x80000000u, 0x80000000u, 0, 0, 0x80000000u, 0x80000000u};
    const vu m4 = {0, 0, 0, 0, 0x80000000u, 0x80000000u, 0x80000000u, 0x80000000u};
    for (int j = 0; j < nv; j++) {
        vf v = x[j];
        v = SHUF(v, v, 0, 0, 2, 2, 4, 4, 6, 6) + (vf)((vu)SHUF(v, v, 1, 1, 3, 3, 5, 5, 7, 7) ^ m1);
        v = SHUF(v, v, 0, 1, 0, 1, 4, 5, 4, 5) + (vf)((vu)SHUF(v, v, 2, 3, 2, 3, 6, 7, 6, 7) ^ m2);
        v = SHUF(v, v, 0, 1, 2, 3, 0, 1, 2, 3) + (vf)((vu)SHUF(v, v, 4, 5, 6, 7, 4, 5, 6, 7) ^ m4);
        x[j] = v;
    }
    for (int h = 1; h < nv; h <<= 1) {
        for (int i = 0; i < nv; i += 2 * h) {
            for (int j = i; j < i + h; j++) {
                const vf a = x[j], b = x[j + h];
                x[j] = a + b;
                x[j + h] = a - b;
            }
        }
    }
}

/* pairwise fold of adjacent elements (FORMAT.md) of nv vectors = 8*nv values; t is clobbered.
 * Each level adds element 2j and 2j+1 of the previous level, in element order. */
TW_AI float vfold(vf *t, int nv) {
    if (nv < 1) __builtin_unreachable();
    for (; nv > 1; nv >>= 1)
        for (int j = 0; j < nv / 2; j++) {
            const vf a = t[2 * j], b = t[2 * j + 1];
#if defined(TW_HAVE_AVX2)
            /* hadd gives the adjacent sums with 64-bit quarters in the order 0, 2, 1, 3 */
            t[j] = (vf)_mm256_permute4x64_pd(_mm256_castps_pd(_mm256_hadd_ps((__m256)a, (__m256)b)), 0xD8);
#else
            t[j] = SHUF(a, b, EVENS) + SHUF(a, b, ODDS);
#endif
        }
    vf v = t[0];
    v = SHUF(v, v, 0, 2, 4, 6, 0, 2, 4, 6) + SHUF(v, v, 1, 3, 5, 7, 1, 3, 5, 7);
    v = SHUF(v, v, 0, 2, 0, 2, 0, 2, 0, 2) + SHUF(v, v, 1, 3, 1, 3, 1, 3, 1, 3);
    return v[0] + v[1];
}

/* ---------------------------------------------------------------- packing */
TW_AI int plane_widths(int bits, int *w) {
    switch (bits) {
    case 1: w[0] = 1; return 1;
    case 2: w[0] = 2; return 1;
    case 3: w[0] = 2; w[1] = 1; return 2;
    case 4: w[0] = 4; return 1;
    case 5: w[0] = 4; w[1] = 1; return 2;
    case 6: w[0] = 4; w[1] = 2; return 2;
    default: w[0] = 4; w[1] = 2; w[2] = 1; return 3; /* 7 */
    }
}

/* adjacent lanes a[2i] | a[2i+1] << w of the 16 lanes of (a, b), in order */
TW_AI vi combine(vi a, vi b, int w) { return SHUF(a, b, EVENS) | (SHUF(a, b, ODDS) << w); }

/* One plane of width w (bits shift .. shift+w-1 of each code) of nv vectors of codes. */
TW_AI void pack_plane(const vi *code, int nv, int w, int shift, uint8_t *out) {
    const int per = 8 / w;
    const int32_t mask = (1 << w) - 1;
    if (nv % per == 0) {
        for (int g = 0; g < nv / per; g++) { /* per vectors -> 8 bytes */
            vi q[8];
            for (int k = 0; k < per; k++) q[k] = (code[g * per + k] >> shift) & mask;
            int m = per, width = w;
            for (; m > 1; m >>= 1, width <<= 1)
                for (int k = 0; k < m / 2; k++) q[k] = combine(q[2 * k], q[2 * k + 1], width);
            narrow8(out + 8 * g, q[0]);
        }
        return;
    }
    const int32_t *c = (const int32_t *)code; /* short groups (hi_eighths): scalar */
    const int n = nv * 8;
    for (int j = 0; j < n / per; j++) {
        unsigned b = 0;
        for (int k = 0; k < per; k++) b |= (unsigned)((c[j * per + k] >> shift) & mask) << (w * k);
        out[j] = (uint8_t)b;
    }
}

TW_AI int pack_group(const vi *code, int nv, int bits, uint8_t *out) {
    int w[3], np = plane_widths(bits, w), shift = 0, off = 0;
    for (int p = 0; p < np; p++) {
        pack_plane(code, nv, w[p], shift, out + off);
        off += nv * w[p];
        shift += w[p];
    }
    return off;
}

/* inverse of combine: lanes of q hold pairs (low w bits first); returns them interleaved */
TW_AI void split(vi q, int w, vi *lo_out, vi *hi_out) {
    const vi lo = q & ((1 << w) - 1), hi = q >> w;
    *lo_out = SHUF(lo, hi, 0, 8, 1, 9, 2, 10, 3, 11);
    *hi_out = SHUF(lo, hi, 4, 12, 5, 13, 6, 14, 7, 15);
}

/* One plane of width w into bits shift.. of the codes (the first plane, shift 0, assigns). */
TW_AI void unpack_plane(const uint8_t *in, int nv, int w, int shift, vi *code) {
    const int per = 8 / w;
    if (nv % per == 0) {
        for (int g = 0; g < nv / per; g++) {
            vi q[8];
            q[0] = widen8(in + 8 * g);
            int m = 1, width = 8 / 2;
            for (; m < per; m <<= 1, width >>= 1)
                for (int k = m - 1; k >= 0; k--) split(q[k], width, &q[2 * k], &q[2 * k + 1]);
            for (int k = 0; k < per; k++) code[g * per + k] = shift ? code[g * per + k] | (q[k] << shift) : q[k];
        }
        return;
    }
    int32_t *c = (int32_t *)code;
    const int n = nv * 8;
    const int32_t mask = (1 << w) - 1;
    for (int j = 0; j < n / per; j++)
        for (int k = 0; k < per; k++) {
            const int32_t v = ((in[j] >> (w * k)) & mask) << shift;
            c[j * per + k] = shift ? c[j * per + k] | v : v;
        }
}

TW_AI int unpack_group(const uint8_t *in, int nv, int bits, vi *code) {
    int w[3], np = plane_widths(bits, w), shift = 0, off = 0;
    for (int p = 0; p < np; p++) {
        unpack_plane(in + off, nv, w[p], shift, code);
        off += nv * w[p];
        shift += w[p];
    }
    return off;
}

/* ---------------------------------------------------------------- per-stream tables */
typedef struct {
    vf s1[TW_MAXV], s2[TW_MAXV];
    vf bnd[2][63];       /* broadcast boundaries: [0] low group (bits), [1] high group (bits+1) */
    vf lev[2][8];        /* levels as vectors (2^w <= 64 floats) */
    vf lev2[2][8];       /* squared levels, lev * lev in fp32 */
    int nb[2], nl[2];    /* boundaries, levels (padded to >= 8) */
} tables;

TW_AI void make_tables(const tw_stream_ctx *s, tables *tb) {
    const tw_codec *c = s->c;
    for (int j = 0; j < s->D / 8; j++) {
        tb->s1[j] = ldf(c->s1 + 8 * j);
        tb->s2[j] = ldf(c->s2 + 8 * j);
    }
    for (int g = 0; g < 2; g++) {
        const int bits = s->spec->bits + g;
        if (g && !s->n_hi) break;
        const int nl = 1 << bits;
        tb->nb[g] = nl - 1;
        tb->nl[g] = nl < 8 ? 8 : nl;
        float lev[64], lev2[64];
        for (int i = 0; i < 64; i++) {
            const float l = c->levels[bits][i < nl ? i : nl - 1];
            lev[i] = l;
            lev2[i] = l * l;
        }
        for (int k = 0; k < 8; k++) {
            tb->lev[g][k] = ldf(lev + 8 * k);
            tb->lev2[g][k] = ldf(lev2 + 8 * k);
        }
        for (int k = 0; k < nl - 1; k++) tb->bnd[g][k] = bcast(c->bounds[bits][k]);
    }
}

/* ---------------------------------------------------------------- row codecs */
TW_AI const uint16_t *cache_row(const tw_stream_ctx *s, int64_t t, int64_t h) {
    const tw_cache *c = s->cache;
    const int64_t *st = s->kv ? c->v_stride : c->k_stride;
    const int64_t *so = s->kv ? c->v_slot_off : c->k_slot_off;
    const uint16_t *base = s->kv ? c->v : c->k;
    const int64_t slot = so ? so[s->slots[t]] : s->slots[t] * st[1];
    return base + s->blocks[t] * st[0] + slot + h * st[2];
}

TW_AI uint16_t *cache_row_mut(const tw_stream_ctx *s, int64_t t, int64_t h) {
    return (uint16_t *)cache_row(s, t, h);
}

TW_AI const int64_t *dim_table(const tw_stream_ctx *s) {
    return s->kv ? s->cache->v_dim_off : s->cache->k_dim_off;
}

TW_AI int64_t dim_stride(const tw_stream_ctx *s) {
    return s->kv ? s->cache->v_stride[3] : s->cache->k_stride[3];
}

/* Whether a cache row is D contiguous elements (no dim table, unit dim stride). */
TW_AI int row_is_contiguous(const tw_stream_ctx *s) {
    return !dim_table(s) && dim_stride(s) == 1;
}

/* A cache row as D contiguous elements: the row itself (contiguous) or gathered into tmp through
 * the dim stride (keys stored transposed per block) or the dim table (AMX tiles): the encoder
 * then needs no scratch copy of the cache. */
TW_AI const uint16_t *row_in(const tw_stream_ctx *s, int64_t t, int64_t h, uint16_t *tmp) {
    const uint16_t *p = cache_row(s, t, h);
    const int64_t *dt = dim_table(s);
    if (dt) {
        for (int64_t i = 0; i < s->D; i++) tmp[i] = p[dt[i]];
        return tmp;
    }
    const int64_t ds = dim_stride(s);
    if (ds == 1) return p;
    for (int64_t i = 0; i < s->D; i++) tmp[i] = p[i * ds];
    return tmp;
}

/* Where a decoded row is stored: the cache row itself, or tmp to be scattered by row_commit. */
TW_AI uint16_t *row_out(const tw_stream_ctx *s, int64_t t, int64_t h, uint16_t *tmp) {
    return row_is_contiguous(s) ? cache_row_mut(s, t, h) : tmp;
}

/* The i-th row visited: token-major (t, h) for contiguous rows, head-major otherwise, so a
 * transposed or tiled (block, head) region stays in L1 while its tokens are visited. */
TW_AI void row_at(const tw_stream_ctx *s, int64_t i, int64_t *t, int64_t *h) {
    if (row_is_contiguous(s)) {
        *t = i / s->H;
        *h = i - *t * s->H;
    } else {
        *h = i / s->T;
        *t = i - *h * s->T;
    }
}

TW_AI void row_commit(const tw_stream_ctx *s, int64_t t, int64_t h, const uint16_t *tmp) {
    if (row_is_contiguous(s)) return;
    uint16_t *p = cache_row_mut(s, t, h);
    const int64_t *dt = dim_table(s);
    if (dt) {
        for (int64_t i = 0; i < s->D; i++) p[dt[i]] = tmp[i];
        return;
    }
    const int64_t ds = dim_stride(s);
    for (int64_t i = 0; i < s->D; i++) p[i * ds] = tmp[i];
}

/* code = #{k : v > B_k} (NaN compares false everywhere: code 0, as in the reference) */
TW_AI vi count_codes(vf v, const vf *bnd, int nb) {
    vi c = {0};
    for (int k = 0; k < nb; k++) c -= (vi)(v > bnd[k]);
    return c;
}

/* One centred vector x (nv vectors) -> packed codes + fp16 scale (FORMAT.md lloyd steps 2..5) */
/* BITS: the stream's bit width as a compile-time constant (0: read it from the spec; used
 * with hi_eighths groups) */
TW_AI void lloyd_encode_row(const tw_stream_ctx *s, const tables *tb, const vf *x, int nv,
                            uint8_t *codes_out, uint8_t *scale_out, const int BITS) {
    const int bits = BITS ? BITS : s->spec->bits, nhv = BITS ? 0 : s->n_hi / 8;
    const int nl_lo = BITS ? (BITS < 3 ? 8 : 1 << BITS) : tb->nl[0];
    const int nb_lo = BITS ? (1 << BITS) - 1 : tb->nb[0];
    vf u[TW_MAXV], t[TW_MAXV];
    vi code[TW_MAXV];
    for (int j = 0; j < nv; j++) u[j] = x[j] * tb->s1[j];
    vfwht(u, nv);
    for (int j = 0; j < nv; j++) t[j] = x[j] * x[j];
    const float n = sqrtf(vfold(t, nv));
    const float inv = n > 0.0f ? 1.0f / n : 0.0f;
    const vf vinv = bcast(inv);
    for (int j = 0; j < nhv; j++) {
        code[j] = count_codes((u[j] * tb->s2[j]) * vinv, tb->bnd[1], tb->nb[1]);
        t[j] = lookup(tb->lev2[1], tb->nl[1], code[j]);
    }
    for (int j = nhv; j < nv; j++) {
        code[j] = count_codes((u[j] * tb->s2[j]) * vinv, tb->bnd[0], nb_lo);
        t[j] = lookup(tb->lev2[0], nl_lo, code[j]);
    }
    const float cn = sqrtf(vfold(t, nv));
    const float sqrt_d = (float)sqrt((double)(nv * 8));
    float scale = n / (sqrt_d * cn);
    scale = scale > 65504.0f ? 65504.0f : scale;
    st16(scale_out, f32_f16(scale));
    int off = 0;
    if (nhv) off = pack_group(code, nhv, bits + 1, codes_out);
    pack_group(code + nhv, nv - nhv, bits, codes_out + off);
}

TW_AI void lloyd_decode_row(const tw_stream_ctx *s, const tables *tb, const uint8_t *codes_in,
                            float scale, const vf *mean, int nv, vf *out, const int BITS) {
    const int bits = BITS ? BITS : s->spec->bits, nhv = BITS ? 0 : s->n_hi / 8;
    const int nl_lo = BITS ? (BITS < 3 ? 8 : 1 << BITS) : tb->nl[0];
    vi code[TW_MAXV];
    int off = 0;
    if (nhv) off = unpack_group(codes_in, nhv, bits + 1, code);
    unpack_group(codes_in + off, nv - nhv, bits, code + nhv);
    for (int j = 0; j < nhv; j++) out[j] = lookup(tb->lev[1], tb->nl[1], code[j]) * tb->s2[j];
    for (int j = nhv; j < nv; j++) out[j] = lookup(tb->lev[0], nl_lo, code[j]) * tb->s2[j];
    vfwht(out, nv);
    const vf vs = bcast(scale);
    if (mean) {
        for (int j = 0; j < nv; j++) out[j] = ((out[j] * tb->s1[j]) * vs) + mean[j];
    } else {
        for (int j = 0; j < nv; j++) out[j] = (out[j] * tb->s1[j]) * vs;
    }
}

/* one compiled copy of the row codecs per bit width (constants fold the packing and the
 * lookups); width 0 reads it from the spec (hi_eighths groups) */
typedef void (*enc_row_fn)(const tw_stream_ctx *, const tables *, const vf *, int, uint8_t *, uint8_t *);
typedef void (*dec_row_fn)(const tw_stream_ctx *, const tables *, const uint8_t *, float, const vf *, int, vf *);
#define TW_ROWS(B)                                                                                 \
    static void enc_row_##B(const tw_stream_ctx *s, const tables *tb, const vf *x, int nv,          \
                            uint8_t *codes, uint8_t *scale) {                                       \
        lloyd_encode_row(s, tb, x, nv, codes, scale, B);                                            \
    }                                                                                               \
    static void dec_row_##B(const tw_stream_ctx *s, const tables *tb, const uint8_t *codes, float sc, \
                            const vf *mean, int nv, vf *out) {                                      \
        lloyd_decode_row(s, tb, codes, sc, mean, nv, out, B);                                       \
    }
TW_ROWS(0)
TW_ROWS(1)
TW_ROWS(2)
TW_ROWS(3)
TW_ROWS(4)
TW_ROWS(5)
TW_ROWS(6)
static const enc_row_fn enc_rows[7] = {enc_row_0, enc_row_1, enc_row_2, enc_row_3, enc_row_4, enc_row_5, enc_row_6};
static const dec_row_fn dec_rows[7] = {dec_row_0, dec_row_1, dec_row_2, dec_row_3, dec_row_4, dec_row_5, dec_row_6};

TW_AI int row_variant(const tw_stream_ctx *s) { return s->n_hi ? 0 : s->spec->bits; }

/* ---------------------------------------------------------------- streams */
/* Sum over tokens [lo, lo+n) (n a power of two) of all H*D values, tokens past T being zero
 * padding: the reference's token fold, tree for tree. */
static void fold_tokens(const tw_stream_ctx *s, int64_t lo, int64_t n, float *out, float *scratch) {
    const int64_t HD = s->H * s->D;
    if (lo >= s->T) {
        for (int64_t i = 0; i < HD; i++) out[i] = 0.0f;
        return;
    }
    if (n == 1) {
        uint16_t tmp[256];
        for (int64_t h = 0; h < s->H; h++) {
            const uint16_t *src = row_in(s, lo, h, tmp);
            for (int64_t j = 0; j < s->D / 8; j++) stf(out + h * s->D + 8 * j, ld_row(src + 8 * j, s->cache->dtype));
        }
        return;
    }
    const int64_t half = n >> 1;
    fold_tokens(s, lo, half, out, scratch);
    if (lo + half >= s->T) {
        for (int64_t i = 0; i < HD; i++) out[i] = out[i] + 0.0f; /* the zero padding: -0 -> +0 */
        return;
    }
    fold_tokens(s, lo + half, half, scratch, scratch + HD);
    for (int64_t i = 0; i < HD; i++) out[i] = out[i] + scratch[i];
}

static void encode_lloyd(tw_stream_ctx *s, const int D) {
    const enc_row_fn row = enc_rows[row_variant(s)];
    const int nv = D / 8;
    const int64_t T = s->T, H = s->H;
    const int dtype = s->cache->dtype;
    uint8_t *base = s->base;
    tables tb;
    make_tables(s, &tb);
    float *mean = NULL;
    if (s->spec->center) {
        const int64_t HD = H * D;
        int64_t padded = 1;
        while (padded < T) padded <<= 1;
        float *sum = s->scratch, *rest = s->scratch + HD;
        mean = s->scratch; /* reuses sum's storage after the division */
        fold_tokens(s, 0, padded, sum, rest);
        const float tf = (float)T;
        for (int64_t i = 0; i < HD; i++) {
            const uint16_t m16 = f32_f16(sum[i] / tf);
            st16(base + s->mean_off + i * 2, m16);
            mean[i] = f16_f32(m16);
        }
    }
    uint16_t tmp[256];
    for (int64_t t = 0; t < s->sink_rows; t++)
        for (int64_t h = 0; h < H; h++)
            memcpy(base + s->sink_off + ((t * H + h) * D) * 2, row_in(s, t, h, tmp), (size_t)D * 2);
    /* rows in row_at order (token-major unless keys are transposed) */
    for (int64_t i = 0; i < T * H; i++) {
        {
            int64_t t, h;
            row_at(s, i, &t, &h);
            const int64_t r = t * H + h;
            const uint16_t *src = row_in(s, t, h, tmp);
            vf x[TW_MAXV];
            if (mean) {
                const float *m = mean + h * D;
                for (int j = 0; j < nv; j++) x[j] = ld_row(src + 8 * j, dtype) - ldf(m + 8 * j);
            } else {
                for (int j = 0; j < nv; j++) x[j] = ld_row(src + 8 * j, dtype);
            }
            row(s, &tb, x, nv, base + s->codes_off + r * s->row_bytes, base + s->scales_off + r * 2);
        }
    }
}

/* e4m3fn of 8 lanes (the scalar f32_e4m3, branch-free) */
TW_AI vb to_e4m3(vf v) {
    vu fb = (vu)v;
    const vu sign = fb & 0x80000000u;
    fb ^= sign;
    const vu sat = sel((vi)(fb > 0x7F800000u), (vu){0x7F, 0x7F, 0x7F, 0x7F, 0x7F, 0x7F, 0x7F, 0x7F},
                       (vu){0x7E, 0x7E, 0x7E, 0x7E, 0x7E, 0x7E, 0x7E, 0x7E}); /* NaN / > 464 */
    const uint32_t dm = 141u << 23;
    const vu den = ((vu)((vf)fb + bcast(u2f(dm))) - dm) & 0xFFu;
    const vu nor = ((fb + (((uint32_t)(7 - 127) << 23) + 0x7FFFFu) + ((fb >> 20) & 1u)) >> 20) & 0xFFu;
    vu r = sel((vi)(fb < (121u << 23)), den, nor);
    r = sel((vi)(fb > 0x43E80000u), sat, r);
    return __builtin_convertvector(r | (sign >> 24), vb);
}

static void encode_fp8(tw_stream_ctx *s, const int D) {
    const int nv = D / 8;
    const int64_t T = s->T, H = s->H;
    const int dtype = s->cache->dtype;
    uint8_t *base = s->base;
    uint16_t tmp[256];
    for (int64_t i = 0; i < T * H; i++) {
        {
            int64_t t, h;
            row_at(s, i, &t, &h);
            const int64_t r = t * H + h;
            const uint16_t *src = row_in(s, t, h, tmp);
            vf x[TW_MAXV];
            vu amax = {0};
            for (int j = 0; j < nv; j++) {
                x[j] = ld_row(src + 8 * j, dtype);
                const vu a = (vu)x[j] & 0x7FFFFFFFu; /* |x|; NaN-free data: max of the bits */
                amax = sel((vi)((vf)a > (vf)amax), a, amax);
            }
            float am = 0.0f;
            for (int l = 0; l < 8; l++) am = ((vf)amax)[l] > am ? ((vf)amax)[l] : am;
            float sc = am / 448.0f;
            sc = sc > 65504.0f ? 65504.0f : sc;
            const uint16_t sc16 = f32_f16(sc);
            st16(base + s->scales_off + r * 2, sc16);
            const float s32 = f16_f32(sc16);
            const vf inv = bcast(s32 > 0.0f ? 1.0f / s32 : 0.0f);
            uint8_t *out = base + s->codes_off + r * D;
            for (int j = 0; j < nv; j++) {
                vf v = x[j] * inv;
                v = (vf)sel((vi)(v < bcast(-448.0f)), (vu)bcast(-448.0f), (vu)v);
                v = (vf)sel((vi)(v > bcast(448.0f)), (vu)bcast(448.0f), (vu)v);
                const vb codes = to_e4m3(v);
                memcpy(out + 8 * j, &codes, 8);
            }
        }
    }
}

TW_AI void encode_stream_d(tw_stream_ctx *s, const int D) {
    if (s->spec->kind == TW_RAW) {
        uint16_t tmp[256];
        for (int64_t i = 0; i < s->T * s->H; i++) {
            int64_t t, h;
            row_at(s, i, &t, &h);
            memcpy(s->base + s->data_off + ((t * s->H + h) * D) * 2, row_in(s, t, h, tmp), (size_t)D * 2);
        }
    } else if (s->spec->kind == TW_FP8) {
        encode_fp8(s, D);
    } else {
        encode_lloyd(s, D);
    }
}

static void decode_lloyd(tw_stream_ctx *s, const int D) {
    const dec_row_fn row = dec_rows[row_variant(s)];
    const int nv = D / 8;
    const int64_t T = s->T, H = s->H;
    const int dst = s->cache->dtype, src = s->src_dtype;
    const uint8_t *base = s->base;
    tables tb;
    make_tables(s, &tb);
    float *mean = NULL;
    if (s->spec->center) {
        mean = s->scratch;
        for (int64_t i = 0; i < H * D; i++) mean[i] = f16_f32(ld16(base + s->mean_off + i * 2));
    }
    uint16_t tmp[256];
    for (int64_t i = 0; i < T * H; i++) {
        {
            int64_t t, h;
            row_at(s, i, &t, &h);
            const int64_t r = t * H + h;
            uint16_t *out = row_out(s, t, h, tmp);
            if (t < s->sink_rows) {
                copy_row(base + s->sink_off + r * D * 2, src, dst, out, D);
            } else {
                const float sc = f16_f32(ld16(base + s->scales_off + r * 2));
                vf x[TW_MAXV];
                row(s, &tb, base + s->codes_off + r * s->row_bytes, sc, mean ? (const vf *)(mean + h * D) : NULL, nv, x);
                for (int j = 0; j < nv; j++) st_row(out + 8 * j, x[j], src, dst);
            }
            row_commit(s, t, h, out);
        }
    }
}

static void decode_fp8(tw_stream_ctx *s, const int D) {
    const int nv = D / 8;
    const int64_t T = s->T, H = s->H;
    const int dst = s->cache->dtype, src = s->src_dtype;
    const uint8_t *base = s->base;
    float lut[256];
    for (int i = 0; i < 256; i++) {
        /* e4m3fn: bias 7, no infinities, 0x7F/0xFF NaN */
        const int e = (i >> 3) & 15, m = i & 7;
        float v = e ? ldexpf((float)(8 + m), e - 10) : ldexpf((float)m, -9);
        if ((i & 0x7F) == 0x7F) v = NAN;
        lut[i] = (i & 0x80) ? -v : v;
    }
    uint16_t tmp[256];
    for (int64_t i = 0; i < T * H; i++) {
        {
            int64_t t, h;
            row_at(s, i, &t, &h);
            const int64_t r = t * H + h;
            const vf sc = bcast(f16_f32(ld16(base + s->scales_off + r * 2)));
            const uint8_t *in = base + s->codes_off + r * D;
            uint16_t *out = row_out(s, t, h, tmp);
            for (int j = 0; j < nv; j++) {
                vf v;
                for (int l = 0; l < 8; l++) v[l] = lut[in[8 * j + l]];
                st_row(out + 8 * j, v * sc, src, dst);
            }
            row_commit(s, t, h, out);
        }
    }
}

TW_AI void decode_stream_d(tw_stream_ctx *s, const int D) {
    if (s->spec->kind == TW_RAW) {
        uint16_t tmp[256];
        for (int64_t i = 0; i < s->T * s->H; i++) {
            int64_t t, h;
            row_at(s, i, &t, &h);
            uint16_t *out = row_out(s, t, h, tmp);
            copy_row(s->base + s->data_off + ((t * s->H + h) * D) * 2, s->src_dtype,
                     s->cache->dtype, out, D);
            row_commit(s, t, h, out);
        }
    } else if (s->spec->kind == TW_FP8) {
        decode_fp8(s, D);
    } else {
        decode_lloyd(s, D);
    }
}

static void TW_FN(encode_stream)(tw_stream_ctx *s) { encode_stream_d(s, (int)s->D); }

static void TW_FN(decode_stream)(tw_stream_ctx *s) { decode_stream_d(s, (int)s->D); }

static uint32_t TW_FN(wsum32)(const uint8_t *p, int64_t n) {
    uint32_t sum = 0, w = 1;
    const int64_t nw = n / 4;
    for (int64_t i = 0; i < nw; i++) {
        uint32_t v;
        memcpy(&v, p + 4 * i, 4);
        sum += v * w;
        w += 2;
    }
    return sum;
}

static void TW_FN(convert)(const float *in, int64_t n, int kind, void *out) {
    int64_t i = 0;
    if (kind == 0) {
        uint16_t *o = out;
        for (; i + 8 <= n; i += 8) st_h(o + i, to_bf16(ldf(in + i)));
        for (; i < n; i++) o[i] = f32_bf16(in[i]);
    } else if (kind == 1) {
        uint16_t *o = out;
        for (; i + 8 <= n; i += 8) st_h(o + i, to_f16(ldf(in + i)));
        for (; i < n; i++) o[i] = f32_f16(in[i]);
    } else if (kind == 2) {
        uint8_t *o = out;
        for (; i + 8 <= n; i += 8) {
            const vb c = to_e4m3(ldf(in + i));
            memcpy(o + i, &c, 8);
        }
        for (; i < n; i++) o[i] = f32_e4m3(in[i]);
    } else if (kind == 5) { /* 3..5: the scalar versions (scales, tails), for the tests */
        uint8_t *o = out;
        for (; i < n; i++) o[i] = f32_e4m3(in[i]);
    } else {
        uint16_t *o = out;
        for (; i < n; i++) o[i] = kind == 3 ? f32_bf16(in[i]) : f32_f16(in[i]);
    }
}

const tw_kernels TW_CAT(tw_kernels, TW_VARIANT) = {
    TW_FN(encode_stream),
    TW_FN(decode_stream),
    TW_FN(wsum32),
    TW_FN(convert),
};
