/* The split searches of IQ1_S and IQ1_M (quant/ggml/iquant_iq1.py, _best_split and _best_split_m):
 * for each block, the two cut points (i1 <= i2) of its sorted values into the levels -1, 0, 1 and
 * the shift signs whose least-squares scale fits best, from running sums the caller computed.
 *
 * The arithmetic is the numpy path's, operation for operation in float32, so the two give the same
 * bytes (built with -ffp-contract=off: no fused multiply-adds). A candidate replaces the best so far
 * only when sumq2 > 0 and sumqx^2 > best * sumq2, in the numpy path's order of (i1, i2, sign).
 */
#include <float.h>
#include <stdint.h>

static inline void consider(float sumqx, float sumq2, int64_t i1, int64_t i2, int64_t k, float *best, float *scale,
                            int64_t *i1_best, int64_t *i2_best, int64_t *k_best)
{
    if (sumq2 > 0 && sumqx * sumqx > *best * sumq2) {
        *scale = sumqx / sumq2;
        *best = *scale * sumqx;
        *i1_best = i1;
        *i2_best = i2;
        *k_best = k;
    }
}

/* IQ1_S: blocks of n values; sums [blocks, n + 1] from 0; values v[sign] the three shifted levels
 * (plus: sign +1, minus: sign -1). scale holds max|x| on entry (kept where nothing fits). */
void iq1s_split(int64_t blocks, int64_t n, const float *sumx, const float *sumw, const float *plus,
                const float *minus, float *scale, int64_t *i1_best, int64_t *i2_best, int64_t *shift)
{
    for (int64_t b = 0; b < blocks; b++) {
        const float *sx = sumx + b * (n + 1), *sw = sumw + b * (n + 1);
        const float total_x = sx[n], total_w = sw[n];
        float best = -FLT_MAX;
        i1_best[b] = i2_best[b] = -1;
        shift[b] = 0;
        for (int64_t i1 = 0; i1 <= n; i1++) {
            const float a = sx[i1] - sx[0], aw = sw[i1] - sw[0];
            for (int64_t i2 = i1; i2 <= n; i2++) {
                const float bx = sx[i2] - sx[i1], bw = sw[i2] - sw[i1];
                const float c = total_x - sx[i2], cw = total_w - sw[i2];
                for (int s = 0; s < 2; s++) {
                    const float *v = s == 0 ? plus : minus;
                    const float sumqx = a * v[0] + bx * v[1] + c * v[2];
                    const float sumq2 = aw * v[0] * v[0] + bw * v[1] * v[1] + cw * v[2] * v[2];
                    consider(sumqx, sumq2, i1, i2, s == 0 ? 1 : -1, &best, &scale[b], &i1_best[b], &i2_best[b], &shift[b]);
                }
            }
        }
    }
}

/* IQ1_M: blocks of n values in two halves; px, pw [2, blocks, n + 1] running sums of each half's
 * elements in sorted order; the constants as the numpy path computes them (float32). */
void iq1m_split(int64_t blocks, int64_t n, const float *px, const float *pw, float p2, float m2, float cp1, float cp2,
                float cm1, float cm2, float *scale, int64_t *i1_best, int64_t *i2_best, int64_t *k_best)
{
    const int64_t half = blocks * (n + 1);
    for (int64_t b = 0; b < blocks; b++) {
        const float *x0 = px + b * (n + 1), *x1 = x0 + half, *w0 = pw + b * (n + 1), *w1 = w0 + half;
        const float txs[2] = {x0[n], x1[n]}, tws[2] = {w0[n], w1[n]};
        const float tp2[2] = {tws[0] * p2 * p2, tws[1] * p2 * p2}, tm2[2] = {tws[0] * m2 * m2, tws[1] * m2 * m2};
        const float *xs[2] = {x0, x1}, *ws[2] = {w0, w1};
        float best = -FLT_MAX;
        i1_best[b] = i2_best[b] = k_best[b] = -1;
        for (int64_t i1 = 0; i1 <= n; i1++) {
            for (int64_t i2 = i1; i2 <= n; i2++) {
                float qx_p[2], qx_m[2], q2_p[2], q2_m[2];
                for (int h = 0; h < 2; h++) {
                    const float sx = xs[h][i1] + xs[h][i2];
                    qx_p[h] = txs[h] * p2 - sx;
                    qx_m[h] = txs[h] * m2 - sx;
                    q2_p[h] = tp2[h] + ws[h][i1] * cp1 + ws[h][i2] * cp2;
                    q2_m[h] = tm2[h] + ws[h][i1] * cm1 + ws[h][i2] * cm2;
                }
                consider(qx_p[0] + qx_p[1], q2_p[0] + q2_p[1], i1, i2, 0, &best, &scale[b], &i1_best[b], &i2_best[b], &k_best[b]);
                consider(qx_p[0] + qx_m[1], q2_p[0] + q2_m[1], i1, i2, 1, &best, &scale[b], &i1_best[b], &i2_best[b], &k_best[b]);
                consider(qx_m[0] + qx_p[1], q2_m[0] + q2_p[1], i1, i2, 2, &best, &scale[b], &i1_best[b], &i2_best[b], &k_best[b]);
                consider(qx_m[0] + qx_m[1], q2_m[0] + q2_m[1], i1, i2, 3, &best, &scale[b], &i1_best[b], &i2_best[b], &k_best[b]);
            }
        }
    }
}
