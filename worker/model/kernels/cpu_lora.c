/* Batched LoRA delta on the CPU, segment by segment (SGMV, as Punica computes it: Chen et
 * al. 2023): the step's tokens that use an adapter are listed grouped by slot (`order`,
 * with segment g holding order[seg_start[g] .. seg_start[g+1]) of slot seg_slot[g]), and
 * for each of them
 *
 *     y[t, :] += (x[t, :] @ a[s]) @ b[s]
 *
 * with a: [loras, in, r] (each slot's A^T, zero past its rank) and b: [loras, r, out]
 * (each slot's (B * scale)^T), all float32; rows of x and y are `x_stride` / `y_stride`
 * floats apart and are read and written in place by index (no gather, no scatter).
 *
 * Tokens are taken four at a time within a segment: each row of A (r floats, up to four
 * 16-wide vectors) is loaded once for four independent accumulations, whose four chains
 * also hide the FMA latency one token's would expose; the four rank-r intermediates stay
 * in registers. The expansion goes 16 output columns at a time (a masked tail), each row
 * of B loaded once for the four tokens. Blocks are spread over OpenMP threads when the
 * work pays for waking them.
 *
 * AVX-512, or AVX2 with FMA (x86 without AVX-512): 8-wide vectors in 16 registers hold
 * four tokens' intermediates 16 rank columns at a time (x re-read per 16 ranks, from L1),
 * masked tails by maskload / maskstore. Built with neither, `inflight_lora_sgmv` returns 2
 * (the caller keeps its torch path, as it does for 1: r outside 1..MAX_RANK). */
#include <stdint.h>

#define MAX_RANK 64
#define TB 4                    /* tokens per block */
#define PARALLEL_MACS (1 << 16) /* a few us of work on one core: below it, one thread */
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
#define LORA_AVX2 1
#endif

/* The vector width in float lanes: 16 (AVX-512), 8 (AVX2 + FMA), 0 (neither: no kernel). */
int inflight_lora_vectorized(void) {
#if defined(__AVX512F__)
    return 16;
#elif defined(LORA_AVX2)
    return 8;
#else
    return 0;
#endif
}

#if defined(__AVX512F__) || defined(LORA_AVX2)
#include <immintrin.h>
#endif

#ifdef LORA_AVX2
/* lanes below n (n < 8: a tail) as maskload's mask */
static inline __m256i lanes(int64_t n) {
    const __m256i iota = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(n < 8 ? n : 8)), iota);
}

static inline void block(const float *x, int64_t x_stride, float *y, int64_t y_stride, const float *as,
                         const float *bs, const int64_t *rows, int64_t nt, int64_t in, int64_t out, int64_t r) {
    const float *xr[TB]; /* rows past nt repeat row 0: computed, never written */
    float *yr[TB];
    for (int i = 0; i < TB; i++) {
        xr[i] = x + rows[i < nt ? i : 0] * x_stride;
        yr[i] = y + rows[i < nt ? i : 0] * y_stride;
    }
    float hs[TB][MAX_RANK];
    for (int64_t r0 = 0; r0 < r; r0 += 16) { /* 16 rank columns: 4 tokens x 2 vectors of accumulators */
        const __m256i m0 = lanes(r - r0), m1 = lanes(r - r0 - 8);
        const int two = r - r0 > 8;
        __m256 h[TB][2];
        for (int i = 0; i < TB; i++) h[i][0] = h[i][1] = _mm256_setzero_ps();
        for (int64_t k = 0; k < in; k++) {
            const float *ak = as + k * r + r0;
            const __m256 x0 = _mm256_broadcast_ss(xr[0] + k), x1 = _mm256_broadcast_ss(xr[1] + k);
            const __m256 x2 = _mm256_broadcast_ss(xr[2] + k), x3 = _mm256_broadcast_ss(xr[3] + k);
            const __m256 a0 = _mm256_maskload_ps(ak, m0);
            h[0][0] = _mm256_fmadd_ps(x0, a0, h[0][0]);
            h[1][0] = _mm256_fmadd_ps(x1, a0, h[1][0]);
            h[2][0] = _mm256_fmadd_ps(x2, a0, h[2][0]);
            h[3][0] = _mm256_fmadd_ps(x3, a0, h[3][0]);
            if (two) {
                const __m256 a1 = _mm256_maskload_ps(ak + 8, m1);
                h[0][1] = _mm256_fmadd_ps(x0, a1, h[0][1]);
                h[1][1] = _mm256_fmadd_ps(x1, a1, h[1][1]);
                h[2][1] = _mm256_fmadd_ps(x2, a1, h[2][1]);
                h[3][1] = _mm256_fmadd_ps(x3, a1, h[3][1]);
            }
        }
        for (int i = 0; i < TB; i++) { /* hs is MAX_RANK wide: whole vectors fit past r */
            _mm256_storeu_ps(hs[i] + r0, h[i][0]);
            _mm256_storeu_ps(hs[i] + r0 + 8, h[i][1]);
        }
    }
    for (int64_t o = 0; o < out; o += 8) {
        const __m256i m = lanes(out - o);
        __m256 c0 = _mm256_setzero_ps(), c1 = _mm256_setzero_ps(), c2 = _mm256_setzero_ps(), c3 = _mm256_setzero_ps();
        for (int64_t j = 0; j < r; j++) {
            const __m256 bv = _mm256_maskload_ps(bs + j * out + o, m);
            c0 = _mm256_fmadd_ps(_mm256_broadcast_ss(hs[0] + j), bv, c0);
            c1 = _mm256_fmadd_ps(_mm256_broadcast_ss(hs[1] + j), bv, c1);
            c2 = _mm256_fmadd_ps(_mm256_broadcast_ss(hs[2] + j), bv, c2);
            c3 = _mm256_fmadd_ps(_mm256_broadcast_ss(hs[3] + j), bv, c3);
        }
        const __m256 c[TB] = {c0, c1, c2, c3};
        for (int i = 0; i < nt; i++)
            _mm256_maskstore_ps(yr[i] + o, m, _mm256_add_ps(_mm256_maskload_ps(yr[i] + o, m), c[i]));
    }
}
#endif

#ifdef __AVX512F__

static inline void block(const float *x, int64_t x_stride, float *y, int64_t y_stride, const float *as,
                         const float *bs, const int64_t *rows, int64_t nt, int64_t in, int64_t out, int64_t r) {
    const int64_t rv = (r + 15) / 16;
    const __mmask16 rtail = r % 16 ? (__mmask16)((1u << (r % 16)) - 1) : (__mmask16)0xFFFF;
    __m512 h[TB][MAX_RANK / 16];
    for (int i = 0; i < TB; i++)
        for (int v = 0; v < MAX_RANK / 16; v++) h[i][v] = _mm512_setzero_ps();
    const float *xr[TB]; /* rows past nt repeat row 0: computed, never written */
    float *yr[TB];
    for (int i = 0; i < TB; i++) {
        xr[i] = x + rows[i < nt ? i : 0] * x_stride;
        yr[i] = y + rows[i < nt ? i : 0] * y_stride;
    }
    for (int64_t k = 0; k < in; k++) {
        const float *ak = as + k * r;
        const __m512 x0 = _mm512_set1_ps(xr[0][k]), x1 = _mm512_set1_ps(xr[1][k]);
        const __m512 x2 = _mm512_set1_ps(xr[2][k]), x3 = _mm512_set1_ps(xr[3][k]);
        for (int64_t v = 0; v < rv; v++) {
            const __m512 av = _mm512_maskz_loadu_ps(v == rv - 1 ? rtail : (__mmask16)0xFFFF, ak + 16 * v);
            h[0][v] = _mm512_fmadd_ps(x0, av, h[0][v]);
            h[1][v] = _mm512_fmadd_ps(x1, av, h[1][v]);
            h[2][v] = _mm512_fmadd_ps(x2, av, h[2][v]);
            h[3][v] = _mm512_fmadd_ps(x3, av, h[3][v]);
        }
    }
    float hs[TB][MAX_RANK];
    for (int i = 0; i < TB; i++)
        for (int64_t v = 0; v < rv; v++) _mm512_storeu_ps(hs[i] + 16 * v, h[i][v]);
    for (int64_t o = 0; o < out; o += 16) {
        const __mmask16 m = out - o >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (out - o)) - 1);
        __m512 c0 = _mm512_setzero_ps(), c1 = _mm512_setzero_ps(), c2 = _mm512_setzero_ps(), c3 = _mm512_setzero_ps();
        for (int64_t j = 0; j < r; j++) {
            const __m512 bv = _mm512_maskz_loadu_ps(m, bs + j * out + o);
            c0 = _mm512_fmadd_ps(_mm512_set1_ps(hs[0][j]), bv, c0);
            c1 = _mm512_fmadd_ps(_mm512_set1_ps(hs[1][j]), bv, c1);
            c2 = _mm512_fmadd_ps(_mm512_set1_ps(hs[2][j]), bv, c2);
            c3 = _mm512_fmadd_ps(_mm512_set1_ps(hs[3][j]), bv, c3);
        }
        const __m512 c[TB] = {c0, c1, c2, c3};
        for (int i = 0; i < nt; i++)
            _mm512_mask_storeu_ps(yr[i] + o, m, _mm512_add_ps(_mm512_maskz_loadu_ps(m, yr[i] + o), c[i]));
    }
}
#endif

int inflight_lora_sgmv(const float *x, int64_t x_stride, float *y, int64_t y_stride, const float *a,
                       const float *b, const int64_t *order, const int64_t *seg_start, const int64_t *seg_slot,
                       int64_t segments, int64_t in, int64_t out, int64_t r, int64_t threads) {
#if !defined(__AVX512F__) && !defined(LORA_AVX2)
    (void)x; (void)x_stride; (void)y; (void)y_stride; (void)a; (void)b; (void)order; (void)seg_start;
    (void)seg_slot; (void)segments; (void)in; (void)out; (void)r; (void)threads;
    return 2;
#else
    if (r > MAX_RANK || r < 1) return 1;
    const int64_t n = seg_start[segments] - seg_start[0];
    const int64_t work = n * r * (in + out);
    /* blocks of TB tokens, none straddling two segments, numbered across segments for the threads */
    int64_t nblocks = 0;
    for (int64_t g = 0; g < segments; g++) nblocks += (seg_start[g + 1] - seg_start[g] + TB - 1) / TB;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && work > PARALLEL_MACS)
    for (int64_t bi = 0; bi < nblocks; bi++) {
        int64_t g = 0, first = bi;
        while (first >= (seg_start[g + 1] - seg_start[g] + TB - 1) / TB) {
            first -= (seg_start[g + 1] - seg_start[g] + TB - 1) / TB;
            g++;
        }
        const int64_t start = seg_start[g] + TB * first;
        const int64_t nt = seg_start[g + 1] - start < TB ? seg_start[g + 1] - start : TB;
        block(x, x_stride, y, y_stride, a + seg_slot[g] * in * r, b + seg_slot[g] * r * out, order + start, nt, in,
              out, r);
    }
    return 0;
#endif
}
