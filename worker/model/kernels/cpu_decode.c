/* Paged decode attention on the CPU: one query token per sequence against its KV blocks,
 * read in place through the block table (no gathered copy of the context, which is what
 * the torch reference does). Built at first use by cpu_attn.py; plain C, no torch headers.
 *
 * Layout (the contract of torch_ref.py): k_cache [num_blocks, block_size, num_kv_heads, D],
 * v_cache [num_blocks, block_size, num_kv_heads, Dv], given by base pointer and strides in
 * elements (v may be a view of k's first Dv channels). q [rows, H, D] and out [rows, H, Dv]
 * contiguous; query head i reads KV head i / (H / KVH). Position p of row r lives in block
 * tables[r * tbl_stride + p / block_size] at offset p % block_size; positions
 * [max(0, n - window), n) are attended (window <= 0: all n = seq_lens[r]).
 *
 * Per row: scores of every position for every head (one pass over K, reading each
 * position's KV heads together), an exact softmax per head (max, exp, sum), then one pass
 * over V. fp32 arithmetic; rows (or, with fewer rows than threads, parts of a row's KV
 * heads) spread over `threads` OpenMP threads (ROWS_OF).
 *
 * Two entry points over one body (ROWS_OF): fp32 caches, and int8 caches (kv_int8.py)
 * whose token p of KV head h has the scales ks / vs [(block * block_size + offset) * KVH
 * + h]: a score is scale_k * (q . k_int8), a value row adds weight * scale_v * v_int8.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

typedef struct {
    const float *q;
    const void *kc, *vc;
    const float *ks, *vs; /* int8 caches: per token and KV head scales; else NULL */
    const int32_t *tables, *seq_lens;
    float *out;
    int64_t rows, tbl_stride, H, KVH, D, Dv, bs;
    int64_t k_sb, k_st, k_sh, v_sb, v_st, v_sh;
    float scale;
    int64_t window;
} Work;

/* a . b over n values, eight partial sums (vectorized); b of the cache's element type */
#define DEFINE_DOT(NAME, BT) \
    static inline float NAME(const float *a, const BT *b, int64_t n) { \
        float s0 = 0, s1 = 0, s2 = 0, s3 = 0, s4 = 0, s5 = 0, s6 = 0, s7 = 0; \
        int64_t d = 0; \
        for (; d + 8 <= n; d += 8) { \
            s0 += a[d] * b[d]; s1 += a[d + 1] * b[d + 1]; s2 += a[d + 2] * b[d + 2]; s3 += a[d + 3] * b[d + 3]; \
            s4 += a[d + 4] * b[d + 4]; s5 += a[d + 5] * b[d + 5]; s6 += a[d + 6] * b[d + 6]; \
            s7 += a[d + 7] * b[d + 7]; \
        } \
        for (; d < n; d++) s0 += a[d] * b[d]; \
        return ((s0 + s1) + (s2 + s3)) + ((s4 + s5) + (s6 + s7)); \
    }

DEFINE_DOT(dot, float)
DEFINE_DOT(dot_i8, int8_t)

/* the scale of token p's KV head h in an int8 cache, or 1 */
#define KSCALE(w, blk, off, h) ((w)->ks ? (w)->ks[((int64_t)(blk) * (w)->bs + (off)) * (w)->KVH + (h)] : 1.0f)
#define VSCALE(w, blk, off, h) ((w)->vs ? (w)->vs[((int64_t)(blk) * (w)->bs + (off)) * (w)->KVH + (h)] : 1.0f)

/* Row r's query heads of KV heads [h0, h1) against its positions, reading each position's
 * KV heads of the range together. `sc` [len][heads] and `inv` [heads] (heads = its query
 * heads): the caller's scratch. */
#define PART_OF(NAME, KT, DOT) \
static void NAME(const Work *w, int64_t r, int64_t h0, int64_t h1, float *sc, float *inv) { \
    const int64_t D = w->D, Dv = w->Dv, group = w->H / w->KVH, heads = (h1 - h0) * group; \
    const int64_t n = w->seq_lens[r]; \
    const int64_t start = (w->window > 0 && n > w->window) ? n - w->window : 0; \
    const int64_t len = n - start; \
    const int32_t *tbl = w->tables + r * w->tbl_stride; \
    const float *qr = w->q + (r * w->H + h0 * group) * D; \
    float *o = w->out + (r * w->H + h0 * group) * Dv; \
    for (int64_t i = 0; i < heads; i++) inv[i] = -INFINITY; \
    for (int64_t p = start; p < n; p++) { \
        const int64_t blk = tbl[p / w->bs], off = p % w->bs; \
        const KT *kb = (const KT *)w->kc + blk * w->k_sb + off * w->k_st; \
        float *sp = sc + (p - start) * heads; \
        for (int64_t h = h0; h < h1; h++) { \
            const KT *kp = kb + h * w->k_sh; \
            const float kscale = KSCALE(w, blk, off, h) * w->scale; \
            for (int64_t g = 0; g < group; g++) { \
                const int64_t i = (h - h0) * group + g; \
                const float s = DOT(qr + i * D, kp, D) * kscale; \
                sp[i] = s; \
                if (s > inv[i]) inv[i] = s; \
            } \
        } \
    } \
    for (int64_t i = 0; i < heads; i++) { \
        const float m = inv[i]; \
        float l = 0; \
        for (int64_t t = 0; t < len; t++) { \
            const float e = expf(sc[t * heads + i] - m); \
            sc[t * heads + i] = e; \
            l += e; \
        } \
        inv[i] = len > 0 ? 1.0f / l : 0.0f; \
    } \
    for (int64_t i = 0; i < heads * Dv; i++) o[i] = 0; \
    for (int64_t p = start; p < n; p++) { \
        const int64_t blk = tbl[p / w->bs], off = p % w->bs; \
        const KT *vb = (const KT *)w->vc + blk * w->v_sb + off * w->v_st; \
        const float *wp = sc + (p - start) * heads; \
        for (int64_t h = h0; h < h1; h++) { \
            const KT *vp = vb + h * w->v_sh; \
            const float vscale = VSCALE(w, blk, off, h); \
            for (int64_t g = 0; g < group; g++) { \
                const int64_t i = (h - h0) * group + g; \
                const float wt = wp[i] * vscale; \
                float *oi = o + i * Dv; \
                for (int64_t d = 0; d < Dv; d++) oi[d] += wt * vp[d]; \
            } \
        } \
    } \
    for (int64_t i = 0; i < heads; i++) \
        for (int64_t d = 0; d < Dv; d++) o[i * Dv + d] *= inv[i]; \
}

/* Every row over `threads` OpenMP threads (the process's runtime, the one torch uses): a
 * row is one piece of work while there are at least as many rows as threads, else its KV
 * heads are cut into up to `threads / rows` (rounded up) parts so that few rows still use
 * every thread; a dynamic schedule spreads rows of different lengths. Each thread has its
 * own scratch. Every query head's sums run in one order however the work is cut: the same
 * bits on one thread or many. Returns 0, or 1 if scratch memory could not be had (out is
 * then incomplete). */
#define ROWS_OF(NAME, PART) \
static int NAME(const Work *w, int64_t threads) { \
    if (w->rows <= 0) return 0; \
    const int64_t group = w->H / w->KVH; \
    int64_t parts = w->rows >= threads ? 1 : (threads + w->rows - 1) / w->rows; \
    if (parts > w->KVH) parts = w->KVH; \
    const int64_t per = (w->KVH + parts - 1) / parts, items = w->rows * parts; \
    int64_t max_len = 0; \
    for (int64_t r = 0; r < w->rows; r++) \
        if (w->seq_lens[r] > max_len) max_len = w->seq_lens[r]; \
    if (threads <= 1) { /* no parallel region: a decode of a few short rows is a few microseconds */ \
        float *scratch = malloc(sizeof(float) * (size_t)((1 + max_len) * w->H)); \
        if (scratch == NULL) return 1; \
        for (int64_t r = 0; r < w->rows; r++) PART(w, r, 0, w->KVH, scratch + w->H, scratch); \
        free(scratch); \
        return 0; \
    } \
    int failed = 0; \
    _Pragma("omp parallel num_threads(threads)") \
    { \
        float *scratch = malloc(sizeof(float) * (size_t)((1 + max_len) * per * group)); \
        if (scratch == NULL) { \
            _Pragma("omp atomic write") \
            failed = 1; \
        } \
        _Pragma("omp for schedule(dynamic, 1)") \
        for (int64_t j = 0; j < items; j++) { \
            const int64_t r = j / parts, h0 = (j % parts) * per; \
            const int64_t h1 = h0 + per < w->KVH ? h0 + per : w->KVH; \
            if (scratch != NULL && h0 < h1) PART(w, r, h0, h1, scratch + per * group, scratch); \
        } \
        free(scratch); \
    } \
    return failed; \
}

PART_OF(part_f32, float, dot)
PART_OF(part_i8, int8_t, dot_i8)
ROWS_OF(rows_f32, part_f32)
ROWS_OF(rows_i8, part_i8)

/* Returns 0, or 1 if scratch memory could not be had (out is then incomplete). */
int inflight_paged_decode(const float *q, const float *kc, const float *vc, const int32_t *tables,
                          const int32_t *seq_lens, float *out, int64_t rows, int64_t tbl_stride, int64_t H,
                          int64_t KVH, int64_t D, int64_t Dv, int64_t bs, int64_t k_sb, int64_t k_st, int64_t k_sh,
                          int64_t v_sb, int64_t v_st, int64_t v_sh, float scale, int64_t window, int64_t threads) {
    const Work w = {q, kc, vc, NULL, NULL, tables, seq_lens, out, rows, tbl_stride, H, KVH, D, Dv, bs,
                    k_sb, k_st, k_sh, v_sb, v_st, v_sh, scale, window};
    return rows_f32(&w, threads);
}

/* The same over int8 caches with their scales (contiguous [num_blocks, block_size, KVH]). */
int inflight_paged_decode_int8(const float *q, const int8_t *kc, const int8_t *vc, const float *ks, const float *vs,
                               const int32_t *tables, const int32_t *seq_lens, float *out, int64_t rows,
                               int64_t tbl_stride, int64_t H, int64_t KVH, int64_t D, int64_t Dv, int64_t bs,
                               int64_t k_sb, int64_t k_st, int64_t k_sh, int64_t v_sb, int64_t v_st, int64_t v_sh,
                               float scale, int64_t window, int64_t threads) {
    const Work w = {q, kc, vc, ks, vs, tables, seq_lens, out, rows, tbl_stride, H, KVH, D, Dv, bs,
                    k_sb, k_st, k_sh, v_sb, v_st, v_sh, scale, window};
    return rows_i8(&w, threads);
}
