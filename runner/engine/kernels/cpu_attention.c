/* Decode attention over the paged KV cache on a CPU, reading every key and value in the block where
 * it lies (cpu_attention.py builds and calls this file; paged_attention.py is the GPU's kernel).
 *
 * One task per (sequence, KV head), spread over OpenMP threads (torch's own libgomp, so the same
 * thread pool as torch's ops). A task holds the query rows of every head that shares the KV head
 * (GQA) and of every verify row (m > 1), and walks the sequence's blocks through its block table: a
 * key is widened to float32 once and scored against all of those rows, then an online softmax in
 * float32 (a running maximum, sum and weighted sum of values per row) takes in the block's values.
 * Row r of a sequence sees its first lengths[s, r] positions (the last `window` of them when
 * window > 0); Gemma's soft-cap applies before the mask, as in the torch path.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { F32 = 0, BF16 = 1, F16 = 2 };

static inline void widen(const void *src, int kind, int n, float *dst) {
    if (kind == F32) {
        memcpy(dst, src, (size_t)n * sizeof(float));
    } else if (kind == BF16) {
        const uint16_t *s = (const uint16_t *)src;
#pragma omp simd
        for (int i = 0; i < n; i++) {
            uint32_t u = (uint32_t)s[i] << 16;
            float f;
            memcpy(&f, &u, sizeof f);
            dst[i] = f;
        }
    } else {
        const _Float16 *s = (const _Float16 *)src;
#pragma omp simd
        for (int i = 0; i < n; i++) dst[i] = (float)s[i];
    }
}

static inline size_t elem_size(int kind) { return kind == F32 ? 4 : 2; }

/* q [n, m, heads, dim] and out [n, m, heads, vdim]: float32, contiguous. keys and values: one
 * layer's [blocks, kv, block, dim] store, strides in elements. table [n, table_width] and lengths
 * [n, m]: int64, contiguous. threads: torch's count, passed since a server's worker thread
 * does not inherit the main thread's OpenMP setting. */
void paged_decode_attention(const float *q, const void *keys, const void *values, int kind,
                            int64_t k_block, int64_t k_head, int64_t k_slot,
                            int64_t v_block, int64_t v_head, int64_t v_slot,
                            const int64_t *table, int64_t table_width, const int64_t *lengths, float *out,
                            int n, int m, int heads, int kv, int dim, int vdim, int block,
                            float scale, int window, float softcap, int threads) {
    const int groups = heads / kv, rows = m * groups;
    const size_t esize = elem_size(kind);
#pragma omp parallel num_threads(threads)
    {
        /* per thread: the task's queries, a widened key or value, scores of one block, and the
         * running softmax state of every row */
        float *qs = malloc(sizeof(float) * ((size_t)rows * dim + (dim > vdim ? dim : vdim) + (size_t)rows * block
                                            + 2 * (size_t)rows + (size_t)rows * vdim));
        float *row_buf = qs + (size_t)rows * dim;
        float *scores = row_buf + (dim > vdim ? dim : vdim);
        float *run_max = scores + (size_t)rows * block;
        float *run_sum = run_max + rows;
        float *acc = run_sum + rows;
#pragma omp for collapse(2) schedule(dynamic, 1)
        for (int s = 0; s < n; s++) {
            for (int h = 0; h < kv; h++) {
                const int64_t *len = lengths + (int64_t)s * m;
                int64_t longest = 0, shortest = INT64_MAX;
                for (int r = 0; r < m; r++) {
                    if (len[r] > longest) longest = len[r];
                    if (len[r] < shortest) shortest = len[r];
                }
                for (int i = 0; i < rows; i++) {  /* row i: verify row i / groups of head h * groups + i % groups */
                    memcpy(qs + (size_t)i * dim, q + (((int64_t)s * m + i / groups) * heads + h * groups + i % groups) * dim,
                           sizeof(float) * dim);
                    run_max[i] = -INFINITY;
                    run_sum[i] = 0.0f;
                }
                memset(acc, 0, sizeof(float) * (size_t)rows * vdim);
                int64_t lo = window > 0 && shortest - window > 0 ? shortest - window : 0;
                for (int64_t start = lo - lo % block; start < longest; start += block) {
                    const int64_t id = table[(int64_t)s * table_width + start / block];
                    const char *kb = (const char *)keys + (size_t)(id * k_block + h * k_head) * esize;
                    const char *vb = (const char *)values + (size_t)(id * v_block + h * v_head) * esize;
                    const int slots = longest - start < block ? (int)(longest - start) : block;
                    for (int t = 0; t < slots; t++) {
                        widen(kb + (size_t)(t * k_slot) * esize, kind, dim, row_buf);
                        const int64_t pos = start + t;
                        for (int i = 0; i < rows; i++) {
                            const int64_t seen = len[i / groups];
                            float score = -INFINITY;
                            if (pos < seen && !(window > 0 && pos < seen - window)) {
                                const float *qi = qs + (size_t)i * dim;
                                float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                                for (int d = 0; d < dim; d++) dot += qi[d] * row_buf[d];
                                score = dot * scale;
                                if (softcap > 0.0f) score = softcap * tanhf(score / softcap);
                            }
                            scores[(size_t)i * block + t] = score;
                        }
                    }
                    for (int i = 0; i < rows; i++) {  /* the block's weights, the running state rescaled */
                        float *si = scores + (size_t)i * block, top = run_max[i];
                        for (int t = 0; t < slots; t++) top = si[t] > top ? si[t] : top;
                        if (top == -INFINITY) {  /* no key of this block is seen by the row */
                            for (int t = 0; t < slots; t++) si[t] = 0.0f;
                            continue;
                        }
                        const float rescale = expf(run_max[i] - top);
                        float sum = 0.0f;
                        for (int t = 0; t < slots; t++) {
                            si[t] = expf(si[t] - top);
                            sum += si[t];
                        }
                        run_sum[i] = run_sum[i] * rescale + sum;
                        run_max[i] = top;
                        if (rescale != 1.0f) {
                            float *ai = acc + (size_t)i * vdim;
#pragma omp simd
                            for (int d = 0; d < vdim; d++) ai[d] *= rescale;
                        }
                    }
                    for (int t = 0; t < slots; t++) {
                        widen(vb + (size_t)(t * v_slot) * esize, kind, vdim, row_buf);
                        for (int i = 0; i < rows; i++) {
                            const float w = scores[(size_t)i * block + t];
                            if (w == 0.0f) continue;
                            float *ai = acc + (size_t)i * vdim;
#pragma omp simd
                            for (int d = 0; d < vdim; d++) ai[d] += w * row_buf[d];
                        }
                    }
                }
                for (int i = 0; i < rows; i++) {
                    float *o = out + (((int64_t)s * m + i / groups) * heads + h * groups + i % groups) * vdim;
                    const float inv = run_sum[i] > 0.0f ? 1.0f / run_sum[i] : 0.0f;
                    for (int d = 0; d < vdim; d++) o[d] = acc[(size_t)i * vdim + d] * inv;
                }
            }
        }
        free(qs);
    }
}
