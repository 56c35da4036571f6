/* The neighbour search of llama.cpp's lattice i-quants (quant/ggml/iquant_lattice.py,
 * best_neighbours): for each group of n magnitudes whose rounded levels fell off the grid, the
 * grid point of least weighted squared error among the neighbours listed for its rounded code.
 *
 * The arithmetic is the numpy path's, operation for operation in float32, so the two give the same
 * bytes: diff = s*q - x, term = (w*diff)*diff, d2 += term, coordinates in order (built with
 * -ffp-contract=off: no fused multiply-adds). The first of equal errors wins, and a NaN error never
 * does; where no error is below infinity the first neighbour stands, as numpy's argmin picks it.
 */
#include <math.h>
#include <stdint.h>

void lattice_best_neighbours(int64_t groups, int64_t n, const int32_t *rows, const int32_t *neighbours,
                             int64_t width, const int32_t *counts, const int8_t *points, const float *values,
                             int64_t values_stride, const float *x, const float *w, const float *scale,
                             int32_t *out)
{
    for (int64_t g = 0; g < groups; g++) {
        const int32_t *candidates = neighbours + (int64_t)rows[g] * width;
        const int32_t count = counts[rows[g]];
        const float *xg = x + g * n, *wg = w + g * n, *level_value = values + g * values_stride;
        const float s = scale[g];
        int32_t best = candidates[0];
        float best_d2 = INFINITY;
        for (int32_t k = 0; k < count; k++) {
            const int8_t *p = points + (int64_t)candidates[k] * n;
            float d2 = 0.0f;
            for (int64_t i = 0; i < n; i++) {
                const float diff = s * level_value[p[i]] - xg[i];
                const float term = wg[i] * diff;
                d2 += term * diff;
            }
            if (d2 < best_d2) {
                best_d2 = d2;
                best = candidates[k];
            }
        }
        out[g] = best;
    }
}
