/* One pass over host memory for a sub-group's update: unscale, Adam (or AdamW) and the cast of the fresh
 * weights into the model's dtype, element by element, so each byte of gradient and state is read once and
 * written once (30 bytes per element for a bf16 target, against ~42 for unscale, Adam and cast as three
 * kernels).
 *
 * The arithmetic is that of torch's CPU fused Adam kernel (aten/src/ATen/native/cpu/FusedAdamKernel.cpp) on
 * its vector path as torch's own build compiles it, operation for operation, in float32: the first moment as
 * torch's lerp (one fused multiply-add), the second moment and Adam's L2 decay each as one fused multiply-add
 * (torch's compiler contracts `v * beta2 + c * g * g` and `g + p * wd`; checked bit for bit against torch
 * 2.13 in tests/test_native_kernel.py), everything else as separate multiplies, adds, a square root and
 * divisions. The unscale is a multiply by the inverse scale, as DeepSpeed unscales. Built with
 * -ffp-contract=off, so the compiler fuses nothing else, and every element (vector body or scalar remainder)
 * rounds the same way: the result does not depend on where a sub-group starts, how it is split over threads,
 * or the machine's vector width. lightning_dos/engine/native.py builds this file with the system C compiler
 * on first use; without one the engine runs torch's kernels.
 */
#include <math.h>
#if defined(__AVX__)
#include <immintrin.h>
#endif
#if !defined(_OPENMP)
#include <pthread.h>
#endif
#include <stdint.h>
#include <string.h>

enum { LP_NONE = 0, LP_BF16 = 1, LP_FP16 = 2, LP_FP32 = 3 };

typedef struct {
    float *param;
    const float *grad;
    float *exp_avg;
    float *exp_avg_sq;
    void *lp;
    int lp_kind;
    int64_t begin, end;
    float inv_scale;    /* multiplies the gradient: 1 / (loss scale x clip), as DeepSpeed unscales */
    int unscale;        /* 0: inv_scale is 1, skip the multiply */
    int decoupled;      /* 1: AdamW (decay on the weights), 0: Adam with L2 (decay added to the gradient) */
    float decay_factor; /* AdamW: float(1 - lr * weight_decay) */
    float weight_decay; /* Adam L2: float(weight_decay) */
    int lerp_small;     /* |1 - beta1| < 0.5: torch's lerp takes its first form */
    float lerp_coeff;   /* float(1 - beta1), or that minus 1 for lerp's second form */
    float beta2;
    float sq_coeff;     /* float(1 - beta2) */
    float bc2_sqrt;     /* float(sqrt(1 - beta2^step)) */
    float eps;
    float neg_step_size; /* float(-lr / (1 - beta1^step)) */
} Job;

/* Round to nearest even, as c10::BFloat16 does; a NaN becomes the canonical quiet NaN. */
static inline uint16_t to_bf16(float x) {
    uint32_t bits;
    memcpy(&bits, &x, sizeof bits);
    uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
    return x != x ? (uint16_t)0x7FC0u : (uint16_t)rounded;
}

#if defined(__FLT16_MAX__) && !defined(DOS_NO_FLOAT16) /* the second: tests build the portable path */
typedef _Float16 half_t; /* the hardware conversion, round to nearest even */
static inline half_t to_fp16(float x) { return (half_t)x; }
#else
/* Round to nearest even by hand where the compiler has no _Float16 (c10::Half's conversion). */
static inline uint16_t to_fp16_bits(float x) {
    uint32_t f;
    memcpy(&f, &x, sizeof f);
    uint32_t sign = (f >> 16) & 0x8000u;
    f &= 0x7FFFFFFFu;
    if (f >= 0x7F800000u) return (uint16_t)(sign | (f > 0x7F800000u ? 0x7E00u : 0x7C00u));
    if (f >= 0x477FF000u) return (uint16_t)(sign | 0x7C00u); /* rounds past the largest half: infinity */
    if (f < 0x38800000u) {                                    /* a subnormal half, or zero */
        float magnitude;
        memcpy(&magnitude, &f, sizeof f);
        magnitude += 0.5f; /* adding 2^-1 leaves the rounded subnormal in the low bits */
        uint32_t m;
        memcpy(&m, &magnitude, sizeof m);
        return (uint16_t)(sign | (m - 0x3F000000u));
    }
    uint32_t odd = (f >> 13) & 1u;
    f += 0xC8000FFFu + odd; /* rebias the exponent from 127 to 15 and round */
    return (uint16_t)(sign | (f >> 13));
}
typedef uint16_t half_t;
static inline half_t to_fp16(float x) { return to_fp16_bits(x); }
#endif

/* Elements updated before their block is cast: 4 KiB of fresh weights, still in L1 when the cast reads them.
 * Casting inside the update loop instead measured 25-35% slower (the compiler splits the loop into narrower
 * vectors; bench/RESULTS.md). */
#define BLOCK 1024

/* The casts below write the 16-bit copy with streaming stores where the CPU has them (AVX): the copy is read
 * next by a transfer or by the next forward pass, not by this loop, and a streaming store does not read the
 * destination line first. Each loop runs scalar until the destination is aligned for the vector store. */

static void cast_bf16(uint16_t *restrict lp, const float *restrict param, int64_t i, int64_t end) {
#if defined(__AVX512F__)
    for (; i < end && ((uintptr_t)(lp + i) & 31u) != 0; i++) lp[i] = to_bf16(param[i]);
    const __m512i one = _mm512_set1_epi32(1), bias = _mm512_set1_epi32(0x7FFF), nan = _mm512_set1_epi32(0x7FC0);
    for (; i + 16 <= end; i += 16) {
        __m512 x = _mm512_loadu_ps(param + i);
        __m512i bits = _mm512_castps_si512(x);
        __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), one);
        __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(bits, bias), lsb), 16);
        rounded = _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(x, x, _CMP_ORD_Q), nan, rounded);
        _mm256_stream_si256((__m256i *)(lp + i), _mm512_cvtepi32_epi16(rounded));
    }
#elif defined(__AVX2__)
    for (; i < end && ((uintptr_t)(lp + i) & 31u) != 0; i++) lp[i] = to_bf16(param[i]);
    const __m256i one = _mm256_set1_epi32(1), bias = _mm256_set1_epi32(0x7FFF), nan = _mm256_set1_epi32(0x7FC0);
    for (; i + 16 <= end; i += 16) {
        __m256i halves[2];
        for (int h = 0; h < 2; h++) {
            __m256 x = _mm256_loadu_ps(param + i + 8 * h);
            __m256i bits = _mm256_castps_si256(x);
            __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), one);
            __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(bits, bias), lsb), 16);
            __m256i ordered = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_ORD_Q));
            halves[h] = _mm256_blendv_epi8(nan, rounded, ordered);
        }
        /* packus interleaves 128-bit lanes (a0-3 b0-3 a4-7 b4-7): put them back in order. */
        __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(halves[0], halves[1]), 0xD8);
        _mm256_stream_si256((__m256i *)(lp + i), packed);
    }
#endif
    for (; i < end; i++) lp[i] = to_bf16(param[i]);
}

static void cast_fp16(half_t *restrict lp, const float *restrict param, int64_t i, int64_t end) {
#if defined(__AVX512F__)
    for (; i < end && ((uintptr_t)(lp + i) & 31u) != 0; i++) lp[i] = to_fp16(param[i]);
    for (; i + 16 <= end; i += 16) {
        __m256i packed = _mm512_cvtps_ph(_mm512_loadu_ps(param + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        _mm256_stream_si256((__m256i *)(lp + i), packed);
    }
#elif defined(__F16C__) && defined(__AVX__)
    for (; i < end && ((uintptr_t)(lp + i) & 15u) != 0; i++) lp[i] = to_fp16(param[i]);
    for (; i + 8 <= end; i += 8) {
        __m128i packed = _mm256_cvtps_ph(_mm256_loadu_ps(param + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        _mm_stream_si128((__m128i *)(lp + i), packed);
    }
#endif
    for (; i < end; i++) lp[i] = to_fp16(param[i]);
}

static void cast_fp32(float *restrict lp, const float *restrict param, int64_t i, int64_t end) {
#if defined(__AVX512F__)
    for (; i < end && ((uintptr_t)(lp + i) & 63u) != 0; i++) lp[i] = param[i];
    for (; i + 16 <= end; i += 16) _mm512_stream_ps(lp + i, _mm512_loadu_ps(param + i));
#elif defined(__AVX__)
    for (; i < end && ((uintptr_t)(lp + i) & 31u) != 0; i++) lp[i] = param[i];
    for (; i + 8 <= end; i += 8) _mm256_stream_ps(lp + i, _mm256_loadu_ps(param + i));
#endif
    for (; i < end; i++) lp[i] = param[i];
}

/* One element's update, the formula of the header: the same statements for every element. */
#define ADAM_LOOP(BEGIN, END)                                                                 \
    for (int64_t i = (BEGIN); i < (END); i++) {                                               \
        float g = grad[i];                                                                    \
        if (unscale) g = g * inv_scale;                                                       \
        float p = param[i];                                                                   \
        if (decoupled) p = p * decay_factor;                                                  \
        else g = fmaf(p, weight_decay, g);                                                    \
        float m = exp_avg[i];                                                                 \
        m = lerp_small ? fmaf(lerp_coeff, g - m, m) : fmaf(lerp_coeff, g - m, g);             \
        float v = fmaf(sq_coeff * g, g, exp_avg_sq[i] * beta2);                               \
        exp_avg[i] = m;                                                                       \
        exp_avg_sq[i] = v;                                                                    \
        float denom = sqrtf(v) / bc2_sqrt + eps;                                              \
        param[i] = p + neg_step_size * m / denom;                                             \
    }

static void run_job(const Job *job) {
    float *restrict param = job->param;
    const float *restrict grad = job->grad;
    float *restrict exp_avg = job->exp_avg;
    float *restrict exp_avg_sq = job->exp_avg_sq;
    const float inv_scale = job->inv_scale, decay_factor = job->decay_factor, weight_decay = job->weight_decay;
    const float lerp_coeff = job->lerp_coeff, beta2 = job->beta2, sq_coeff = job->sq_coeff;
    const float bc2_sqrt = job->bc2_sqrt, eps = job->eps, neg_step_size = job->neg_step_size;
    const int unscale = job->unscale, decoupled = job->decoupled, lerp_small = job->lerp_small;
    for (int64_t begin = job->begin; begin < job->end; begin += BLOCK) {
        int64_t end = begin + BLOCK < job->end ? begin + BLOCK : job->end;
        ADAM_LOOP(begin, end)
        switch (job->lp_kind) {
        case LP_BF16: cast_bf16((uint16_t *)job->lp, param, begin, end); break;
        case LP_FP16: cast_fp16((half_t *)job->lp, param, begin, end); break;
        case LP_FP32: cast_fp32((float *)job->lp, param, begin, end); break;
        default: break;
        }
    }
#if defined(__AVX__)
    _mm_sfence(); /* streaming stores are weakly ordered: complete them before the caller reads the copy */
#endif
}

#define MAX_THREADS 256
/* Threads start on multiples of this many elements: a 64-byte cache line of fp32 state, so no two threads
 * write the same line. */
#define SHARE_ALIGN 16

#if !defined(_OPENMP)
static void *run_job_thread(void *arg) {
    run_job((const Job *)arg);
    return NULL;
}
#endif

/* Update elements [0, numel) with `threads` threads (the caller is one of them). Returns 0, or -1 when a
 * thread could not be started (the caller has then run that share itself: the result is complete). */
int dos_host_adam(float *param, const float *grad, float *exp_avg, float *exp_avg_sq, void *lp, int lp_kind,
                  int64_t numel, float inv_scale, int decoupled, float decay_factor, float weight_decay,
                  int lerp_small, float lerp_coeff, float beta2, float sq_coeff, float bc2_sqrt, float eps,
                  float neg_step_size, int threads) {
    if (threads < 1) threads = 1;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    Job jobs[MAX_THREADS];
    int64_t share = (numel + threads - 1) / threads;
    share = (share + SHARE_ALIGN - 1) / SHARE_ALIGN * SHARE_ALIGN;
    for (int t = 0; t < threads; t++) {
        Job job = {param, grad, exp_avg, exp_avg_sq, lp, lp_kind,
                   t * share < numel ? t * share : numel, (t + 1) * share < numel ? (t + 1) * share : numel,
                   inv_scale, inv_scale != 1.0f, decoupled, decay_factor, weight_decay, lerp_small, lerp_coeff,
                   beta2, sq_coeff, bc2_sqrt, eps, neg_step_size};
        jobs[t] = job;
    }
#if defined(_OPENMP)
    /* On the OpenMP runtime torch itself uses (this library is loaded after torch, so its libgomp.so.1 is
     * torch's copy): the threads that just ran torch's kernels, and may still be spinning, take the shares.
     * Threads of our own would compete with those spinning threads for the cores (measured: 0.95-1.57 G
     * elements/s from one round to the next, against 1.33-1.39 on torch's threads; bench/RESULTS.md). */
#pragma omp parallel for num_threads(threads) schedule(static, 1)
    for (int t = 0; t < threads; t++) run_job(&jobs[t]);
    return 0;
#else
    pthread_t ids[MAX_THREADS];
    int started[MAX_THREADS] = {0};
    int status = 0;
    for (int t = 1; t < threads; t++)
        if (jobs[t].begin != jobs[t].end) started[t] = pthread_create(&ids[t], NULL, run_job_thread, &jobs[t]) == 0;
    run_job(&jobs[0]);
    for (int t = 1; t < threads; t++) {
        if (started[t]) {
            pthread_join(ids[t], NULL);
        } else if (jobs[t].begin != jobs[t].end) {
            run_job(&jobs[t]);
            status = -1;
        }
    }
    return status;
#endif
}
