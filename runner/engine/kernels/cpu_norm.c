/* The residual add and RMSNorm between a layer's blocks on a CPU, in one pass over the rows
 * (cpu_norm.py builds and calls this file).
 *
 * torch computes `x + delta` and then `weight * rms_norm(x)` as eight operations on a bf16 input
 * (its CPU rms_norm is composite: widen, square, mean, add, rsqrt, multiply, narrow, then the
 * weight), each a kernel launch and a pass over memory; at a decode step's few rows that took 15-40
 * us a norm, 8% of a step on the ref model. This does the same arithmetic with the same roundings,
 * one row at a time: the sum rounded to the storage type, the sum of squares in float32, the
 * normed row rounded to the storage type, and then the weight's product rounded again. Only the
 * order in which the float32 sum of squares is added differs from torch's.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "c_floats.h"

/* Each storage type gets its own copy of the row loop, so that the compiler vectorizes it (a
 * branch on the type inside the loop keeps it scalar). */
#define ROW(NAME, T, LOAD, ROUND, STORE)                                                                     \
    static void NAME(void *hidden_, const void *delta_, const void *weight_, void *out_, int64_t r, int64_t n,  \
                     float eps) {                                                                            \
        T *hidden = (T *)hidden_ + r * n, *out = (T *)out_ + r * n;                                          \
        const T *delta = delta_ ? (const T *)delta_ + r * n : NULL, *weight = (const T *)weight_;            \
        float squares = 0.0f;                                                                                \
        if (delta) {                                                                                         \
            _Pragma("omp simd reduction(+ : squares)") for (int64_t i = 0; i < n; i++) {                     \
                const float x = ROUND(LOAD(hidden[i]) + LOAD(delta[i]));                                     \
                hidden[i] = STORE(x);                                                                        \
                squares += x * x;                                                                            \
            }                                                                                                \
        } else {                                                                                             \
            _Pragma("omp simd reduction(+ : squares)") for (int64_t i = 0; i < n; i++) {                     \
                const float x = LOAD(hidden[i]);                                                             \
                squares += x * x;                                                                            \
            }                                                                                                \
        }                                                                                                    \
        const float inv = 1.0f / sqrtf(squares / (float)n + eps);                                            \
        _Pragma("omp simd") for (int64_t i = 0; i < n; i++)                                                  \
            out[i] = STORE(LOAD(weight[i]) * ROUND(LOAD(hidden[i]) * inv));                                  \
    }

static inline float same(float f) { return f; }
static inline float f16_round(float f) { return (float)(_Float16)f; }
static inline float from_f16(_Float16 h) { return (float)h; }
static inline _Float16 to_f16(float f) { return (_Float16)f; }
static inline float bf16_round(float f) { return from_bf16(to_bf16(f)); }

ROW(row_f32, float, same, same, same)
ROW(row_bf16, uint16_t, from_bf16, bf16_round, to_bf16)
ROW(row_f16, _Float16, from_f16, f16_round, to_f16)

/* hidden, delta (or NULL) and out: [rows, n], contiguous, of one float kind; weight [n]. With a
 * delta, hidden += delta in place first. out = weight * rms_norm(hidden). Rows are split over
 * `threads` OpenMP threads (torch's count) when there are enough of them to pay for waking a team. */
void add_rms_norm(void *hidden, const void *delta, const void *weight, void *out, int kind, int64_t rows, int64_t n,
                  float eps, int threads) {
    const int team = rows * n >= (1 << 16) ? threads : 1;
#pragma omp parallel for num_threads(team) schedule(static) if (team > 1)
    for (int64_t r = 0; r < rows; r++) {
        if (kind == BF16)
            row_bf16(hidden, delta, weight, out, r, n, eps);
        else if (kind == F32)
            row_f32(hidden, delta, weight, out, r, n, eps);
        else
            row_f16(hidden, delta, weight, out, r, n, eps);
    }
}
