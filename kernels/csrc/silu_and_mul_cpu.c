/*
 * silu_and_mul_cpu.c: the gated-MLP activation, out = silu(gate) * up, float32, CPU.
 *
 * Where it sits: every decoder layer's MLP, between gate_up_proj and down_proj, when the cpu
 * attention backend is on; called through ctypes by kernels/silu_and_mul_cpu.py. Same
 * contract as the torch reference silu_and_mul_ref there (and layers/activation.py):
 *
 *     gate, up = x[:, :I], x[:, I:];   out = gate * sigmoid(gate) * up
 *
 * Why: torch runs it as chunk + silu + mul (two passes and a temporary); its silu is also
 * a vectorized exp, but at decode sizes the op dispatch and the temporary dominate.
 * Bound: memory, 3 * N * I floats moved, ~20 FLOPs per output element (the exp).
 */
#include <stdint.h>

#include "cpu_math.h"

#define PARALLEL_MIN_ELEMS 65536

void silu_and_mul_cpu_f32(const float *x,   /* [N, 2I] rows x_stride apart: gate | up */
                          int64_t x_stride, /* floats between two rows of x */
                          float *out,       /* [N, I] contiguous */
                          int64_t N, int64_t I, int num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(static) if (N * I >= PARALLEL_MIN_ELEMS)
    for (int64_t i = 0; i < N; i++) {
        const float *gate = x + i * x_stride, *up = gate + I;
        float *o = out + i * I;
#pragma omp simd
        for (int64_t j = 0; j < I; j++) {
            const float g = gate[j];
            const float e = exp_nonpositive(g < 0.f ? g : -g); /* exp(-|g|) <= 1: never overflows */
            const float sigmoid = g < 0.f ? e / (1.f + e) : 1.f / (1.f + e);
            o[j] = g * sigmoid * up[j];
        }
    }
}
