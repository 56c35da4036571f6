/* The digit rows of an int8 Linear's inputs on a CPU, and the sum of their products, each in one
 * pass (cpu_digits.py builds and calls this file; runner/engine/linear.py's Int8Linear says why
 * digits).
 *
 * Row r of x becomes s_r * (u - top): s_r = max |x_r| / (top - 1), u = round(x / s_r) + top, an
 * integer of 7 * D bits, and u's D digits of 7 bits are written as bytes, digit d of row r at
 * digits[d][r]. In float32 for D = 2 (a bf16 or fp16 model's inputs) and float64 for D = 4 (fp32),
 * the same arithmetic as Int8Linear's torch path, which took eleven operations: at a decode step's
 * one row those cost about 10 ms of a 55 ms token of the 1B shape's int8 variant, where the
 * product itself reads the codes at 94% of the memory's rate. The digits' products are summed back
 * into the output (Horner, less the digits' offset, times the row scale, plus the zero-point's
 * offset and the bias, rounded once to the output's dtype) by digit_sums, in place of five to
 * eight torch operations more. Built with -ffp-contract=off, so that each step rounds as torch's
 * separate operations do.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "c_floats.h"

static inline float load(const void *x, int kind, int64_t i) {
    if (kind == F32) return ((const float *)x)[i];
    if (kind == BF16) return from_bf16(((const uint16_t *)x)[i]);
    return (float)((const _Float16 *)x)[i];
}

/* one row in float32, two digits; the row is widened once, on the stack (n floats: 56 KiB for a
 * 14336-wide input), so that the digit loop vectorizes */
static void row2(const void *x, int kind, int64_t r, int64_t n, int64_t rows, uint8_t *digits, float *scales) {
    const float top = 8192.0f; /* 2^13 */
    float wide[n];
    float most = 0.0f;
    for (int64_t k = 0; k < n; k++) {
        wide[k] = load(x, kind, r * n + k);
        most = fmaxf(most, fabsf(wide[k]));
    }
    const float s = fmaxf(most, FLT_MIN) / (top - 1.0f);
    scales[r] = s;
    uint8_t *low = digits + r * n, *high = digits + (rows + r) * n;
#pragma omp simd
    for (int64_t k = 0; k < n; k++) {
        const int32_t u = (int32_t)nearbyintf(wide[k] / s) + 8192;
        low[k] = (uint8_t)(u & 127);
        high[k] = (uint8_t)(u >> 7);
    }
}

/* one row in float64, four digits */
static void row4(const float *x, int64_t r, int64_t n, int64_t rows, uint8_t *digits, double *scales) {
    const double top = 134217728.0; /* 2^27 */
    double most = 0.0;
    for (int64_t k = 0; k < n; k++) most = fmax(most, fabs((double)x[r * n + k]));
    const double s = fmax(most, (double)FLT_MIN) / (top - 1.0);
    scales[r] = s;
    for (int64_t k = 0; k < n; k++) {
        int64_t u = (int64_t)nearbyint((double)x[r * n + k] / s) + 134217728;
        for (int d = 0; d < 4; d++, u >>= 7) digits[(d * rows + r) * n + k] = (uint8_t)(u & 127);
    }
}

/* x [rows][n] of `kind` (float32 only for D = 4); digits [D][rows][n]; scales [rows], float32 for
 * D = 2 and float64 for D = 4. */
void input_digits(const void *x, int kind, int64_t rows, int64_t n, int D, uint8_t *digits, void *scales, int threads) {
    const int team = rows * n >= (1 << 16) ? threads : 1;
#pragma omp parallel for num_threads(team) schedule(static) if (team > 1)
    for (int64_t r = 0; r < rows; r++) {
        if (D == 2)
            row2(x, kind, r, n, rows, digits, (float *)scales);
        else
            row4((const float *)x, r, n, rows, digits, (double *)scales);
    }
}

/* One output row of D = 2 digits in float32: out [2][rows][m] holds each digit row's product (the
 * weight's channel scales applied). The row's float32 values go through `wide` on the stack, so
 * that the arithmetic loop vectorizes whatever the output's dtype. */
static void sum2(const float *out, int64_t r, int64_t rows, int64_t m, const float *digit_offset, float s, float x_sum,
                 const float *offset, const float *bias, void *y, int kind) {
    const float *low = out + r * m, *high = out + (rows + r) * m;
    float wide[m];
#pragma omp simd
    for (int64_t c = 0; c < m; c++) wide[c] = (low[c] + 128.0f * high[c] - digit_offset[c]) * s;
    if (offset) {
#pragma omp simd
        for (int64_t c = 0; c < m; c++) wide[c] += x_sum * offset[c];
    }
    if (bias) {
#pragma omp simd
        for (int64_t c = 0; c < m; c++) wide[c] += bias[c];
    }
    if (kind == F32) {
        memcpy((float *)y + r * m, wide, m * sizeof(float));
    } else if (kind == BF16) {
        uint16_t *row = (uint16_t *)y + r * m;
#pragma omp simd
        for (int64_t c = 0; c < m; c++) row[c] = to_bf16(wide[c]);
    } else {
        _Float16 *row = (_Float16 *)y + r * m;
#pragma omp simd
        for (int64_t c = 0; c < m; c++) row[c] = (_Float16)wide[c];
    }
}

/* one output row of D = 4 digits in float64, to float32 */
static void sum4(const float *out, int64_t r, int64_t rows, int64_t m, const double *digit_offset, double s, double x_sum,
                 const double *offset, const double *bias, float *y) {
    for (int64_t c = 0; c < m; c++) {
        double v = out[(3 * rows + r) * m + c];
        for (int d = 2; d >= 0; d--) v = (double)out[(d * rows + r) * m + c] + 128.0 * v;
        v = (v - digit_offset[c]) * s;
        if (offset) v += x_sum * offset[c];
        if (bias) v += bias[c];
        y[r * m + c] = (float)v;
    }
}

/* y [rows][m] of `kind` from the digits' products out [D][rows][m] (float32):
 * y = (sum_j 128^j out_j - digit_offset) * scales_r + (sum_k x_rk) * offset + bias, in float32 for
 * D = 2 and float64 for D = 4 (digit_offset, scales, offset and bias in that type; offset and bias
 * may be NULL; x [rows][n] of x_kind is read only for the row sums the offset needs). */
void digit_sums(const float *out, int D, int64_t rows, int64_t m, const void *digit_offset, const void *scales,
                const void *x, int x_kind, int64_t n, const void *offset, const void *bias, void *y, int kind,
                int threads) {
    const int team = rows * m >= (1 << 16) ? threads : 1;
#pragma omp parallel for num_threads(team) schedule(static) if (team > 1)
    for (int64_t r = 0; r < rows; r++) {
        if (D == 2) {
            float x_sum = 0.0f;
            if (offset)
                for (int64_t k = 0; k < n; k++) x_sum += load(x, x_kind, r * n + k);
            sum2(out, r, rows, m, (const float *)digit_offset, ((const float *)scales)[r], x_sum, (const float *)offset,
                 (const float *)bias, y, kind);
        } else {
            double x_sum = 0.0;
            if (offset)
                for (int64_t k = 0; k < n; k++) x_sum += (double)((const float *)x)[r * n + k];
            sum4(out, r, rows, m, (const double *)digit_offset, ((const double *)scales)[r], x_sum, (const double *)offset,
                 (const double *)bias, (float *)y);
        }
    }
}
