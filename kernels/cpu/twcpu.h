/* turbowire CPU codec: gather+encode and verify+decode+scatter on vLLM paged KV caches.
 *
 * The byte format and the encode numerics are codec/FORMAT.md; this code must produce the same
 * bytes as the PyTorch reference (turbowire.codec). Build flags matter: -ffp-contract=off and no
 * -ffast-math (no FMA contraction, no reassociation). The structs below are mirrored with ctypes
 * in kernels/cpu_binding.py: change both together and bump TW_ABI_VERSION.
 */
#ifndef TWCPU_H
#define TWCPU_H

#include <stdint.h>

#define TW_ABI_VERSION 3

/* stream kinds (StreamSpec.kind) */
enum { TW_RAW = 0, TW_FP8 = 1, TW_LLOYD = 2 };
/* source dtype codes of the header */
enum { TW_BF16 = 1, TW_F16 = 2 };
/* ISA variants */
enum { TW_ISA_BASE = 0, TW_ISA_V2 = 2, TW_ISA_V3 = 3 };

/* a block-list entry the request does not hold (kernels/paged.py NO_BLOCK): skipped by the
   checks, and an item whose tokens fall in one is refused (TW_E_BLOCK) */
#define TW_NO_BLOCK (-1)

/* error codes (kernels/cpu_binding.py maps them to exception types) */
enum {
    TW_OK = 0,
    TW_E_ARG = 1,        /* bad argument from the caller (geometry, spec) */
    TW_E_BLOCK = 2,      /* block ids / token range (BlockIndexError) */
    TW_E_RANGE = 3,      /* staging/source byte range (BlockIndexError) */
    TW_E_TRUNC = 4,      /* TruncatedPayloadError */
    TW_E_MAGIC = 5,      /* FormatError */
    TW_E_VERSION = 6,    /* UnsupportedVersionError */
    TW_E_HCHECK = 7,     /* ChecksumError (header) */
    TW_E_FORMAT = 8,     /* FormatError (inconsistent header) */
    TW_E_INCOMPAT = 9,   /* IncompatiblePayloadError */
    TW_E_BCHECK = 10,    /* ChecksumError (body) */
    TW_E_NOMEM = 11,     /* MemoryError */
    TW_E_HEADS = 12      /* IncompatiblePayloadError: KV heads differ from the cache */
};

typedef struct {
    int32_t kind;        /* TW_RAW / TW_FP8 / TW_LLOYD */
    int32_t bits;        /* lloyd: 1..6 */
    int32_t center;      /* lloyd: chunk mean removed */
    int32_t sink_tokens; /* lloyd: first rows of a sequence kept verbatim */
    int32_t hi_eighths;  /* lloyd: first D*hi/8 rotated coordinates get bits+1 */
    int32_t _pad;
} tw_spec;

typedef struct {
    int32_t preset_id, layer, num_layers, head_dim;
    tw_spec k, v;
    const float *s1, *s2;     /* sign tables, head_dim entries of +-1 */
    const float *levels[8];   /* [w]: 2^w Lloyd-Max levels (ascending), w = 1..7 */
    const float *bounds[8];   /* [w]: 2^w - 1 decision boundaries */
} tw_codec;

typedef struct {
    uint16_t *k, *v;          /* first element of the K / V views [blocks, slots, heads, dim] */
    int64_t k_stride[4];      /* block, slot, head, dim strides in elements (vLLM's CPU
                                 attention keeps keys transposed per block: dim stride = block
                                 size, slot stride 1) */
    int64_t v_stride[4];
    int64_t num_blocks, block_size, num_heads;
    int32_t dtype;            /* TW_BF16 / TW_F16 */
    int32_t _pad;
    /* Optional offset tables (elements), replacing the slot / dim stride where not NULL: vLLM
     * CPU attention's AMX layout packs a block's keys and values in VNNI pairs for AMX tiles, so
     * a token's place in the block (block_size entries) and a dim's place in the row (head_dim
     * entries) are no arithmetic progressions. kernels/cpu_attn_layout.py builds them from the
     * probed layout and checks them against the block's extent. */
    const int64_t *k_slot_off, *k_dim_off;
    const int64_t *v_slot_off, *v_dim_off;
} tw_cache;

typedef struct {
    const int64_t *block_ids;
    int64_t n_block_ids;
    int64_t token_start;
    int64_t num_tokens;
    int64_t offset;           /* encode: out_offset; decode: in_offset */
    int64_t nbytes;           /* encode: written here; decode: bytes of the item */
    uint64_t tag;             /* encode: tag; decode: expected tag if check_tag */
    int32_t check_tag;
    int32_t _pad;
} tw_item;

typedef struct {
    int32_t code;
    int32_t item;
    int64_t detail;
} tw_error;

int tw_abi_version(void);
int tw_isa(void);
int tw_set_isa(int isa); /* returns the ISA in use afterwards (unsupported requests are ignored) */
int64_t tw_chunk_nbytes(const tw_codec *c, int64_t tokens, int64_t heads, int64_t token_offset);
int tw_encode(const tw_codec *c, const tw_cache *cache, tw_item *items, int64_t n_items,
              uint8_t *buf, int64_t buf_len, tw_error *err);
int tw_decode(const tw_codec *c, const tw_cache *cache, const tw_item *items, int64_t n_items,
              const uint8_t *buf, int64_t buf_len, tw_error *err);
/* conversions, exposed for exhaustive tests: kind 0 bf16, 1 fp16, 2 e4m3fn (uint8 out) with the
 * vector code; 3, 4, 5 the same with the scalar code */
void tw_convert_f32(const float *in, int64_t n, int kind, void *out);
uint32_t tw_wsum32(const uint8_t *p, int64_t n);

/* ---- internal: one ISA variant's hot loops ---- */
typedef struct {
    const tw_codec *c;
    const tw_cache *cache;
    const tw_spec *spec;
    int kv;                   /* 0 = K, 1 = V */
    int64_t T, H, D;
    const int64_t *blocks;    /* block id of each chunk token */
    const int64_t *slots;     /* slot of each chunk token */
    int src_dtype;            /* header dtype (decode) */
    int64_t sink_rows;
    /* section pointers (relative to the stream) */
    uint8_t *base;
    int64_t mean_off, sink_off, codes_off, scales_off, data_off;
    int32_t row_bytes, n_hi;
    float *scratch;           /* encode: (levels + 2) * H * D floats for the token fold */
} tw_stream_ctx;

typedef struct {
    void (*encode_stream)(tw_stream_ctx *s);
    void (*decode_stream)(tw_stream_ctx *s);
    uint32_t (*wsum32)(const uint8_t *p, int64_t n);
    void (*convert)(const float *in, int64_t n, int kind, void *out);
} tw_kernels;

extern const tw_kernels tw_kernels_base;
#if defined(__x86_64__) || defined(_M_X64)
extern const tw_kernels tw_kernels_v2;
extern const tw_kernels tw_kernels_v3;
#endif

#endif
