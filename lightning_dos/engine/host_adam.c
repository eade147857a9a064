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
 *
 * Every loop over elements is plain C that compilers vectorize for any target: SSE4.2, AVX2, AVX-512, Arm
 * NEON and SVE (tests/test_native_builds.py builds each and asserts so from GCC's vectorization report, by
 * the `vectorized:` markers below). That is why the loop-invariant choices are compile-time constants of one
 * loop per combination (a test inside the loop needs masked vector instructions, which AVX2 and NEON lack, and
 * GCC then leaves the loop scalar), and why the casts are integer arithmetic rather than intrinsics.
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

/* fmaf, correctly rounded, where it is not one instruction (x86 before FMA3: x86-64-v2 and older). glibc's
 * fmaf is a call there, which no compiler vectorizes; this is plain double arithmetic, which they do. The
 * product of two floats is exact in double; the sum is rounded to odd (rounded to nearest, then moved one
 * double ulp towards the exact sum, known from Knuth's TwoSum, when it was inexact and came out even), and a
 * double rounded to odd rounds to float exactly as the exact sum would (53 >= 2 x 24 + 2 bits). Infinities
 * and NaNs come out of the plain sum (their TwoSum error is a NaN, which moves nothing). */
static inline float fma_by_double(float a, float b, float c) {
    double product = (double)a * (double)b, addend = (double)c;
    double sum = product + addend;
    double virtual_addend = sum - product;
    double error = (product - (sum - virtual_addend)) + (addend - virtual_addend);
    int64_t bits;
    memcpy(&bits, &sum, sizeof bits);
    /* Masks (all ones or zero) combined with & and |, not && and || or a multiply: no branch, and only
     * instructions SSE4.2 has for 64-bit lanes, so the loop stays vectorized. */
    int64_t inexact = -(int64_t)((error > 0.0) | (error < 0.0));
    int64_t even = (bits & 1) - 1;
    int64_t toward = 2 * (int64_t)((error > 0.0) == (sum > 0.0)) - 1; /* +1: the exact sum is further from 0 */
    bits += toward & inexact & even;
    memcpy(&sum, &bits, sizeof sum);
    return (float)sum;
}

#if defined(__FP_FAST_FMAF) && !defined(DOS_FMA_BY_DOUBLE) /* the second: tests build the emulation too */
#define FMA fmaf /* one instruction (x86 FMA3, Arm): the compilers vectorize it */
#else
#define FMA fma_by_double
#endif

/* Round to nearest even, as c10::BFloat16 does; a NaN becomes the canonical quiet NaN. */
static inline uint16_t to_bf16(float x) {
    uint32_t bits;
    memcpy(&bits, &x, sizeof bits);
    uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
    return x != x ? (uint16_t)0x7FC0u : (uint16_t)rounded;
}

/* Round to nearest even, as x86's F16C and Arm's FCVT do (torch's vector path; c10::Half too, but for NaNs): a
 * NaN keeps its sign and the top 10 bits of its payload, and is made quiet.
 * Every case is computed and the right one selected, so the loop has no branch: compilers vectorize it where
 * they vectorize no conversion to _Float16 (GCC 12 on x86 without AVX512-FP16, and on Arm). */
static inline uint16_t to_fp16(float x) {
    uint32_t f;
    memcpy(&f, &x, sizeof f);
    uint32_t sign = (f >> 16) & 0x8000u;
    f &= 0x7FFFFFFFu;
    /* A normal half: rebias the exponent from 127 to 15 and round the 13 dropped bits to nearest even. */
    uint32_t normal = (f + 0xC8000FFFu + ((f >> 13) & 1u)) >> 13;
    /* A subnormal half, or zero: adding 2^-1 leaves the rounded subnormal in the low bits of the sum. */
    float magnitude;
    memcpy(&magnitude, &f, sizeof f);
    magnitude += 0.5f;
    uint32_t low;
    memcpy(&low, &magnitude, sizeof low);
    /* Choose by masks (all ones or zero), not ?:, which GCC turns into branches here. */
    uint32_t subnormal = -(uint32_t)(f < 0x38800000u), overflow = -(uint32_t)(f >= 0x477FF000u);
    uint32_t nan = -(uint32_t)(f > 0x7F800000u);
    uint32_t half = (subnormal & (low - 0x3F000000u)) | (~subnormal & normal);
    half = (overflow & 0x7C00u) | (~overflow & half); /* rounds past the largest half: infinity */
    half = (nan & (0x7E00u | ((f >> 13) & 0x3FFu))) | (~nan & half);
    return (uint16_t)(sign | half);
}

/* Elements updated before their block is cast: 4 KiB of fresh weights, still in L1 when the cast reads them.
 * Casting inside the update loop instead measured 25-35% slower (the compiler splits the loop into narrower
 * vectors; bench/RESULTS.md). */
#define BLOCK 1024

/* The casts. On x86 with AVX the 16-bit copy is written with streaming stores: it is read next by a transfer
 * or by the next forward pass, not by this loop, and a streaming store does not read the destination line
 * first (measured 1.69 against 1.43 G elements/s; bench/RESULTS.md). Compilers emit no streaming stores of
 * their own, so there a block is converted into a buffer in L1 by the vectorized loop and then streamed out. */
static void convert_bf16(uint16_t *restrict out, const float *restrict in, int64_t n) {
    for (int64_t i = 0; i < n; i++) out[i] = to_bf16(in[i]); /* vectorized: bf16 cast */
}

static void convert_fp16(uint16_t *restrict out, const float *restrict in, int64_t n) {
    for (int64_t i = 0; i < n; i++) out[i] = to_fp16(in[i]); /* vectorized: fp16 cast */
}

#if defined(__AVX__)
#define STREAMING_STORES 1
#if defined(__AVX512F__)
#define STREAM_BYTES 64
#else
#define STREAM_BYTES 32
#endif

/* dst[0, bytes) = src[0, bytes), the aligned middle with streaming stores; bytes is a multiple of `unit`. */
static void stream_copy(void *dst, const void *src, int64_t bytes, int unit) {
    char *d = dst;
    const char *s = src;
    int64_t i = 0;
    for (; i < bytes && ((uintptr_t)(d + i) % STREAM_BYTES) != 0; i += unit) memcpy(d + i, s + i, unit);
    for (; i + STREAM_BYTES <= bytes; i += STREAM_BYTES) {
#if defined(__AVX512F__)
        _mm512_stream_si512((void *)(d + i), _mm512_loadu_si512((const void *)(s + i)));
#else
        _mm256_stream_si256((__m256i *)(d + i), _mm256_loadu_si256((const __m256i *)(s + i)));
#endif
    }
    if (i < bytes) memcpy(d + i, s + i, bytes - i);
}
#endif

/* lp[begin, end) = param[begin, end) in the target dtype. */
static void cast_block(void *lp, int lp_kind, const float *param, int64_t begin, int64_t end) {
    int64_t n = end - begin;
    if (lp_kind == LP_FP32) {
#if defined(STREAMING_STORES)
        stream_copy((float *)lp + begin, param + begin, n * (int64_t)sizeof(float), sizeof(float));
#else
        memcpy((float *)lp + begin, param + begin, n * sizeof(float));
#endif
        return;
    }
    if (lp_kind != LP_BF16 && lp_kind != LP_FP16) return;
#if defined(STREAMING_STORES)
    uint16_t staged[BLOCK] __attribute__((aligned(64)));
    uint16_t *out = staged;
#else
    uint16_t *out = (uint16_t *)lp + begin;
#endif
    if (lp_kind == LP_BF16) convert_bf16(out, param + begin, n);
    else convert_fp16(out, param + begin, n);
#if defined(STREAMING_STORES)
    stream_copy((uint16_t *)lp + begin, staged, n * (int64_t)sizeof(uint16_t), sizeof(uint16_t));
#endif
}

/* One block's update, the formula of the header: the same statements for every element. `unscale`,
 * `decoupled` and `lerp_small` are constants in each caller below (this is inlined into each), so every
 * combination is its own loop without a test in it, which the compilers vectorize on every target. */
static inline __attribute__((always_inline)) void adam_block(const Job *job, int64_t begin, int64_t end,
                                                             const int unscale, const int decoupled,
                                                             const int lerp_small) {
    float *restrict param = job->param;
    const float *restrict grad = job->grad;
    float *restrict exp_avg = job->exp_avg;
    float *restrict exp_avg_sq = job->exp_avg_sq;
    const float inv_scale = job->inv_scale, decay_factor = job->decay_factor, weight_decay = job->weight_decay;
    const float lerp_coeff = job->lerp_coeff, beta2 = job->beta2, sq_coeff = job->sq_coeff;
    const float bc2_sqrt = job->bc2_sqrt, eps = job->eps, neg_step_size = job->neg_step_size;
    for (int64_t i = begin; i < end; i++) { /* vectorized: element loop */
        float g = grad[i];
        if (unscale) g = g * inv_scale;
        float p = param[i];
        if (decoupled) p = p * decay_factor;
        else g = FMA(p, weight_decay, g);
        float m = exp_avg[i];
        m = lerp_small ? FMA(lerp_coeff, g - m, m) : FMA(lerp_coeff, g - m, g);
        float v = FMA(sq_coeff * g, g, exp_avg_sq[i] * beta2);
        exp_avg[i] = m;
        exp_avg_sq[i] = v;
        float denom = sqrtf(v) / bc2_sqrt + eps;
        param[i] = p + neg_step_size * m / denom;
    }
}

static inline __attribute__((always_inline)) void run_blocks(const Job *job, const int unscale,
                                                             const int decoupled, const int lerp_small) {
    for (int64_t begin = job->begin; begin < job->end; begin += BLOCK) {
        int64_t end = begin + BLOCK < job->end ? begin + BLOCK : job->end;
        adam_block(job, begin, end, unscale, decoupled, lerp_small);
        cast_block(job->lp, job->lp_kind, job->param, begin, end);
    }
}

#define VARIANT(UNSCALE, DECOUPLED, LERP_SMALL) \
    case (UNSCALE) << 2 | (DECOUPLED) << 1 | (LERP_SMALL): run_blocks(job, UNSCALE, DECOUPLED, LERP_SMALL); break;

static void run_job(const Job *job) {
    switch ((job->unscale != 0) << 2 | (job->decoupled != 0) << 1 | (job->lerp_small != 0)) {
        VARIANT(0, 0, 0) VARIANT(0, 0, 1) VARIANT(0, 1, 0) VARIANT(0, 1, 1)
        VARIANT(1, 0, 0) VARIANT(1, 0, 1) VARIANT(1, 1, 0) VARIANT(1, 1, 1)
    }
#if defined(STREAMING_STORES)
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
