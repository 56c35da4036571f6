/* The float storage types the engine's C kernels read and write, numbered as kernels/__init__.py's
 * C_FLOATS, and bf16's conversions as torch makes them. native.load hashes this header with each
 * kernel's source, so a change here rebuilds every kernel. */
#ifndef QUANTBENCH_C_FLOATS_H
#define QUANTBENCH_C_FLOATS_H

#include <stdint.h>
#include <string.h>

enum { F32 = 0, BF16 = 1, F16 = 2 };

static inline float from_bf16(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* round to nearest, ties to even, as torch's c10::BFloat16 rounds (a NaN stays a NaN) */
static inline uint16_t to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    const uint16_t rounded = (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
    return (u & 0x7fffffffu) > 0x7f800000u ? 0x7fc0 : rounded;
}

#endif
