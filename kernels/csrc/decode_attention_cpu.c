/*
 * decode_attention_cpu.c: paged decode attention for the CPU, reading K/V in place.
 *
 * Where it sits: CpuAttnBackend (minisgl/layers/attention/cpu_backend.py), decode mode,
 * called once per layer through ctypes by kernels/decode_attention_cpu.py. Same contract
 * as the Triton decode_attention kernel and its torch reference decode_attention_ref:
 *
 *     o[b, h] = softmax(scaling * q[b, h] . K_b^T) V_b
 *     K_b = k_buffer[req_to_token[req_pool_indices[b], :seq_lens[b]], h / G]
 *
 * Why it exists: torch's SDPA needs each request's keys contiguous, so the torch backend
 * copies every running request's whole K/V history out of the paged pool on every layer
 * of every decode step, then reads the copy again. This kernel walks req_to_token and
 * reads each cached K and V row exactly once, where it lies in the pool.
 *
 * Work split (flash-decoding, as the Triton kernel): one work item is (request, KV chunk),
 * covering all query heads, so each K/V row (all Hkv heads, Hkv * D contiguous floats) is
 * streamed once. When a batch has fewer requests than a few per thread, long requests are
 * cut into chunks of at least MIN_SPLIT_TOKENS; each chunk writes an unnormalised partial
 * output with its max and exp-sum, and a second loop merges a request's chunks.
 *
 * Bound: memory. Bytes: 2 * sum(seq_len) * Hkv * D * 4 (+ 8 per position for the slot id);
 * FLOPs: 4 * sum(seq_len) * Hq * D. About Hq / Hkv / 2 FLOPs per byte: the CPU's bandwidth,
 * not its FMA units, sets the time.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_math.h"

/* Rows fetched ahead of use: slots may be scattered, which the hardware prefetcher cannot follow. */
#ifndef PREFETCH_ROWS
#define PREFETCH_ROWS 4
#endif
/* A chunk shorter than this costs more in merging than it gains in parallelism. */
#define MIN_SPLIT_TOKENS 256
/* Aim for this many work items per thread so dynamic scheduling can balance ragged lengths. */
#define ITEMS_PER_THREAD 4

static void prefetch_row(const void *row, int64_t row_bytes) {
    const char *p = (const char *)row;
    for (int64_t off = 0; off < row_bytes; off += 64) __builtin_prefetch(p + off);
}

/*
 * K/V elements are float32, or bfloat16 when the pool is (--kv-cache-dtype bfloat16: half
 * the bytes, which is what bounds this kernel). A bfloat16 is the top half of a float32,
 * so widening it is a 16-bit shift, which vectorizes; all arithmetic stays float32.
 */
static inline float load_kv(const void *buffer, int64_t i, int bf16) {
    if (bf16) {
        union { uint32_t u; float f; } x = {.u = (uint32_t)((const uint16_t *)buffer)[i] << 16};
        return x.f;
    }
    return ((const float *)buffer)[i];
}

/*
 * One work item: positions [t0, t1) of one request, all Hq heads.
 * Writes acc[Hq, D] = sum_t exp(s_t - m) v_t (unnormalised), m[Hq], l[Hq] = sum_t exp(s_t - m).
 * scores: scratch of at least Hq * (t1 - t0) floats.
 */
static inline __attribute__((always_inline)) void attend_chunk(
    const float *q_b, int64_t q_stride_head, const void *k_buffer, const void *v_buffer, int64_t kv_row,
    const int64_t *slots, int64_t t0, int64_t t1, int64_t Hq, int64_t G, int64_t D, float scaling, float *scores,
    float *acc, float *m, float *l, int bf16) {
    const int64_t n = t1 - t0, row_bytes = kv_row * (bf16 ? 2 : 4);
    for (int64_t h = 0; h < Hq; h++) m[h] = -INFINITY;
    /* pass 1: scores[h, t] = scaling * q[h] . k_t[h / G], and each head's max */
    for (int64_t t = 0; t < n; t++) {
        if (PREFETCH_ROWS > 0 && t + PREFETCH_ROWS < n)
            prefetch_row((const char *)k_buffer + slots[t0 + t + PREFETCH_ROWS] * row_bytes, row_bytes);
        const int64_t k_t = slots[t0 + t] * kv_row; /* element index of this position's row */
        for (int64_t h = 0; h < Hq; h++) {
            const float *q_h = q_b + h * q_stride_head;
            const int64_t k_th = k_t + (h / G) * D;
            float s = 0.f;
#pragma omp simd reduction(+ : s)
            for (int64_t d = 0; d < D; d++) s += q_h[d] * load_kv(k_buffer, k_th + d, bf16);
            s *= scaling;
            scores[h * n + t] = s;
            m[h] = s > m[h] ? s : m[h];
        }
    }
    /* scores -> exp(s - max); the row sums are the softmax denominators */
    for (int64_t h = 0; h < Hq; h++) {
        float sum = 0.f, *s_h = scores + h * n;
        const float m_h = m[h];
#pragma omp simd reduction(+ : sum)
        for (int64_t t = 0; t < n; t++) {
            const float e = exp_nonpositive(s_h[t] - m_h);
            s_h[t] = e;
            sum += e;
        }
        l[h] = sum;
    }
    /* pass 2: acc[h] = sum_t p[h, t] v_t[h / G] */
    memset(acc, 0, sizeof(float) * Hq * D);
    for (int64_t t = 0; t < n; t++) {
        if (PREFETCH_ROWS > 0 && t + PREFETCH_ROWS < n)
            prefetch_row((const char *)v_buffer + slots[t0 + t + PREFETCH_ROWS] * row_bytes, row_bytes);
        const int64_t v_t = slots[t0 + t] * kv_row;
        for (int64_t h = 0; h < Hq; h++) {
            const float p = scores[h * n + t];
            const int64_t v_th = v_t + (h / G) * D;
            float *acc_h = acc + h * D;
#pragma omp simd
            for (int64_t d = 0; d < D; d++) acc_h[d] += p * load_kv(v_buffer, v_th + d, bf16);
        }
    }
}

/* The two element types, each compiled on its own (the flag is a constant inside each). */
static void attend_chunk_f32(const float *q_b, int64_t q_stride_head, const void *k_buffer, const void *v_buffer,
                             int64_t kv_row, const int64_t *slots, int64_t t0, int64_t t1, int64_t Hq, int64_t G,
                             int64_t D, float scaling, float *scores, float *acc, float *m, float *l) {
    attend_chunk(q_b, q_stride_head, k_buffer, v_buffer, kv_row, slots, t0, t1, Hq, G, D, scaling, scores, acc, m, l, 0);
}

static void attend_chunk_bf16(const float *q_b, int64_t q_stride_head, const void *k_buffer, const void *v_buffer,
                              int64_t kv_row, const int64_t *slots, int64_t t0, int64_t t1, int64_t Hq, int64_t G,
                              int64_t D, float scaling, float *scores, float *acc, float *m, float *l) {
    attend_chunk(q_b, q_stride_head, k_buffer, v_buffer, kv_row, slots, t0, t1, Hq, G, D, scaling, scores, acc, m, l, 1);
}

/*
 * Returns 0 on success, 1 if scratch memory could not be allocated.
 * Shapes (checked by the Python wrapper): q [B, Hq, D] (rows may be strided, D contiguous),
 * k_buffer / v_buffer [S, Hkv, D] contiguous, req_to_token [R, r2t_stride] int64,
 * req_pool_indices [B] int64, seq_lens [B] int64, out [B, Hq, D] contiguous.
 */
int decode_attention_cpu_f32(const float *q,               /* [B, Hq, D] one query row per request */
                             int64_t q_stride_tok,         /* floats between two requests' q rows */
                             int64_t q_stride_head,        /* floats between two heads of one row */
                             const void *k_buffer,         /* [S, Hkv, D] this layer's keys, by KV slot */
                             const void *v_buffer,         /* [S, Hkv, D] this layer's values */
                             int kv_bf16,                  /* 1: K/V are bfloat16, 0: float32 */
                             const int64_t *req_to_token,  /* [R, r2t_stride] KV slot of each position */
                             int64_t r2t_stride,           /* positions per req_to_token row */
                             const int64_t *req_pool_indices, /* [B] req_to_token row of each request */
                             const int64_t *seq_lens,      /* [B] positions to attend, this token included */
                             float *out,                   /* [B, Hq, D] attention output */
                             int64_t B, int64_t Hq, int64_t Hkv, int64_t D,
                             float scaling,                /* softmax scale, usually 1 / sqrt(D) */
                             int num_threads) {
    const int64_t G = Hq / Hkv, kv_row = Hkv * D;
    if (B == 0) return 0;

    /* How many chunks each request is cut into: 1 when the batch alone gives every thread work. */
    int64_t target = (int64_t)num_threads * ITEMS_PER_THREAD;
    int64_t want = B >= target ? 1 : (target + B - 1) / B;
    /* the work items of request b are [first_item[b], first_item[b + 1]) */
    int64_t *first_item = (int64_t *)malloc(sizeof(int64_t) * (B + 1));
    if (!first_item) return 1;
    first_item[0] = 0;
    int64_t max_len = 1;
    for (int64_t b = 0; b < B; b++) {
        int64_t by_len = (seq_lens[b] + MIN_SPLIT_TOKENS - 1) / MIN_SPLIT_TOKENS;
        int64_t splits = want < by_len ? want : by_len;
        first_item[b + 1] = first_item[b] + (splits > 0 ? splits : 1);
        if (seq_lens[b] > max_len) max_len = seq_lens[b];
    }
    const int64_t num_items = first_item[B];
    const int split = num_items > B;
    /* Partial results of split requests: [num_items, Hq, D] unnormalised outputs, [num_items, Hq] max and sum. */
    float *part_acc = NULL, *part_m = NULL, *part_l = NULL;
    if (split) {
        part_acc = (float *)malloc(sizeof(float) * num_items * Hq * D);
        part_m = (float *)malloc(sizeof(float) * num_items * Hq);
        part_l = (float *)malloc(sizeof(float) * num_items * Hq);
        if (!part_acc || !part_m || !part_l) {
            free(part_acc), free(part_m), free(part_l), free(first_item);
            return 1;
        }
    }
    int64_t *item_req = (int64_t *)malloc(sizeof(int64_t) * num_items); /* request of each work item */
    if (!item_req) {
        free(part_acc), free(part_m), free(part_l), free(first_item);
        return 1;
    }
    for (int64_t b = 0; b < B; b++)
        for (int64_t it = first_item[b]; it < first_item[b + 1]; it++) item_req[it] = b;
    int failed = 0;

#pragma omp parallel num_threads(num_threads)
    {
        /* per-thread scratch; a chunk never holds more than max_len positions */
        float *scores = (float *)malloc(sizeof(float) * Hq * max_len);
        float *acc = (float *)malloc(sizeof(float) * Hq * D);
        float *m = (float *)malloc(sizeof(float) * Hq);
        float *l = (float *)malloc(sizeof(float) * Hq);
        int ok = scores && acc && m && l;
        if (!ok) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < num_items; item++) {
            if (!ok) continue;
            const int64_t b = item_req[item];
            const int64_t splits = first_item[b + 1] - first_item[b], s = item - first_item[b];
            const int64_t L = seq_lens[b], chunk = (L + splits - 1) / splits;
            const int64_t t0 = s * chunk, t1 = t0 + chunk < L ? t0 + chunk : L;
            const int64_t *slots = req_to_token + req_pool_indices[b] * r2t_stride;
            const float *q_b = q + b * q_stride_tok;
            if (t1 <= t0) { /* an empty chunk (L == 0 or rounding): contributes nothing */
                for (int64_t h = 0; h < Hq; h++) m[h] = -INFINITY, l[h] = 0.f;
                memset(acc, 0, sizeof(float) * Hq * D);
            } else {
                (kv_bf16 ? attend_chunk_bf16 : attend_chunk_f32)(q_b, q_stride_head, k_buffer, v_buffer, kv_row,
                                                                 slots, t0, t1, Hq, G, D, scaling, scores, acc, m, l);
            }
            if (!split) {
                float *o_b = out + b * Hq * D;
                for (int64_t h = 0; h < Hq; h++) {
                    const float inv = l[h] > 0.f ? 1.f / l[h] : 0.f;
                    for (int64_t d = 0; d < D; d++) o_b[h * D + d] = acc[h * D + d] * inv;
                }
            } else {
                memcpy(part_acc + item * Hq * D, acc, sizeof(float) * Hq * D);
                memcpy(part_m + item * Hq, m, sizeof(float) * Hq);
                memcpy(part_l + item * Hq, l, sizeof(float) * Hq);
            }
        }
        /* (implicit barrier) stage 2: merge each request's chunks with their max and exp-sum */
        if (split) {
#pragma omp for schedule(static)
            for (int64_t bb = 0; bb < B; bb++) {
                float *o_b = out + bb * Hq * D;
                for (int64_t h = 0; h < Hq; h++) {
                    float m_all = -INFINITY, l_all = 0.f;
                    for (int64_t it = first_item[bb]; it < first_item[bb + 1]; it++)
                        m_all = part_m[it * Hq + h] > m_all ? part_m[it * Hq + h] : m_all;
                    float *o_h = o_b + h * D;
                    for (int64_t d = 0; d < D; d++) o_h[d] = 0.f;
                    for (int64_t it = first_item[bb]; it < first_item[bb + 1]; it++) {
                        if (part_l[it * Hq + h] == 0.f) continue;
                        const float w = expf(part_m[it * Hq + h] - m_all);
                        l_all += w * part_l[it * Hq + h];
                        const float *a = part_acc + (it * Hq + h) * D;
                        for (int64_t d = 0; d < D; d++) o_h[d] += w * a[d];
                    }
                    const float inv = l_all > 0.f ? 1.f / l_all : 0.f;
                    for (int64_t d = 0; d < D; d++) o_h[d] *= inv;
                }
            }
        }
        free(scores), free(acc), free(m), free(l);
    }
    free(part_acc), free(part_m), free(part_l), free(first_item), free(item_req);
    return failed;
}
