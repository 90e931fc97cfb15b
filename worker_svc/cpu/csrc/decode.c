/* The decoder layers of worker_svc/cpu/decode.py's lean pass, in C: for each layer the kernel calls
 * of the modules' forward, in their order, on the pass's buffers; one ctypes call a step.
 *
 * The kernels stay in their own libraries (quant.c, fused.c, attention.c); the caller passes their
 * addresses in `struct decode_fns`, the step's pointers and sizes in `struct decode_step`, and the
 * layers as rows of LAYER_WORDS int64 (see decode.py's _layer_words). The residual adds are the
 * only arithmetic here: fp32 adds, or for bf16 each element's fp32 sum rounded to nearest even, as
 * torch's add_ of two bf16 tensors computes it (so the pass stays bit for bit the modules').
 *
 * Built at first use by worker_svc/cpu/decode.py (through worker_svc.cpu.build) and called through
 * ctypes; tests/test_cpu_decode.py holds the pass to the modules.
 */
#include <stdint.h>
#include <string.h>

typedef void (*linear_fn)(int, const void *, int64_t, const void *, const void *, void *, int64_t, int64_t, int64_t,
                          int64_t);
typedef void (*rms_norm_fn)(const void *, int64_t, const void *, float, void *, int64_t, int64_t);
typedef void (*silu_mul_fn)(const void *, int64_t, void *, int64_t, int64_t);
typedef void (*rotary_fn)(void *, int64_t, int64_t, void *, int64_t, int64_t, int64_t, const void *, const void *,
                          int64_t);
typedef int (*attention_fn)(const void *, const void *, void *, const int32_t *, const int32_t *, const int32_t *,
                            int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, float, int64_t);
typedef int (*kv_write_fn)(char *, int64_t, int64_t, const char *, int64_t, const char *, int64_t, const int64_t *,
                           int64_t);

struct decode_fns {
    linear_fn linear; /* quant_linear, quant_linear_i8 or quant_linear_bf16 */
    rms_norm_fn rms_norm;
    silu_mul_fn silu_mul;
    rotary_fn rotary;
    attention_fn attention;
    kv_write_fn kv_write;
};

struct decode_step {
    int64_t tokens, hidden_size, q_size, kv_size, intermediate, num_heads, num_kv_heads, head_dim;
    int64_t element; /* bytes of an activation: 4 (fp32) or 2 (bf16) */
    float eps, scale;
    char *hidden, *normed, *qkv, *query, *attn, *proj, *gate_up, *act; /* [tokens, width] activations */
    const void *cos, *sin;
    const int64_t *slots;
    const int32_t *query_start_loc, *seq_lens, *block_tables;
    int64_t table_stride, num_seqs, num_blocks, block_size;
    char *kv;            /* the cache of layer 0, [2, num_blocks * block_size, kv_size] */
    int64_t layer_bytes; /* from one layer's cache to the next */
};

/* A layer's words: the two norm weights, then the four linears (qkv, o, gate_up, down), each as its
 * number of parts and MAX_PARTS parts of PART_WORDS (block type, packed weight, bias or 0, first
 * output column, columns). */
#define MAX_PARTS 4
#define PART_WORDS 5
#define LINEAR_WORDS (1 + MAX_PARTS * PART_WORDS)
#define LAYER_WORDS (2 + 4 * LINEAR_WORDS)
/* what decode_layers returns when a K/V slot is outside the cache (the attention's own codes are
 * -1 .. -6) */
#define KV_SLOT_ERROR (-100)

static void run_linear(const struct decode_fns *f, const int64_t *words, const void *x, int64_t x_stride, char *y,
                       int64_t y_stride, int64_t m, int64_t k, int64_t element) {
    const int64_t parts = words[0];
    for (int64_t i = 0; i < parts; i++) {
        const int64_t *part = words + 1 + i * PART_WORDS;
        f->linear((int)part[0], x, x_stride, (const void *)part[1], (const void *)part[2], y + part[3] * element,
                  y_stride, m, part[4], k);
    }
}

static inline float bf16_float(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t float_bf16(float f) { /* round to nearest even; NaN stays NaN */
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* hidden += proj over count elements */
static void add_residual(char *hidden, const char *proj, int64_t count, int64_t element) {
    if (element == 4) {
        float *h = (float *)hidden;
        const float *p = (const float *)proj;
        for (int64_t i = 0; i < count; i++) h[i] += p[i];
    } else {
        uint16_t *h = (uint16_t *)hidden;
        const uint16_t *p = (const uint16_t *)proj;
        for (int64_t i = 0; i < count; i++) h[i] = float_bf16(bf16_float(h[i]) + bf16_float(p[i]));
    }
}

/* Every layer of one step over s's buffers (hidden holds the embeddings on entry and the last
 * layer's output on return). Returns 0, KV_SLOT_ERROR, or the attention kernel's negative code. */
int decode_layers(const struct decode_fns *f, const struct decode_step *s, const int64_t *layers,
                  int64_t num_layers) {
    const int64_t T = s->tokens, H = s->hidden_size, Nq = s->q_size, es = s->element;
    const int64_t qkv_width = Nq + 2 * s->kv_size, inter = s->intermediate;
    const int64_t num_slots = s->num_blocks * s->block_size, row_bytes = s->kv_size * es;
    char *k_rows = s->qkv + Nq * es, *v_rows = s->qkv + (Nq + s->kv_size) * es;
    /* the attention kernel reads the queries as contiguous [T, H, D]: a lone token's are, in qkv */
    char *query = T == 1 ? s->qkv : s->query;
    for (int64_t i = 0; i < num_layers; i++) {
        const int64_t *layer = layers + i * LAYER_WORDS;
        const int64_t *qkv = layer + 2, *o = qkv + LINEAR_WORDS, *gate_up = o + LINEAR_WORDS;
        const int64_t *down = gate_up + LINEAR_WORDS;
        char *kv_layer = s->kv + i * s->layer_bytes;
        f->rms_norm(s->hidden, H, (const void *)layer[0], s->eps, s->normed, T, H);
        run_linear(f, qkv, s->normed, H, s->qkv, qkv_width, T, H, es);
        f->rotary(s->qkv, qkv_width, s->num_heads, k_rows, qkv_width, s->num_kv_heads, s->head_dim, s->cos, s->sin, T);
        if (f->kv_write(kv_layer, num_slots, row_bytes, k_rows, qkv_width * es, v_rows, qkv_width * es, s->slots, T))
            return KV_SLOT_ERROR;
        if (T > 1)
            for (int64_t t = 0; t < T; t++) memcpy(s->query + t * Nq * es, s->qkv + t * qkv_width * es, (size_t)(Nq * es));
        const int rc = f->attention(query, kv_layer, s->attn, s->query_start_loc, s->seq_lens, s->block_tables,
                                    s->table_stride, s->num_seqs, T, s->num_heads, s->num_kv_heads, s->head_dim,
                                    s->num_blocks, s->block_size, s->scale, T);
        if (rc) return rc;
        run_linear(f, o, s->attn, Nq, s->proj, H, T, Nq, es);
        add_residual(s->hidden, s->proj, T * H, es);
        f->rms_norm(s->hidden, H, (const void *)layer[1], s->eps, s->normed, T, H);
        run_linear(f, gate_up, s->normed, H, s->gate_up, 2 * inter, T, H, es);
        f->silu_mul(s->gate_up, 2 * inter, s->act, T, inter);
        run_linear(f, down, s->act, inter, s->proj, H, T, inter, es);
        add_residual(s->hidden, s->proj, T * H, es);
    }
    return 0;
}

/* The sizes worker_svc/cpu/decode.py lays its words out by, and the code it tells apart. */
int64_t decode_layer_words(void) { return LAYER_WORDS; }
int64_t decode_max_parts(void) { return MAX_PARTS; }
int64_t decode_kv_slot_error(void) { return KV_SLOT_ERROR; }

/* The ABI version worker_svc/cpu/decode.py expects; bump it when a signature or struct changes. */
int pagewire_cpu_decode_abi(void) { return 2; }
