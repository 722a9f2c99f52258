/* turbowire CPU codec: chunk layout, header, checksums, validation of every remote index, and
 * the per-item loops. The hot loops live in twcpu_impl.h (one copy per ISA, chosen at run time).
 *
 * Validation before any pointer arithmetic: block ids (range, count, repeats), token ranges,
 * staging/source byte ranges; decode verifies every item of a call (header, checksums,
 * compatibility, destination) before the first write into the cache.
 */
#include <stdlib.h>
#include <string.h>

#include "twcpu.h"

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "turbowire's CPU codec assumes a little-endian host (the wire format is little-endian)"
#endif

#define HEADER_BYTES 48
#define FORMAT_VERSION 1
#define MAX_CHUNK_TOKENS 65536

/* ---------------------------------------------------------------- ISA selection */
static const tw_kernels *kern = NULL;
static int kern_isa = -1;

static int isa_supported(int isa) {
    if (isa == TW_ISA_BASE) return 1;
#if (defined(__x86_64__) || defined(_M_X64)) && defined(__GNUC__)
    __builtin_cpu_init();
    if (isa == TW_ISA_V2)
        return __builtin_cpu_supports("sse4.2") && __builtin_cpu_supports("popcnt") &&
               __builtin_cpu_supports("ssse3");
    if (isa == TW_ISA_V3)
        return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("bmi2") &&
               __builtin_cpu_supports("sse4.2") && __builtin_cpu_supports("popcnt");
#endif
    return 0;
}

static void use_isa(int isa) {
#if defined(__x86_64__) || defined(_M_X64)
    if (isa == TW_ISA_V3) { kern = &tw_kernels_v3; kern_isa = isa; return; }
    if (isa == TW_ISA_V2) { kern = &tw_kernels_v2; kern_isa = isa; return; }
#endif
    kern = &tw_kernels_base;
    kern_isa = TW_ISA_BASE;
}

static void ensure_kernels(void) {
    if (kern) return;
    if (isa_supported(TW_ISA_V3)) use_isa(TW_ISA_V3);
    else if (isa_supported(TW_ISA_V2)) use_isa(TW_ISA_V2);
    else use_isa(TW_ISA_BASE);
}

int tw_abi_version(void) { return TW_ABI_VERSION; }

int tw_isa(void) {
    ensure_kernels();
    return kern_isa;
}

int tw_set_isa(int isa) {
    ensure_kernels();
    if ((isa == TW_ISA_BASE || isa == TW_ISA_V2 || isa == TW_ISA_V3) && isa_supported(isa)) use_isa(isa);
    return kern_isa;
}

void tw_convert_f32(const float *in, int64_t n, int kind, void *out) {
    ensure_kernels();
    kern->convert(in, n, kind, out);
}

uint32_t tw_wsum32(const uint8_t *p, int64_t n) {
    ensure_kernels();
    return kern->wsum32(p, n);
}

/* ---------------------------------------------------------------- layout */
typedef struct {
    int64_t nbytes, sink_rows;
    int64_t mean_off, sink_off, codes_off, scales_off, data_off;
    int32_t row_bytes, n_hi;
    int n_sections;
    int64_t sec_end[4]; /* end of each section's bytes (zero padding follows up to 16) */
} slayout;

static int64_t align16(int64_t n) { return (n + 15) & ~(int64_t)15; }

static int spec_ok(const tw_spec *sp, int64_t D) {
    if (sp->kind == TW_RAW || sp->kind == TW_FP8) return 1;
    if (sp->kind != TW_LLOYD || sp->bits < 1 || sp->bits > 6 || sp->sink_tokens < 0) return 0;
    if (sp->hi_eighths < 0 || sp->hi_eighths > 7 || (sp->hi_eighths && sp->bits >= 6)) return 0;
    return D == 64 || D == 128 || D == 256;
}

static void stream_layout(const tw_spec *sp, int64_t T, int64_t H, int64_t D, int seq_start,
                          slayout *L) {
    int64_t off = 0;
    memset(L, 0, sizeof *L);
#define ADD(field, size)                                  \
    do {                                                  \
        L->field = off;                                   \
        L->sec_end[L->n_sections++] = off + (size);       \
        off = align16(off + (size));                      \
    } while (0)
    if (sp->kind == TW_RAW) {
        ADD(data_off, T * H * D * 2);
    } else if (sp->kind == TW_FP8) {
        ADD(scales_off, T * H * 2);
        ADD(codes_off, T * H * D);
    } else {
        if (sp->center) ADD(mean_off, H * D * 2);
        L->sink_rows = seq_start ? (sp->sink_tokens < T ? sp->sink_tokens : T) : 0;
        if (L->sink_rows) ADD(sink_off, L->sink_rows * H * D * 2);
        L->n_hi = (int32_t)(D * sp->hi_eighths / 8);
        L->row_bytes = (int32_t)(L->n_hi * (sp->bits + 1) / 8 + (D - L->n_hi) * sp->bits / 8);
        ADD(codes_off, T * H * L->row_bytes);
        ADD(scales_off, T * H * 2);
    }
#undef ADD
    L->nbytes = off;
}

static void zero_pads(uint8_t *stream, const slayout *L) {
    for (int i = 0; i < L->n_sections; i++) {
        const int64_t end = L->sec_end[i];
        memset(stream + end, 0, (size_t)(align16(end) - end));
    }
}

int64_t tw_chunk_nbytes(const tw_codec *c, int64_t tokens, int64_t heads, int64_t token_offset) {
    slayout k, v;
    stream_layout(&c->k, tokens, heads, c->head_dim, token_offset == 0, &k);
    stream_layout(&c->v, tokens, heads, c->head_dim, token_offset == 0, &v);
    return HEADER_BYTES + k.nbytes + v.nbytes;
}

/* ---------------------------------------------------------------- header */
static void put16(uint8_t *p, uint32_t v) { p[0] = (uint8_t)v; p[1] = (uint8_t)(v >> 8); }
static void put32(uint8_t *p, uint32_t v) { put16(p, v & 0xFFFF); put16(p + 2, v >> 16); }
static void put64(uint8_t *p, uint64_t v) { put32(p, (uint32_t)v); put32(p + 4, (uint32_t)(v >> 32)); }
static uint32_t get16(const uint8_t *p) { return (uint32_t)p[0] | ((uint32_t)p[1] << 8); }
static uint32_t get32(const uint8_t *p) { return get16(p) | (get16(p + 2) << 16); }
static uint64_t get64(const uint8_t *p) { return (uint64_t)get32(p) | ((uint64_t)get32(p + 4) << 32); }

typedef struct {
    uint32_t version, hunits, preset_id, layer, num_layers, heads, head_dim, dtype, flags, reserved;
    uint32_t tokens, offset, body, body_check, head_check;
    uint64_t tag;
} header;

static void write_header(uint8_t *p, const tw_codec *c, int64_t H, int dtype, int64_t T,
                         int64_t offset, int64_t body, uint64_t tag, uint32_t body_check) {
    memcpy(p, "TWKV", 4);
    p[4] = FORMAT_VERSION;
    p[5] = HEADER_BYTES / 16;
    put16(p + 6, (uint32_t)c->preset_id);
    put16(p + 8, (uint32_t)c->layer);
    put16(p + 10, (uint32_t)c->num_layers);
    put16(p + 12, (uint32_t)H);
    put16(p + 14, (uint32_t)c->head_dim);
    p[16] = (uint8_t)dtype;
    p[17] = offset == 0 ? 1 : 0;
    put16(p + 18, 0);
    put32(p + 20, (uint32_t)T);
    put32(p + 24, (uint32_t)offset);
    put32(p + 28, (uint32_t)body);
    put64(p + 32, tag);
    put32(p + 40, body_check);
    put32(p + 44, kern->wsum32(p, 44));
}

static void read_header(const uint8_t *p, header *h) {
    h->version = p[4];
    h->hunits = p[5];
    h->preset_id = get16(p + 6);
    h->layer = get16(p + 8);
    h->num_layers = get16(p + 10);
    h->heads = get16(p + 12);
    h->head_dim = get16(p + 14);
    h->dtype = p[16];
    h->flags = p[17];
    h->reserved = get16(p + 18);
    h->tokens = get32(p + 20);
    h->offset = get32(p + 24);
    h->body = get32(p + 28);
    h->tag = get64(p + 32);
    h->body_check = get32(p + 40);
    h->head_check = get32(p + 44);
}

/* ---------------------------------------------------------------- validation */
static int set_err(tw_error *err, int code, int64_t item, int64_t detail) {
    if (err) {
        err->code = code;
        err->item = (int32_t)item;
        err->detail = detail;
    }
    return code;
}

/* The request's block ids and token range (same rules as PagedKVLayout.token_index). */
static int check_tokens(const tw_cache *cache, const tw_item *it, uint8_t *seen) {
    const int64_t bs = cache->block_size;
    if (it->num_tokens <= 0 || it->token_start < 0 || it->n_block_ids < 0) return TW_E_BLOCK;
    if (it->token_start > INT64_MAX - it->num_tokens) return TW_E_BLOCK;
    const int64_t last = it->token_start + it->num_tokens - 1;
    if (last / bs >= it->n_block_ids) return TW_E_BLOCK;
    if (it->n_block_ids && !it->block_ids) return TW_E_BLOCK;
    int rc = TW_OK;
    int64_t i;
    for (i = 0; i < it->n_block_ids; i++) {
        const int64_t id = it->block_ids[i];
        if (id == TW_NO_BLOCK) continue; /* an entry the request does not hold */
        if (id < 0 || id >= cache->num_blocks) { rc = TW_E_BLOCK; break; }
        if (seen[id >> 3] & (1u << (id & 7))) { rc = TW_E_BLOCK; break; }
        seen[id >> 3] |= (uint8_t)(1u << (id & 7));
    }
    for (int64_t j = 0; j < i; j++) { /* leave the bitmap clean for the next item */
        const int64_t id = it->block_ids[j];
        if (id == TW_NO_BLOCK) continue;
        seen[id >> 3] &= (uint8_t)~(1u << (id & 7));
    }
    /* the tokens' own blocks must be held */
    for (int64_t b = it->token_start / bs; rc == TW_OK && b <= last / bs; b++)
        if (it->block_ids[b] == TW_NO_BLOCK) rc = TW_E_BLOCK;
    return rc;
}

static int check_common(const tw_codec *c, const tw_cache *cache) {
    if (!c || !cache || !cache->k || !cache->v) return TW_E_ARG;
    if (c->head_dim != 64 && c->head_dim != 128 && c->head_dim != 256) return TW_E_ARG;
    if (!spec_ok(&c->k, c->head_dim) || !spec_ok(&c->v, c->head_dim)) return TW_E_ARG;
    if (cache->dtype != TW_BF16 && cache->dtype != TW_F16) return TW_E_ARG;
    if (cache->block_size <= 0 || cache->num_blocks < 0 || cache->num_heads <= 0 ||
        cache->num_heads >= 65536)
        return TW_E_ARG;
    for (int kv = 0; kv < 2; kv++) {
        const tw_spec *sp = kv ? &c->v : &c->k;
        if (sp->kind != TW_LLOYD) continue;
        const int b = sp->bits;
        if (!c->levels[b] || !c->bounds[b] || (sp->hi_eighths && (!c->levels[b + 1] || !c->bounds[b + 1])))
            return TW_E_ARG;
    }
    return c->s1 && c->s2 ? TW_OK : TW_E_ARG;
}

/* ---------------------------------------------------------------- per-item work */
typedef struct {
    int64_t *blocks, *slots;
    float *scratch;
    int64_t cap_tokens, cap_scratch;
} work;

static int work_reserve(work *w, int64_t T, int64_t scratch_floats) {
    if (T > w->cap_tokens) {
        int64_t *b = realloc(w->blocks, (size_t)T * sizeof(int64_t));
        if (!b) return TW_E_NOMEM;
        w->blocks = b;
        int64_t *s = realloc(w->slots, (size_t)T * sizeof(int64_t));
        if (!s) return TW_E_NOMEM;
        w->slots = s;
        w->cap_tokens = T;
    }
    if (scratch_floats > w->cap_scratch) {
        free(w->scratch);
        w->scratch = aligned_alloc(64, (size_t)align16(scratch_floats) * sizeof(float) + 64);
        if (!w->scratch) { w->cap_scratch = 0; return TW_E_NOMEM; }
        w->cap_scratch = scratch_floats;
    }
    return TW_OK;
}

static void work_free(work *w) {
    free(w->blocks);
    free(w->slots);
    free(w->scratch);
}

static void token_map(const tw_cache *cache, const tw_item *it, work *w) {
    const int64_t bs = cache->block_size;
    for (int64_t t = 0; t < it->num_tokens; t++) {
        const int64_t p = it->token_start + t;
        w->blocks[t] = it->block_ids[p / bs];
        w->slots[t] = p % bs;
    }
}

static int64_t fold_levels(int64_t T) {
    int64_t l = 0;
    while (((int64_t)1 << l) < T) l++;
    return l;
}

static void fill_ctx(tw_stream_ctx *s, const tw_codec *c, const tw_cache *cache, int kv,
                     const slayout *L, int64_t T, int64_t H, const work *w, uint8_t *base, int src_dtype) {
    s->c = c;
    s->cache = cache;
    s->spec = kv ? &c->v : &c->k;
    s->kv = kv;
    s->T = T;
    s->H = H;
    s->D = c->head_dim;
    s->blocks = w->blocks;
    s->slots = w->slots;
    s->src_dtype = src_dtype;
    s->sink_rows = L->sink_rows;
    s->base = base;
    s->mean_off = L->mean_off;
    s->sink_off = L->sink_off;
    s->codes_off = L->codes_off;
    s->scales_off = L->scales_off;
    s->data_off = L->data_off;
    s->row_bytes = L->row_bytes;
    s->n_hi = L->n_hi;
    s->scratch = w->scratch;
}

int tw_encode(const tw_codec *c, const tw_cache *cache, tw_item *items, int64_t n_items,
              uint8_t *buf, int64_t buf_len, tw_error *err) {
    ensure_kernels();
    int rc = check_common(c, cache);
    if (rc) return set_err(err, rc, -1, 0);
    const int64_t H = cache->num_heads, D = c->head_dim;
    uint8_t *seen = calloc((size_t)(cache->num_blocks / 8 + 1), 1);
    if (!seen) return set_err(err, TW_E_NOMEM, -1, 0);
    /* validate every item before writing anything */
    for (int64_t i = 0; i < n_items; i++) {
        tw_item *it = &items[i];
        rc = check_tokens(cache, it, seen);
        if (rc) { free(seen); return set_err(err, rc, i, 0); }
        if (it->num_tokens > MAX_CHUNK_TOKENS || it->token_start > 0xFFFFFFFFLL) {
            free(seen);
            return set_err(err, TW_E_ARG, i, 0);
        }
        const int64_t total = tw_chunk_nbytes(c, it->num_tokens, H, it->token_start);
        if (total - HEADER_BYTES > 0xFFFFFFFFLL) { free(seen); return set_err(err, TW_E_ARG, i, total); }
        if (it->offset < 0 || it->offset > buf_len || total > buf_len - it->offset) {
            free(seen);
            return set_err(err, TW_E_RANGE, i, total);
        }
        it->nbytes = total;
    }
    free(seen);
    work w = {0};
    for (int64_t i = 0; i < n_items; i++) {
        tw_item *it = &items[i];
        const int64_t T = it->num_tokens;
        const int start = it->token_start == 0;
        slayout L[2];
        stream_layout(&c->k, T, H, D, start, &L[0]);
        stream_layout(&c->v, T, H, D, start, &L[1]);
        if (work_reserve(&w, T, (fold_levels(T) + 2) * H * D)) {
            work_free(&w);
            return set_err(err, TW_E_NOMEM, i, 0);
        }
        token_map(cache, it, &w);
        uint8_t *chunk = buf + it->offset;
        uint8_t *body = chunk + HEADER_BYTES;
        int64_t soff = 0;
        for (int kv = 0; kv < 2; kv++) {
            tw_stream_ctx s;
            fill_ctx(&s, c, cache, kv, &L[kv], T, H, &w, body + soff, cache->dtype);
            zero_pads(body + soff, &L[kv]);
            kern->encode_stream(&s);
            soff += L[kv].nbytes;
        }
        const uint32_t check = kern->wsum32(body, soff);
        write_header(chunk, c, H, cache->dtype, T, it->token_start, soff, it->tag, check);
    }
    work_free(&w);
    return TW_OK;
}

/* Everything the reference checks before it decodes (codec.decode + dispatch), in its order. */
static int verify_item(const tw_codec *c, const tw_cache *cache, const tw_item *it, const uint8_t *buf,
                       int64_t buf_len, uint8_t *seen, header *h, int64_t *detail) {
    if (it->offset < 0 || it->nbytes < 0 || it->offset > buf_len || it->nbytes > buf_len - it->offset)
        return TW_E_RANGE;
    const uint8_t *p = buf + it->offset;
    const int64_t len = it->nbytes;
    if (len < HEADER_BYTES) return TW_E_TRUNC;
    if (memcmp(p, "TWKV", 4) != 0) return TW_E_MAGIC;
    read_header(p, h);
    if (h->version != FORMAT_VERSION) return TW_E_VERSION;
    if (h->head_check != kern->wsum32(p, 44)) return TW_E_HCHECK;
    if (h->hunits * 16 != HEADER_BYTES || h->reserved != 0) return TW_E_FORMAT;
    if (h->dtype != TW_BF16 && h->dtype != TW_F16) return TW_E_FORMAT;
    if (((h->flags & 1) != 0) != (h->offset == 0) || (h->flags & ~1u)) return TW_E_FORMAT;
    if (h->body % 16) return TW_E_FORMAT;
    if (h->layer >= h->num_layers || h->heads == 0 || h->head_dim == 0 || h->tokens == 0)
        return TW_E_FORMAT;
    if (h->preset_id != (uint32_t)c->preset_id || h->layer != (uint32_t)c->layer ||
        h->num_layers != (uint32_t)c->num_layers || h->head_dim != (uint32_t)c->head_dim ||
        (it->check_tag && h->tag != it->tag) || (int64_t)h->tokens != it->num_tokens ||
        (int64_t)h->offset != it->token_start)
        return TW_E_INCOMPAT;
    if (len < HEADER_BYTES + (int64_t)h->body) return TW_E_TRUNC;
    if (kern->wsum32(p + HEADER_BYTES, h->body) != h->body_check) return TW_E_BCHECK;
    slayout k, v;
    stream_layout(&c->k, h->tokens, h->heads, c->head_dim, h->offset == 0, &k);
    stream_layout(&c->v, h->tokens, h->heads, c->head_dim, h->offset == 0, &v);
    if (k.nbytes + v.nbytes != (int64_t)h->body) {
        *detail = k.nbytes + v.nbytes;
        return TW_E_INCOMPAT;
    }
    if ((int64_t)h->heads != cache->num_heads) {
        *detail = h->heads;
        return TW_E_HEADS;
    }
    return check_tokens(cache, it, seen);
}

int tw_decode(const tw_codec *c, const tw_cache *cache, const tw_item *items, int64_t n_items,
              const uint8_t *buf, int64_t buf_len, tw_error *err) {
    ensure_kernels();
    int rc = check_common(c, cache);
    if (rc) return set_err(err, rc, -1, 0);
    const int64_t H = cache->num_heads, D = c->head_dim;
    uint8_t *seen = calloc((size_t)(cache->num_blocks / 8 + 1), 1);
    /* the verified headers are kept: phase 2 never re-reads geometry from the (remote-written)
     * buffer, so a concurrent writer cannot change sizes between the checks and the use */
    header *hs = malloc((size_t)(n_items > 0 ? n_items : 1) * sizeof(header));
    if (!seen || !hs) {
        free(seen);
        free(hs);
        return set_err(err, TW_E_NOMEM, -1, 0);
    }
    for (int64_t i = 0; i < n_items; i++) {
        int64_t detail = 0;
        rc = verify_item(c, cache, &items[i], buf, buf_len, seen, &hs[i], &detail);
        if (rc) {
            free(seen);
            free(hs);
            return set_err(err, rc, i, detail);
        }
    }
    free(seen);
    work w = {0};
    for (int64_t i = 0; i < n_items; i++) {
        const tw_item *it = &items[i];
        const uint8_t *chunk = buf + it->offset;
        const header h = hs[i];
        const int64_t T = h.tokens;
        const int start = h.offset == 0;
        slayout L[2];
        stream_layout(&c->k, T, H, D, start, &L[0]);
        stream_layout(&c->v, T, H, D, start, &L[1]);
        if (work_reserve(&w, T, H * D)) {
            work_free(&w);
            free(hs);
            return set_err(err, TW_E_NOMEM, i, 0);
        }
        token_map(cache, it, &w);
        const uint8_t *body = chunk + HEADER_BYTES;
        int64_t soff = 0;
        for (int kv = 0; kv < 2; kv++) {
            tw_stream_ctx s;
            fill_ctx(&s, c, cache, kv, &L[kv], T, H, &w, (uint8_t *)(body + soff), (int)h.dtype);
            kern->decode_stream(&s);
            soff += L[kv].nbytes;
        }
    }
    work_free(&w);
    free(hs);
    return TW_OK;
}
