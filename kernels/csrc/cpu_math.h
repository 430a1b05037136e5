/*
 * cpu_math.h: small math helpers shared by the C kernels in this directory.
 */
#ifndef MINISGL_CPU_MATH_H
#define MINISGL_CPU_MATH_H

#include <math.h>
#include <stdint.h>

/*
 * exp(x) for x <= 0 (a score minus its row's max), written so the compiler vectorizes it.
 * libm's expf is a scalar call (vectorized only under -ffast-math, whose finite-math rules
 * would break the -INFINITY bookkeeping here); the decode kernel calls it Hq times per cached
 * token per step, SiLU once per MLP activation.
 * x = n ln2 + r with |r| <= ln2 / 2; exp(r) by its degree-6 Taylor polynomial (relative
 * error < 2e-7); 2^n is written straight into the float's exponent bits.
 */
static inline float exp_nonpositive(float x) {
    const float LOG2E = 1.44269504f, LN2_HI = 0.693145752f, LN2_LO = 1.42860677e-6f;
    const float xc = x < -87.f ? -87.f : x; /* keeps 2^n a normal float; the result is 0 below */
    const float n = floorf(xc * LOG2E + 0.5f);
    const float r = (xc - n * LN2_HI) - n * LN2_LO;
    const float p =
        1.f + r * (1.f + r * (0.5f + r * (1.f / 6 + r * (1.f / 24 + r * (1.f / 120 + r * (1.f / 720))))));
    union { int32_t i; float f; } scale = {.i = ((int32_t)n + 127) << 23};
    return x < -87.f ? 0.f : p * scale.f;
}

#endif
