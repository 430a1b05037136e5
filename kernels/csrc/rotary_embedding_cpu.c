/*
 * rotary_embedding_cpu.c: rotate q and k in place by their token's position (RoPE, NeoX
 * layout), float32, CPU.
 *
 * Where it sits: every attention layer, after the qkv projection and before attention,
 * when the cpu attention backend is on; called through ctypes by
 * kernels/rotary_embedding_cpu.py. Same contract as the Triton rotary_embedding_inplace
 * (is_neox=True) and its reference rotary_embedding_ref: for each head vector x at
 * position p, with c = cos_sin[p, :D/2] and s = cos_sin[p, D/2:],
 *
 *     x[:D/2] = x1 * c - x2 * s,   x[D/2:] = x2 * c + x1 * s,   x1 = x[:D/2], x2 = x[D/2:]
 *
 * Why: in torch this slices, casts, multiplies, concatenates and copies back (~12 ops per
 * layer, 4.9 ms for a 2,300-token prefill layer on this project's CPU); here it is one
 * read and one write of q and k.
 * Bound: memory, 2 * N * (Hq + Hkv) * D floats read and written, N * D floats of cache.
 */
#include <stdint.h>

#define PARALLEL_MIN_ELEMS 65536

static void rotate_heads(float *x, int64_t stride_head, int64_t num_heads, const float *c, const float *s,
                         int64_t half) {
    for (int64_t h = 0; h < num_heads; h++) {
        float *x1 = x + h * stride_head, *x2 = x1 + half;
#pragma omp simd
        for (int64_t d = 0; d < half; d++) {
            const float a = x1[d], b = x2[d];
            x1[d] = a * c[d] - b * s[d];
            x2[d] = b * c[d] + a * s[d];
        }
    }
}

void rotary_embedding_cpu_f32(const int64_t *positions, /* [N] position of each token */
                              float *q,                 /* [N, Hq, D], D contiguous */
                              int64_t q_stride_tok,     /* floats between two tokens of q */
                              int64_t q_stride_head,    /* floats between two heads of q */
                              float *k,                 /* [N, Hkv, D], D contiguous */
                              int64_t k_stride_tok, int64_t k_stride_head,
                              const float *cos_sin,     /* [max_pos, D]: cos in [:D/2], sin in [D/2:] */
                              int64_t N, int64_t Hq, int64_t Hkv, int64_t D, int num_threads) {
    const int64_t half = D / 2;
#pragma omp parallel for num_threads(num_threads) schedule(static) if (N * (Hq + Hkv) * D >= PARALLEL_MIN_ELEMS)
    for (int64_t i = 0; i < N; i++) {
        const float *c = cos_sin + positions[i] * D, *s = c + half;
        rotate_heads(q + i * q_stride_tok, q_stride_head, Hq, c, s, half);
        rotate_heads(k + i * k_stride_tok, k_stride_head, Hkv, c, s, half);
    }
}
