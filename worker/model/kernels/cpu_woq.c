/* Weight-only quantized matmul on the CPU: y = x @ dequant(q).T + bias, the integers read
 * from memory as they are stored and widened in registers (no float weight is written).
 * Used by QuantLinear's weight-only forward (W8A16, W4A16) through cpu_woq.py; the same
 * register tiles serve float32 weights (`inflight_float_linear`: worker/model/small_batch.py).
 *
 * Layouts (QuantLinear's buffers):
 *   x      [M, K] float32, contiguous
 *   q      int8 [N, K] (bits 8), or uint8 [N, K/2] (bits 4): column j of a row in the low
 *          nibble of byte j, column K/2 + j in its high nibble, each stored as value + 8
 *   scale  [N, G] float32: group g covers columns [g*K/G, (g+1)*K/G)
 *   zero   [N, G] int8 or NULL: w = (q - zero) * scale
 *   bias   [N] float32 or NULL
 *   y      [M, N] float32, written
 *
 * Each output is summed in float32 over the dequantized weight (u - shift) * scale, u the
 * stored integer (int4: the nibble) and shift the zero point (int4: plus its offset 8),
 * widened in registers: never written to memory on the decode path.
 *
 * Blocking: 4 output channels x up to 4 rows per register tile (AVX-512: 16 accumulators
 * of 16 lanes; AVX2 with FMA, 16 registers of 8 lanes: tiles of 2 rows, a 4-row tile as
 * two), `threads` threads (OpenMP: the process's runtime, the same libgomp torch uses; the
 * caller passes torch's intra-op count, since OpenMP's is per calling thread) over blocks
 * of output channels. Without either instruction set, or with groups not a multiple of the
 * vector width (16 or 8 columns), a plain C loop does the same arithmetic, correct but
 * 10-50x slower: cpu_woq.py routes such layers to torch instead (`fast`).
 */
#include <stdint.h>
#include <stdlib.h>
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
#define WOQ_AVX2 1
#endif

#define MB 4 /* rows per tile */
#define NB 4 /* output channels per tile */

/* A weight row is walked in byte chunks that share their scales: a group of an int8 weight;
 * for int4, a run of bytes whose low nibbles are one group of the first half of the columns
 * and whose high nibbles are one of the second half. A lane is what one chunk multiplies: its
 * first column of x and its scale / zero column. int8 has one lane per chunk, int4 two (low
 * nibbles, high nibbles). */
typedef struct {
    int64_t chunk_bytes, nchunks;
    int bits;
} walk;

static walk make_walk(int64_t K, int64_t G, int bits) {
    if (bits == 8) return (walk){K / G, G, 8};
    int64_t cb = G == 1 ? K / 2 : K / G;
    return (walk){cb, (K / 2) / cb, 4};
}

/* lane l of chunk c: lane 0 the int8 value or the low nibble, lane 1 the high nibble */
static inline int64_t lane_x(const walk *w, int64_t K, int64_t c, int l) {
    return (w->bits == 8 ? 0 : l * (K / 2)) + c * w->chunk_bytes;
}
/* the scale / zero column of a lane: G == 1 -> 0; int4 halves -> G/2 groups each */
static inline int64_t lane_group(const walk *w, int64_t G, int64_t c, int l) {
    return G == 1 ? 0 : l * (G / (w->bits == 8 ? 1 : 2)) + c;
}

static inline float stored(const uint8_t *row, int64_t i, int bits, int l) {
    if (bits == 8) return (float)((const int8_t *)row)[i];
    return (float)(l == 0 ? (row[i] & 15) : (row[i] >> 4));
}

/* The shift a lane's integers take off before scaling: the zero point, plus 8 for int4's
 * stored offset. */
static inline float lane_shift(const int8_t *zero_row, int64_t g, int bits) {
    return (bits == 4 ? 8.f : 0.f) + (zero_row ? (float)zero_row[g] : 0.f);
}

/* The vector tiles' width in float lanes: 16 (AVX-512), 8 (AVX2 with FMA), or 0 when this
 * build has only the plain C loop (a correctness fallback, 10-50x slower than torch's
 * dequantize-then-GEMM). A run of columns sharing a scale must be a whole number of them. */
int inflight_woq_vectorized(void) {
#if defined(__AVX512F__)
    return 16;
#elif defined(WOQ_AVX2)
    return 8;
#else
    return 0;
#endif
}

#ifdef __AVX512F__
/* Prefetch into L2 this many bytes ahead of each weight row, once per cache line: a core's
 * own streams then keep more lines in flight than its line fill buffers allow (measured on
 * the 2-core box: int8 at one row 10-13 GB/s without, 19-23 GB/s with; 1-4 KiB ahead or
 * into L1 gained less). */
#define PREFETCH_BYTES 8192

/* out[m][j] = sum over the row's chunks of x . ((u - shift) * scale) for rows m < mb (a
 * constant at each inlined call, so the tile stays in registers) and NB channels. int8 with
 * one scale per channel and no zero point sums the raw integers and scales once; other int8
 * widens, scales and shifts in one FMA; int4 looks each nibble up in a 16-entry table of its
 * chunk's dequantized values (one permute per 16 weights, no conversion). */
static inline __attribute__((always_inline)) void tile_avx512(const float *x, int64_t ldx, const uint8_t *const *rows,
                                                                const float *const *scales,
                                                                const int8_t *const *zeros, const walk *w,
                                                                int64_t K, int64_t G, int mb, float out[MB][NB]) {
    __m512 acc[MB][NB];
    for (int m = 0; m < mb; m++)
        for (int j = 0; j < NB; j++) acc[m][j] = _mm512_setzero_ps();
    const int raw = w->bits == 8 && G == 1 && zeros[0] == NULL;
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (int64_t c = 0; c < w->nchunks; c++) {
        const int64_t at = c * w->chunk_bytes;
        if (raw) {
            for (int64_t k = 0; k < w->chunk_bytes; k += 16) {
                __m512 wv[NB];
                if ((k & 63) == 0)
                    for (int j = 0; j < NB; j++) _mm_prefetch((const char *)(rows[j] + k + PREFETCH_BYTES), _MM_HINT_T1);
                for (int j = 0; j < NB; j++)
                    wv[j] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(rows[j] + k))));
                for (int m = 0; m < mb; m++) {
                    __m512 xv = _mm512_loadu_ps(x + m * ldx + k);
                    for (int j = 0; j < NB; j++) acc[m][j] = _mm512_fmadd_ps(xv, wv[j], acc[m][j]);
                }
            }
        } else if (w->bits == 8) {
            __m512 s[NB], b[NB];
            for (int j = 0; j < NB; j++) {
                const int64_t g = lane_group(w, G, c, 0);
                s[j] = _mm512_set1_ps(scales[j][g]);
                b[j] = _mm512_set1_ps(-lane_shift(zeros[j], g, 8) * scales[j][g]);
            }
            const float *xc = x + lane_x(w, K, c, 0);
            for (int64_t k = 0; k < w->chunk_bytes; k += 16) {
                __m512 wv[NB];
                if ((k & 63) == 0)
                    for (int j = 0; j < NB; j++)
                        _mm_prefetch((const char *)(rows[j] + at + k + PREFETCH_BYTES), _MM_HINT_T1);
                for (int j = 0; j < NB; j++)
                    wv[j] = _mm512_fmadd_ps(
                        _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(rows[j] + at + k)))),
                        s[j], b[j]);
                for (int m = 0; m < mb; m++) {
                    __m512 xv = _mm512_loadu_ps(xc + m * ldx + k);
                    for (int j = 0; j < NB; j++) acc[m][j] = _mm512_fmadd_ps(xv, wv[j], acc[m][j]);
                }
            }
        } else {
            __m512 tlo[NB], thi[NB]; /* the 16 values each nibble stands for */
            for (int j = 0; j < NB; j++) {
                const int64_t glo = lane_group(w, G, c, 0), ghi = lane_group(w, G, c, 1);
                tlo[j] = _mm512_mul_ps(_mm512_sub_ps(iota, _mm512_set1_ps(lane_shift(zeros[j], glo, 4))),
                                       _mm512_set1_ps(scales[j][glo]));
                thi[j] = _mm512_mul_ps(_mm512_sub_ps(iota, _mm512_set1_ps(lane_shift(zeros[j], ghi, 4))),
                                       _mm512_set1_ps(scales[j][ghi]));
            }
            const float *xlo = x + lane_x(w, K, c, 0), *xhi = x + lane_x(w, K, c, 1);
            for (int64_t k = 0; k < w->chunk_bytes; k += 16) {
                __m512 wlo[NB], whi[NB];
                if ((k & 63) == 0)
                    for (int j = 0; j < NB; j++)
                        _mm_prefetch((const char *)(rows[j] + at + k + PREFETCH_BYTES), _MM_HINT_T1);
                for (int j = 0; j < NB; j++) {
                    /* vpermps reads the low 4 bits of each index: the low nibble as it is */
                    __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(rows[j] + at + k)));
                    wlo[j] = _mm512_permutexvar_ps(b, tlo[j]);
                    whi[j] = _mm512_permutexvar_ps(_mm512_srli_epi32(b, 4), thi[j]);
                }
                for (int m = 0; m < mb; m++) {
                    __m512 xl = _mm512_loadu_ps(xlo + m * ldx + k), xh = _mm512_loadu_ps(xhi + m * ldx + k);
                    for (int j = 0; j < NB; j++)
                        acc[m][j] = _mm512_fmadd_ps(xh, whi[j], _mm512_fmadd_ps(xl, wlo[j], acc[m][j]));
                }
            }
        }
    }
    for (int m = 0; m < mb; m++)
        for (int j = 0; j < NB; j++) out[m][j] = _mm512_reduce_add_ps(acc[m][j]) * (raw ? scales[j][0] : 1.f);
}
#endif

#ifdef WOQ_AVX2
/* As PREFETCH_BYTES above (AVX2 machines: the same reasoning, not separately tuned). */
#define PREFETCH_BYTES2 8192

static inline float hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* 8 stored integers from p as floats: int8 widened, or the low / high nibbles of 8 bytes */
static inline __m256 widen_i8(const uint8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}

/* tile_avx512's arithmetic 8 lanes wide, for mb <= 2 rows (16 registers: 8 accumulators, 4
 * weight vectors, the row's x); int4's nibbles are widened and scaled by an FMA (AVX2 has no
 * 16-entry permute). out[m] for m < mb. */
static inline __attribute__((always_inline)) void tile_avx2(const float *x, int64_t ldx, const uint8_t *const *rows,
                                                              const float *const *scales, const int8_t *const *zeros,
                                                              const walk *w, int64_t K, int64_t G, int mb,
                                                              float out[][NB]) {
    __m256 acc[2][NB];
    for (int m = 0; m < mb; m++)
        for (int j = 0; j < NB; j++) acc[m][j] = _mm256_setzero_ps();
    const int raw = w->bits == 8 && G == 1 && zeros[0] == NULL;
    const __m256i low4 = _mm256_set1_epi32(15);
    for (int64_t c = 0; c < w->nchunks; c++) {
        const int64_t at = c * w->chunk_bytes;
        if (w->bits == 8) {
            float sj[NB], bj[NB];
            for (int j = 0; j < NB; j++) {
                const int64_t g = lane_group(w, G, c, 0);
                sj[j] = raw ? 1.f : scales[j][g];
                bj[j] = raw ? 0.f : -lane_shift(zeros[j], g, 8) * scales[j][g];
            }
            const float *xc = x + lane_x(w, K, c, 0);
            for (int64_t k = 0; k < w->chunk_bytes; k += 8) {
                __m256 wv[NB];
                if ((k & 63) == 0)
                    for (int j = 0; j < NB; j++)
                        _mm_prefetch((const char *)(rows[j] + at + k + PREFETCH_BYTES2), _MM_HINT_T1);
                for (int j = 0; j < NB; j++) {
                    wv[j] = widen_i8(rows[j] + at + k);
                    if (!raw) wv[j] = _mm256_fmadd_ps(wv[j], _mm256_set1_ps(sj[j]), _mm256_set1_ps(bj[j]));
                }
                for (int m = 0; m < mb; m++) {
                    __m256 xv = _mm256_loadu_ps(xc + m * ldx + k);
                    for (int j = 0; j < NB; j++) acc[m][j] = _mm256_fmadd_ps(xv, wv[j], acc[m][j]);
                }
            }
        } else {
            float slo[NB], blo[NB], shi[NB], bhi[NB];
            for (int j = 0; j < NB; j++) {
                const int64_t glo = lane_group(w, G, c, 0), ghi = lane_group(w, G, c, 1);
                slo[j] = scales[j][glo];
                blo[j] = -lane_shift(zeros[j], glo, 4) * slo[j];
                shi[j] = scales[j][ghi];
                bhi[j] = -lane_shift(zeros[j], ghi, 4) * shi[j];
            }
            const float *xlo = x + lane_x(w, K, c, 0), *xhi = x + lane_x(w, K, c, 1);
            for (int64_t k = 0; k < w->chunk_bytes; k += 8) {
                if ((k & 63) == 0)
                    for (int j = 0; j < NB; j++)
                        _mm_prefetch((const char *)(rows[j] + at + k + PREFETCH_BYTES2), _MM_HINT_T1);
                for (int j = 0; j < NB; j++) {
                    __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(rows[j] + at + k)));
                    __m256 wlo = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(b, low4)),
                                                 _mm256_set1_ps(slo[j]), _mm256_set1_ps(blo[j]));
                    __m256 whi = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4)),
                                                 _mm256_set1_ps(shi[j]), _mm256_set1_ps(bhi[j]));
                    for (int m = 0; m < mb; m++)
                        acc[m][j] = _mm256_fmadd_ps(_mm256_loadu_ps(xhi + m * ldx + k), whi,
                                                    _mm256_fmadd_ps(_mm256_loadu_ps(xlo + m * ldx + k), wlo, acc[m][j]));
                }
            }
        }
    }
    for (int m = 0; m < mb; m++)
        for (int j = 0; j < NB; j++) out[m][j] = hsum256(acc[m][j]) * (raw ? scales[j][0] : 1.f);
}

/* int4 at one row (a decode step of one request), by sum_k x_k (u_k - shift) s =
 * s (x . u) - s shift (sum_k x_k): the loop only widens the stored nibbles and multiplies
 * them with x (7 instructions per 16 weights and channel, against tile_avx2's 9, which
 * bound it at one row: int4 read half int8's bytes and ran no faster), each chunk's two
 * dot products are scaled once at its end, and sum_k x_k is added up in the same loop
 * (once for the NB channels). */
static inline void tile_avx2_int4_row(const float *x, const uint8_t *const *rows, const float *const *scales,
                                      const int8_t *const *zeros, const walk *w, int64_t K, int64_t G,
                                      float out[NB]) {
    __m256 acc[NB];
    float shifted[NB];
    for (int j = 0; j < NB; j++) {
        acc[j] = _mm256_setzero_ps();
        shifted[j] = 0.f;
    }
    const __m256i low4 = _mm256_set1_epi32(15);
    for (int64_t c = 0; c < w->nchunks; c++) {
        const int64_t at = c * w->chunk_bytes;
        const float *xlo = x + lane_x(w, K, c, 0), *xhi = x + lane_x(w, K, c, 1);
        __m256 dlo[NB], dhi[NB];
        __m256 sxlo = _mm256_setzero_ps(), sxhi = _mm256_setzero_ps();
        for (int j = 0; j < NB; j++) dlo[j] = dhi[j] = _mm256_setzero_ps();
        for (int64_t k = 0; k < w->chunk_bytes; k += 8) {
            if ((k & 63) == 0)
                for (int j = 0; j < NB; j++)
                    _mm_prefetch((const char *)(rows[j] + at + k + PREFETCH_BYTES2), _MM_HINT_T1);
            const __m256 xl = _mm256_loadu_ps(xlo + k), xh = _mm256_loadu_ps(xhi + k);
            sxlo = _mm256_add_ps(sxlo, xl);
            sxhi = _mm256_add_ps(sxhi, xh);
            for (int j = 0; j < NB; j++) {
                __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(rows[j] + at + k)));
                dlo[j] = _mm256_fmadd_ps(xl, _mm256_cvtepi32_ps(_mm256_and_si256(b, low4)), dlo[j]);
                dhi[j] = _mm256_fmadd_ps(xh, _mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4)), dhi[j]);
            }
        }
        const float sumlo = hsum256(sxlo), sumhi = hsum256(sxhi);
        for (int j = 0; j < NB; j++) {
            const int64_t glo = lane_group(w, G, c, 0), ghi = lane_group(w, G, c, 1);
            const float slo = scales[j][glo], shi = scales[j][ghi];
            acc[j] = _mm256_fmadd_ps(dlo[j], _mm256_set1_ps(slo), acc[j]);
            acc[j] = _mm256_fmadd_ps(dhi[j], _mm256_set1_ps(shi), acc[j]);
            shifted[j] += slo * lane_shift(zeros[j], glo, 4) * sumlo + shi * lane_shift(zeros[j], ghi, 4) * sumhi;
        }
    }
    for (int j = 0; j < NB; j++) out[j] = hsum256(acc[j]) - shifted[j];
}

/* tile_avx2 over mb <= MB rows, two at a time (int4's last odd row: tile_avx2_int4_row) */
static inline void tiles_avx2(const float *x, int64_t ldx, const uint8_t *const *rows, const float *const *scales,
                              const int8_t *const *zeros, const walk *w, int64_t K, int64_t G, int mb,
                              float out[MB][NB]) {
    for (int r = 0; r < mb; r += 2) {
        if (mb - r >= 2)
            tile_avx2(x + r * ldx, ldx, rows, scales, zeros, w, K, G, 2, out + r);
        else if (w->bits == 4)
            tile_avx2_int4_row(x + r * ldx, rows, scales, zeros, w, K, G, out[r]);
        else
            tile_avx2(x + r * ldx, ldx, rows, scales, zeros, w, K, G, 1, out + r);
    }
}
#endif

static void tile_plain(const float *x, int64_t ldx, const uint8_t *const *rows, const float *const *scales,
                       const int8_t *const *zeros, const walk *w, int64_t K, int64_t G, int mb, int nb,
                       float out[MB][NB]) {
    int nl = w->bits == 8 ? 1 : 2;
    for (int m = 0; m < mb; m++)
        for (int j = 0; j < nb; j++) {
            float total = 0.f;
            for (int64_t c = 0; c < w->nchunks; c++)
                for (int l = 0; l < nl; l++) {
                    const int64_t g = lane_group(w, G, c, l);
                    const float *xc = x + m * ldx + lane_x(w, K, c, l);
                    const uint8_t *r = rows[j] + c * w->chunk_bytes;
                    const float shift = lane_shift(zeros[j], g, w->bits);
                    float acc = 0.f;
                    for (int64_t k = 0; k < w->chunk_bytes; k++) acc += xc[k] * (stored(r, k, w->bits, l) - shift);
                    total += acc * scales[j][g];
                }
            out[m][j] = total;
        }
}

/* Channels n0.. n0 + nb of the dequantized weight, (u - shift) * scale, into buf [nb][K] in
 * x's column order. */
static void dequantize_rows(const uint8_t *const *rows, const float *const *scales, const int8_t *const *zeros,
                            const walk *w, int64_t K, int64_t G, int nb, float *buf) {
    const int nl = w->bits == 8 ? 1 : 2;
    for (int j = 0; j < nb; j++)
        for (int64_t c = 0; c < w->nchunks; c++)
            for (int l = 0; l < nl; l++) {
                const int64_t g = lane_group(w, G, c, l);
                const float s = scales[j][g], shift = lane_shift(zeros[j], g, w->bits);
                const uint8_t *r = rows[j] + c * w->chunk_bytes;
                float *dst = buf + j * K + lane_x(w, K, c, l);
                if (w->bits == 8)
                    for (int64_t k = 0; k < w->chunk_bytes; k++) dst[k] = ((float)((const int8_t *)r)[k] - shift) * s;
                else if (l == 0)
                    for (int64_t k = 0; k < w->chunk_bytes; k++) dst[k] = ((float)(r[k] & 15) - shift) * s;
                else
                    for (int64_t k = 0; k < w->chunk_bytes; k++) dst[k] = ((float)(r[k] >> 4) - shift) * s;
            }
}

/* The operands of channels n0.. n0 + nb: each row's integers, scales and zero points. */
static void channel_block(const uint8_t *q, const float *scale, const int8_t *zero, int64_t row_bytes, int64_t G,
                          int64_t n0, int nb, const uint8_t **rows, const float **scales, const int8_t **zeros) {
    for (int j = 0; j < NB; j++) {
        const int64_t n = n0 + (j < nb ? j : 0); /* a partial block repeats its first channel */
        rows[j] = q + n * row_bytes;
        scales[j] = scale + n * G;
        zeros[j] = zero ? zero + n * G : NULL;
    }
}

static int refused(int64_t K, int64_t G, int64_t bits) {
    if ((bits != 8 && bits != 4) || G < 1 || K % G) return 1;
    return bits == 4 && (K % 2 || (G > 1 && (G % 2 || (K / 2) % (K / G))));
}

/* out[m][j] = x[m] . wbuf[j] over K (float weights in the thread's buffer). */
static inline __attribute__((always_inline)) void tile_float(const float *x, int64_t ldx, const float *wbuf, int64_t K,
                                                               int mb, int nb, float out[MB][NB]) {
#ifdef __AVX512F__
    if (nb == NB && K % 16 == 0) {
        __m512 acc[MB][NB];
        for (int m = 0; m < mb; m++)
            for (int j = 0; j < NB; j++) acc[m][j] = _mm512_setzero_ps();
        for (int64_t k = 0; k < K; k += 16) {
            __m512 wv[NB];
            for (int j = 0; j < NB; j++) wv[j] = _mm512_loadu_ps(wbuf + j * K + k);
            for (int m = 0; m < mb; m++) {
                __m512 xv = _mm512_loadu_ps(x + m * ldx + k);
                for (int j = 0; j < NB; j++) acc[m][j] = _mm512_fmadd_ps(xv, wv[j], acc[m][j]);
            }
        }
        for (int m = 0; m < mb; m++)
            for (int j = 0; j < NB; j++) out[m][j] = _mm512_reduce_add_ps(acc[m][j]);
        return;
    }
#endif
#ifdef WOQ_AVX2
    if (nb == NB && K % 8 == 0) {
        for (int r = 0; r < mb; r += 2) { /* two rows at a time: 8 accumulators in 16 registers */
            const int rb = mb - r >= 2 ? 2 : 1;
            __m256 acc[2][NB];
            for (int m = 0; m < rb; m++)
                for (int j = 0; j < NB; j++) acc[m][j] = _mm256_setzero_ps();
            for (int64_t k = 0; k < K; k += 8) {
                __m256 wv[NB];
                for (int j = 0; j < NB; j++) wv[j] = _mm256_loadu_ps(wbuf + j * K + k);
                for (int m = 0; m < rb; m++) {
                    __m256 xv = _mm256_loadu_ps(x + (r + m) * ldx + k);
                    for (int j = 0; j < NB; j++) acc[m][j] = _mm256_fmadd_ps(xv, wv[j], acc[m][j]);
                }
            }
            for (int m = 0; m < rb; m++)
                for (int j = 0; j < NB; j++) out[r + m][j] = hsum256(acc[m][j]);
        }
        return;
    }
#endif
    for (int m = 0; m < mb; m++)
        for (int j = 0; j < nb; j++) {
            float acc = 0.f;
            for (int64_t k = 0; k < K; k++) acc += x[m * ldx + k] * wbuf[j * K + k];
            out[m][j] = acc;
        }
}

/* tile_float over mb <= MB rows, mb made a constant at each call (the tile stays in registers) */
static inline void tiles_float(const float *x, int64_t ldx, const float *wrows, int64_t K, int mb, int nb,
                               float out[MB][NB]) {
    switch (mb) {
    case 1: tile_float(x, ldx, wrows, K, 1, nb, out); break;
    case 2: tile_float(x, ldx, wrows, K, 2, nb, out); break;
    case 3: tile_float(x, ldx, wrows, K, 3, nb, out); break;
    default: tile_float(x, ldx, wrows, K, 4, nb, out); break;
    }
}

/* y's rows m0.. m0 + mb, channels n0.. n0 + nb: a tile's sums plus the bias */
static inline void store_tile(float *y, int64_t N, int64_t m0, int64_t n0, int mb, int nb, float out[MB][NB],
                              const float *bias) {
    for (int m = 0; m < mb; m++)
        for (int j = 0; j < nb; j++) y[(m0 + m) * N + n0 + j] = out[m][j] + (bias ? bias[n0 + j] : 0.f);
}

/* Returns 0; 1 for arguments it does not take (y untouched): bits not 4 or 8, G not
 * dividing K, int4 with an odd K or groups straddling the two halves; 2 out of memory.
 *
 * Up to MB rows (decode batches), and int8 with one scale per channel always: the integers
 * go straight from memory into registers, once per row tile. Otherwise each block of NB
 * channels is dequantized once into a per-thread buffer (NB x K floats, in L1/L2) that every
 * row tile multiplies, so widening is paid once per channel, not once per row tile. */
int inflight_woq_linear(const float *x, const uint8_t *q, const float *scale, const int8_t *zero, const float *bias,
                        float *y, int64_t M, int64_t K, int64_t N, int64_t G, int64_t bits, int64_t threads) {
    if (refused(K, G, bits)) return 1;
    const walk w = make_walk(K, G, (int)bits);
    const int64_t row_bytes = bits == 8 ? K : K / 2;
    /* per-channel int8 widens with one instruction and scales once per sum: direct at every
     * batch size (measured faster than the buffer up to 32 rows) */
    const int direct = M <= MB || (bits == 8 && G == 1 && M <= 32);
#if defined(__AVX512F__) || defined(WOQ_AVX2)
    const int vector = w.chunk_bytes % inflight_woq_vectorized() == 0;
#endif
    const int64_t nblocks = (N + NB - 1) / NB;
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
        float *buf = direct ? NULL : malloc(sizeof(float) * NB * K);
        if (!direct && !buf) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t blk = 0; blk < nblocks; blk++) {
            if (!direct && !buf) continue;
            const int64_t n0 = blk * NB;
            const int nb = N - n0 < NB ? (int)(N - n0) : NB;
            const uint8_t *rows[NB];
            const float *scales[NB];
            const int8_t *zeros[NB];
            channel_block(q, scale, zero, row_bytes, G, n0, nb, rows, scales, zeros);
            if (!direct) dequantize_rows(rows, scales, zeros, &w, K, G, nb, buf);
            for (int64_t m0 = 0; m0 < M; m0 += MB) {
                const int mb = M - m0 < MB ? (int)(M - m0) : MB;
                float out[MB][NB];
                const float *xm = x + m0 * K;
                if (!direct)
                    tiles_float(xm, K, buf, K, mb, nb, out);
#ifdef __AVX512F__
                else if (vector) { /* a partial block computes its first channel again in the spare lanes */
                    switch (mb) {
                    case 1: tile_avx512(xm, K, rows, scales, zeros, &w, K, G, 1, out); break;
                    case 2: tile_avx512(xm, K, rows, scales, zeros, &w, K, G, 2, out); break;
                    case 3: tile_avx512(xm, K, rows, scales, zeros, &w, K, G, 3, out); break;
                    default: tile_avx512(xm, K, rows, scales, zeros, &w, K, G, 4, out); break;
                    }
                }
#endif
#ifdef WOQ_AVX2
                else if (vector) /* a partial block computes its first channel again in the spare lanes */
                    tiles_avx2(xm, K, rows, scales, zeros, &w, K, G, mb, out);
#endif
                else
                    tile_plain(xm, K, rows, scales, zeros, &w, K, G, mb, nb, out);
                store_tile(y, N, m0, n0, mb, nb, out, bias);
            }
        }
        free(buf);
    }
    return failed ? 2 : 0;
}

/* y = x @ w.T (+ bias) for float32 weights w [N, K] (row-major: an nn.Linear's weight) and
 * a few rows (decode steps of a few requests): blocks of NB output channels over the
 * threads, each block's NB weight rows multiplied against every row tile as they are
 * (`tile_float`). torch's GEMM runs such a product on one thread, bound by the weight's
 * reads; here each thread streams its own channels. Returns 0. */
int inflight_float_linear(const float *x, const float *w, const float *bias, float *y, int64_t M, int64_t K,
                          int64_t N, int64_t threads) {
    const int64_t nblocks = (N + NB - 1) / NB;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t blk = 0; blk < nblocks; blk++) {
        const int64_t n0 = blk * NB;
        const int nb = N - n0 < NB ? (int)(N - n0) : NB;
        for (int64_t m0 = 0; m0 < M; m0 += MB) {
            const int mb = M - m0 < MB ? (int)(M - m0) : MB;
            float out[MB][NB];
            tiles_float(x + m0 * K, K, w + n0 * K, K, mb, nb, out);
            store_tile(y, N, m0, n0, mb, nb, out, bias);
        }
    }
    return 0;
}

/* The whole dequantized weight, w [N, K] float32 = (u - shift) * scale in x's column order
 * (prefill-sized batches multiply it with torch's GEMM). Returns 0, or 1 as above. */
int inflight_woq_dequantize(const uint8_t *q, const float *scale, const int8_t *zero, float *out, int64_t K, int64_t N,
                            int64_t G, int64_t bits, int64_t threads) {
    if (refused(K, G, bits)) return 1;
    const walk w = make_walk(K, G, (int)bits);
    const int64_t row_bytes = bits == 8 ? K : K / 2;
    const int64_t nblocks = (N + NB - 1) / NB;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t blk = 0; blk < nblocks; blk++) {
        const int64_t n0 = blk * NB;
        const int nb = N - n0 < NB ? (int)(N - n0) : NB;
        const uint8_t *rows[NB];
        const float *scales[NB];
        const int8_t *zeros[NB];
        channel_block(q, scale, zero, row_bytes, G, n0, nb, rows, scales, zeros);
        dequantize_rows(rows, scales, zeros, &w, K, G, nb, out + n0 * K);
    }
    return 0;
}


