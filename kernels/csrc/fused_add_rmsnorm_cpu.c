/*
 * fused_add_rmsnorm_cpu.c: residual add + RMSNorm in one pass over each row, float32, CPU.
 *
 * Where it sits: every decoder layer, twice, and per head on q/k (Qwen3), when the cpu
 * attention backend is on; called through ctypes by kernels/fused_add_rmsnorm_cpu.py.
 * Same contract as the Triton fused_add_rmsnorm and its reference fused_add_rmsnorm_ref:
 *
 *     residual_out = x + residual        (the caller passes residual = NULL to skip the add)
 *     out          = residual_out / sqrt(mean(residual_out^2) + eps) * weight
 *
 * Why: in torch this is six ops (add, pow, mean, add, rsqrt, two muls), each a pass over
 * the rows plus ~10 us of dispatch; a decode step of 8 layers runs 32 of these norms.
 * Bound: memory, 4 * N * H floats moved (3 without the residual), ~4 FLOPs per element.
 */
#include <math.h>
#include <stdint.h>

/* Below this many elements one thread is faster than waking the OpenMP team. */
#define PARALLEL_MIN_ELEMS 65536

void fused_add_rmsnorm_cpu_f32(const float *x,        /* [N, H] rows x_stride apart, H contiguous */
                               int64_t x_stride,      /* floats between two rows of x */
                               const float *residual, /* [N, H] rows res_stride apart, or NULL */
                               int64_t res_stride,    /* floats between two rows of residual */
                               const float *weight,   /* [H] */
                               float *out,            /* [N, H] contiguous: the normalised rows */
                               float *residual_out,   /* [N, H] contiguous: x + residual (unused if residual is NULL) */
                               int64_t N, int64_t H, float eps, int num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(static) if (N * H >= PARALLEL_MIN_ELEMS)
    for (int64_t i = 0; i < N; i++) {
        const float *x_i = x + i * x_stride;
        const float *r_i = x_i; /* the row that is normalised: x + residual, or x itself */
        float ss = 0.f;
        if (residual) {
            const float *res_i = residual + i * res_stride;
            float *ro_i = residual_out + i * H;
#pragma omp simd reduction(+ : ss)
            for (int64_t d = 0; d < H; d++) {
                const float s = x_i[d] + res_i[d];
                ro_i[d] = s;
                ss += s * s;
            }
            r_i = ro_i;
        } else {
#pragma omp simd reduction(+ : ss)
            for (int64_t d = 0; d < H; d++) ss += x_i[d] * x_i[d];
        }
        const float inv = 1.f / sqrtf(ss / (float)H + eps);
        float *o_i = out + i * H;
#pragma omp simd
        for (int64_t d = 0; d < H; d++) o_i[d] = r_i[d] * inv * weight[d];
    }
}
