/* Decode attention over the paged KV cache on a CPU, reading every key and value in the block where
 * it lies (cpu_attention.py builds and calls this file; paged_attention.py is the GPU's kernel).
 *
 * One task per (sequence, KV head), spread over OpenMP threads (torch's own libgomp, so the same
 * thread pool as torch's ops). A task holds the query rows of every head that shares the KV head
 * (GQA) and of every verify row (m > 1), and walks the sequence's blocks through its block table.
 * Per block: its keys are widened to float32 once and scored against every row (each row's query
 * held in registers), then an online softmax in float32 (a running maximum, sum and weighted sum of
 * values per row) takes in the block's values, widened once too. Row r of a sequence sees its first
 * lengths[s, r] positions (the last `window` of them when window > 0); Gemma's soft-cap applies
 * before the mask, as in the torch path.
 *
 * Head sizes are multiples of 16 (the Python side checks), so every product runs on vectors of 16
 * floats (GCC's vector extension: AVX-512 registers where the CPU has them, two AVX2 ones or four
 * NEON ones elsewhere); the usual head sizes get a copy of the task compiled for their size.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "c_floats.h"

typedef float v16 __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));

static inline v16 load16(const float *p) {
    v16 v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void store16(float *p, v16 v) { memcpy(p, &v, sizeof v); }

/* Lane i: the sum of the lanes of d[j], j being i with its 4 bits reversed (each d[j] lands in
 * the lane its place in the folding tree gives it; callers store into d[REVERSED[i]]). Four
 * rounds of pairwise folds: 30 shuffles for 16 sums, where summing each vector alone takes 64. */
static const int REVERSED[16] = {0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15};

static inline v16 sums16(const v16 *d) {
    v16 e[8], f[4], g[2];
    for (int k = 0; k < 8; k++)
        e[k] = __builtin_shuffle(d[2 * k], d[2 * k + 1], (v16i){0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23})
             + __builtin_shuffle(d[2 * k], d[2 * k + 1], (v16i){8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31});
    for (int k = 0; k < 4; k++)
        f[k] = __builtin_shuffle(e[2 * k], e[2 * k + 1], (v16i){0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27})
             + __builtin_shuffle(e[2 * k], e[2 * k + 1], (v16i){4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31});
    for (int k = 0; k < 2; k++)
        g[k] = __builtin_shuffle(f[2 * k], f[2 * k + 1], (v16i){0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29})
             + __builtin_shuffle(f[2 * k], f[2 * k + 1], (v16i){2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31});
    return __builtin_shuffle(g[0], g[1], (v16i){0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30})
         + __builtin_shuffle(g[0], g[1], (v16i){1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31});
}

/* `rows` rows of `n` values each, `stride` elements apart in `src`, widened into dst [rows][n] */
static inline void widen(const void *src, int kind, int64_t stride, int rows, int n, float *dst) {
    for (int r = 0; r < rows; r++, dst += n) {
        if (kind == F32) {
            memcpy(dst, (const float *)src + r * stride, (size_t)n * sizeof(float));
        } else if (kind == BF16) {
            const uint16_t *s = (const uint16_t *)src + r * stride;
#pragma omp simd
            for (int i = 0; i < n; i++) {
                uint32_t u = (uint32_t)s[i] << 16;
                float f;
                memcpy(&f, &u, sizeof f);
                dst[i] = f;
            }
        } else {
            const _Float16 *s = (const _Float16 *)src + r * stride;
#pragma omp simd
            for (int i = 0; i < n; i++) dst[i] = (float)s[i];
        }
    }
}

/* e^x for x <= 0 in float32 (relative error under 2e-7), 0 below -87: written so that the compiler
 * vectorizes a loop of it, which glibc's expf does not let it do without -ffast-math (and that would
 * also drop the infinities the masking relies on). x = n ln2 + r, |r| <= ln2 / 2 (Cody and Waite's
 * two-part ln2), e^r by its Taylor polynomial to r^7, 2^n put into the exponent's bits; n is
 * rounded by adding and subtracting 1.5 * 2^23, since roundf is a library call. */
static inline float exp_nonpositive(float x) {
    const float y = x < -88.0f ? -88.0f : x; /* -inf too: no undefined conversion below */
    const float n = (y * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    const float r = (y - n * 0.693145751953125f) - n * 1.428606765330187e-06f;
    float p = 1.0f / 5040.0f;
    p = p * r + 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    const int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return x < -87.0f ? 0.0f : p * scale;
}

static inline size_t elem_size(int kind) { return kind == F32 ? 4 : 2; }

struct args {
    const float *q;
    const void *keys, *values;
    int kind;
    int64_t k_block, k_head, k_slot, v_block, v_head, v_slot;
    const int64_t *table;
    int64_t table_width;
    const int64_t *lengths;
    float *out;
    int n, m, heads, kv, block;
    float scale;
    int window;
    float softcap;
};

/* scratch: keys/values of a block [block][max(D, VD)], scores [rows][block rounded up to 16], and per row its
 * running maximum, sum and weighted values [rows][VD] */
static inline __attribute__((always_inline)) void task(const struct args *a, int s, int h, const int D, const int VD,
                                                       float *kvbuf, float *scores, float *run_max, float *run_sum,
                                                       float *acc) {
    const int groups = a->heads / a->kv, rows = a->m * groups, block = a->block, stride = (block + 15) / 16 * 16;
    const size_t esize = elem_size(a->kind);
    const int64_t *len = a->lengths + (int64_t)s * a->m;
    int64_t longest = 0, shortest = INT64_MAX;
    for (int r = 0; r < a->m; r++) {
        longest = len[r] > longest ? len[r] : longest;
        shortest = len[r] < shortest ? len[r] : shortest;
    }
    for (int i = 0; i < rows; i++) {
        run_max[i] = -INFINITY;
        run_sum[i] = 0.0f;
    }
    memset(acc, 0, sizeof(float) * (size_t)rows * VD);
    const int64_t lo = a->window > 0 && shortest - a->window > 0 ? shortest - a->window : 0;
    for (int64_t start = lo - lo % block; start < longest; start += block) {
        const int64_t id = a->table[(int64_t)s * a->table_width + start / block];
        const int slots = longest - start < block ? (int)(longest - start) : block;
        widen((const char *)a->keys + (size_t)(id * a->k_block + h * a->k_head) * esize, a->kind, a->k_slot, slots, D, kvbuf);
        for (int i = 0; i < rows; i++) { /* row i: verify row i / groups of head h * groups + i % groups */
            const float *qi = a->q + (((int64_t)s * a->m + i / groups) * a->heads + h * groups + i % groups) * D;
            v16 qv[D / 16];
            for (int c = 0; c < D / 16; c++) qv[c] = load16(qi + 16 * c);
            float *si = scores + (size_t)i * stride;
            for (int t0 = 0; t0 < slots; t0 += 16) { /* 16 keys' products, then their sums at once */
                v16 dots[16];
                for (int j = 0; j < 16; j++) {
                    const float *k = kvbuf + (size_t)(t0 + j < slots ? t0 + j : t0) * D;
                    v16 dot = qv[0] * load16(k);
                    for (int c = 1; c < D / 16; c++) dot += qv[c] * load16(k + 16 * c);
                    dots[REVERSED[j]] = dot;
                }
                store16(si + t0, sums16(dots) * a->scale);
            }
            if (a->softcap > 0.0f)
                for (int t = 0; t < slots; t++) si[t] = a->softcap * tanhf(si[t] / a->softcap);
            const int64_t seen = len[i / groups]; /* positions [first, seen) of the row's window */
            const int64_t first = a->window > 0 && seen - a->window > 0 ? seen - a->window : 0;
            for (int t = 0; t < slots; t++)
                if (start + t < first || start + t >= seen) si[t] = -INFINITY;
            float top = run_max[i];
#pragma omp simd reduction(max : top)
            for (int t = 0; t < slots; t++) top = si[t] > top ? si[t] : top;
            if (top == -INFINITY) { /* the row sees no key of this block, nor of any before it */
                memset(si, 0, sizeof(float) * slots);
                continue;
            }
            const float rescale = exp_nonpositive(run_max[i] - top);
            float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
            for (int t = 0; t < slots; t++) {
                si[t] = exp_nonpositive(si[t] - top);
                sum += si[t];
            }
            run_sum[i] = run_sum[i] * rescale + sum;
            run_max[i] = top;
            float *ai = acc + (size_t)i * VD;
            for (int d = 0; d < VD; d++) ai[d] *= rescale;
        }
        widen((const char *)a->values + (size_t)(id * a->v_block + h * a->v_head) * esize, a->kind, a->v_slot, slots, VD, kvbuf);
        for (int i = 0; i < rows; i++) {
            float *ai = acc + (size_t)i * VD;
            const float *wi = scores + (size_t)i * stride;
            v16 av[VD / 16];
            for (int c = 0; c < VD / 16; c++) av[c] = load16(ai + 16 * c);
            for (int t = 0; t < slots; t++) {
                const float w = wi[t];
                for (int c = 0; c < VD / 16; c++) av[c] += w * load16(kvbuf + (size_t)t * VD + 16 * c);
            }
            for (int c = 0; c < VD / 16; c++) store16(ai + 16 * c, av[c]);
        }
    }
    for (int i = 0; i < rows; i++) {
        float *o = a->out + (((int64_t)s * a->m + i / groups) * a->heads + h * groups + i % groups) * VD;
        const float inv = run_sum[i] > 0.0f ? 1.0f / run_sum[i] : 0.0f;
        for (int d = 0; d < VD; d++) o[d] = acc[(size_t)i * VD + d] * inv;
    }
}

/* q [n, m, heads, dim] and out [n, m, heads, vdim]: float32, contiguous. keys and values: one
 * layer's [blocks, kv, block, dim] store, strides in elements. table [n, table_width] and lengths
 * [n, m]: int64, contiguous. dim and vdim: multiples of 16. threads: torch's count, passed since a
 * server's worker thread does not inherit the main thread's OpenMP setting. */
void paged_decode_attention(const float *q, const void *keys, const void *values, int kind,
                            int64_t k_block, int64_t k_head, int64_t k_slot,
                            int64_t v_block, int64_t v_head, int64_t v_slot,
                            const int64_t *table, int64_t table_width, const int64_t *lengths, float *out,
                            int n, int m, int heads, int kv, int dim, int vdim, int block,
                            float scale, int window, float softcap, int threads) {
    const struct args a = {q, keys, values, kind, k_block, k_head, k_slot, v_block, v_head, v_slot,
                           table, table_width, lengths, out, n, m, heads, kv, block, scale, window, softcap};
    const int rows = m * (heads / kv), wide = dim > vdim ? dim : vdim, stride = (block + 15) / 16 * 16;
#pragma omp parallel num_threads(threads)
    {
        float *kvbuf = malloc(sizeof(float) * ((size_t)block * wide + (size_t)rows * stride + 2 * (size_t)rows
                                               + (size_t)rows * vdim));
        float *scores = kvbuf + (size_t)block * wide, *run_max = scores + (size_t)rows * stride;
        float *run_sum = run_max + rows, *acc = run_sum + rows;
#pragma omp for collapse(2) schedule(dynamic, 1)
        for (int s = 0; s < n; s++) {
            for (int h = 0; h < kv; h++) {
                if (dim == 64 && vdim == 64)
                    task(&a, s, h, 64, 64, kvbuf, scores, run_max, run_sum, acc);
                else if (dim == 128 && vdim == 128)
                    task(&a, s, h, 128, 128, kvbuf, scores, run_max, run_sum, acc);
                else if (dim == 256 && vdim == 256)
                    task(&a, s, h, 256, 256, kvbuf, scores, run_max, run_sum, acc);
                else
                    task(&a, s, h, dim, vdim, kvbuf, scores, run_max, run_sum, acc);
            }
        }
        free(kvbuf);
    }
}
