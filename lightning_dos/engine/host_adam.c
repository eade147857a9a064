/* One pass over host memory for a sub-group's update: unscale, the optimizer's step (Adam or AdamW, Adagrad,
 * Lion: model/update_rules.py describes each) and the cast of the fresh weights into the model's dtype, element
 * by element, so each byte of gradient and state is read once and written once (30 bytes per element for Adam
 * into a bf16 target, against ~42 for unscale, Adam and cast as three kernels).
 *
 * Adam's and Adagrad's arithmetic is that of their torch formula (UpdateRule.torch_update) as torch's own build
 * computes it on its vector path, operation for operation, in float32. Adam: torch's CPU fused Adam kernel
 * (aten/src/ATen/native/cpu/FusedAdamKernel.cpp): the first moment as torch's lerp (one fused multiply-add), the
 * second moment and Adam's L2 decay each as one fused multiply-add (torch's compiler contracts
 * `v * beta2 + c * g * g` and `g + p * wd`), everything else as separate multiplies, adds, a square root and
 * divisions. Adagrad: see its loop. Each is checked bit for bit against torch 2.13 in tests/test_native_kernel.py
 * and tests/test_native_rules.py. Lion's is DeepSpeed's DeepSpeedCPULion as DeepSpeed builds it for this CPU (see
 * its loop; checked bit for bit against DeepSpeed's op in tests/test_native_rules.py). The unscale is a multiply
 * by the inverse scale, as DeepSpeed unscales. Built with -ffp-contract=off, so the compiler fuses nothing else,
 * and every element rounds the same way wherever a thread's share starts: the result does not depend on how a
 * call is split over threads, or on the machine's vector width. (The last few elements of a call round as the
 * reference's own remainder loop rounds them, as the reference called on the same tensor does: torch's scalar
 * remainder for Adam, adam_scalar_from; DeepSpeed's scalar loop for Lion.) lightning_dos/engine/native.py
 * builds this file with the system C compiler on first use; without one the engine runs torch's kernels.
 *
 * Master weights and gradient are fp32 or bf16, the states fp32 or (beside bf16 master weights) bf16: a bf16
 * value is loaded into fp32 exactly, the step is computed as for fp32, and the result stored rounded to nearest
 * even (DeepSpeed's CPU optimizers' store_16_f32_as_bf16_nearest, and torch's .to(torch.bfloat16)); the 16-bit
 * copy is cast from the stored master weights, as DeepSpeed copies its 16-bit partition from its master partition.
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
enum { RULE_ADAM = 0, RULE_ADAGRAD = 1, RULE_LION = 2 };
/* Storage of the master weights and gradient, and of the states: fp32 throughout, bf16 master weights and
 * gradient with fp32 states, or all bf16 (DeepSpeed keeps bf16 states only beside bf16 master weights). */
enum { DTYPES_FP32 = 0, DTYPES_BF16_MASTER = 1, DTYPES_BF16 = 2 };

/* The scalars of one step, each rule reading its own (float: rounded once from Python's double, as torch
 * rounds a scalar argument to the tensor's dtype, and as DeepSpeed's CPU ops take theirs). */
typedef struct {
    int decoupled;      /* Adam: 1 for AdamW (decay on the weights), 0 for Adam with L2 (decay added to the
                         * gradient). Adagrad, Lion: 1 when there is a decay term at all. */
    float decay_factor; /* AdamW: float(1 - lr * weight_decay) */
    float weight_decay; /* Adam L2, Adagrad, Lion: float(weight_decay) */
    int lerp_small;     /* Adam: |1 - beta1| < 0.5, torch's lerp takes its first form */
    float lerp_coeff;   /* Adam: float(1 - beta1), or that minus 1 for lerp's second form */
    float beta1;        /* Lion: float(beta1) */
    float beta2;        /* Adam, Lion: float(beta2) */
    float sq_coeff;     /* Adam: float(1 - beta2) */
    float bc2_sqrt;     /* Adam: float(sqrt(1 - beta2^step)) */
    float eps;          /* Adam, Adagrad */
    float neg_step_size; /* Adam: float(-lr / (1 - beta1^step)); Adagrad: float(-lr / (1 + (step - 1) * lr_decay));
                          * Lion: float(lr) */
    int torch_width;    /* Adam: the float vector width of the torch kernel reproduced (16 under torch's AVX-512
                         * build, 8 under its AVX2 build), whose scalar remainder the last elements of a call take
                         * (adam_scalar_from); 0: every element as the vector body */
} Step;

typedef struct {
    void *param;        /* float or bf16 (uint16_t), as `dtypes` says; so are grad and the states */
    const void *grad;
    void *state0;       /* Adam: exp_avg; Adagrad: sum; Lion: exp_avg */
    void *state1;       /* Adam: exp_avg_sq; unused by the others */
    void *param_out, *state0_out, *state1_out; /* NULL: in place; else the new values go here (speculation) */
    void *lp;
    int lp_kind, rule, dtypes;
    int64_t begin, end;
    float inv_scale;    /* multiplies the gradient: 1 / (loss scale x clip), as DeepSpeed unscales */
    int unscale;        /* 0: inv_scale is 1, skip the multiply */
    Step s;
    int64_t lion_vector_end; /* Lion: elements before this take DeepSpeed's vector body, the rest its scalar loop */
    int64_t adam_scalar_from; /* Adam: elements from this one on take torch's scalar remainder (adam_scalar_from) */
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

/* lp[begin, begin + n) = fresh[0, n) in the target dtype: `fresh` holds the block's new weights in fp32. */
static void cast_block(void *lp, int lp_kind, const float *fresh, int64_t begin, int64_t n) {
    if (lp_kind == LP_FP32) {
#if defined(STREAMING_STORES)
        stream_copy((float *)lp + begin, fresh, n * (int64_t)sizeof(float), sizeof(float));
#else
        memcpy((float *)lp + begin, fresh, n * sizeof(float));
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
    if (lp_kind == LP_BF16) convert_bf16(out, fresh, n);
    else convert_fp16(out, fresh, n);
#if defined(STREAMING_STORES)
    stream_copy((uint16_t *)lp + begin, staged, n * (int64_t)sizeof(uint16_t), sizeof(uint16_t));
#endif
}

/* A bf16 value as fp32: exact (bf16 is the top half of an fp32). */
static inline float from_bf16(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float x;
    memcpy(&x, &bits, sizeof x);
    return x;
}

/* Element i of an fp32 or bf16 array (`bf16` is a constant in every loop, so each loop has one kind of load),
 * and the store back, rounded to nearest even for bf16. Both views of the array are passed; the loop uses one. */
#define LOAD(BF16, F32, H16, I) ((BF16) ? from_bf16((H16)[I]) : (F32)[I])
#define STORE(BF16, F32, H16, I, X) do { if (BF16) (H16)[I] = to_bf16(X); else (F32)[I] = (X); } while (0)

/* The views every loop takes of a job's arrays: fp32 and bf16 pointers to the same memory (a loop uses one of
 * each pair, so `restrict` holds), and the same of the `_out` arrays (`_o`). */
#define VIEW(JOB, NAME)                                                                         \
    float *restrict NAME = (float *)(JOB)->NAME;                                                \
    uint16_t *restrict NAME##_h = (uint16_t *)(JOB)->NAME;                                      \
    float *restrict NAME##_o = (float *)(JOB)->NAME##_out;                                      \
    uint16_t *restrict NAME##_h_o = (uint16_t *)(JOB)->NAME##_out;                              \
    (void)NAME, (void)NAME##_h, (void)NAME##_o, (void)NAME##_h_o
#define VIEWS(JOB)                                                                              \
    VIEW(JOB, param);                                                                           \
    VIEW(JOB, state0);                                                                          \
    VIEW(JOB, state1);                                                                          \
    const float *restrict grad = (JOB)->grad;                                                   \
    const uint16_t *restrict grad_h = (JOB)->grad;                                              \
    const float inv_scale = (JOB)->inv_scale;                                                   \
    (void)grad_h, (void)inv_scale

/* The array a loop stores into: the input's own (in place) or its `_o` twin (out of place): `outplace` is constant
 * in each loop, so no two restrict pointers it uses alias (an in-place loop's `_o` pointers are NULL, untouched). */
#define OUT(P) (outplace ? P##_o : P)

/* The new weight p of element i: stored (rounded for bf16 master weights), and the stored value kept in fp32 in
 * `fresh` for the cast when the master weights are bf16 (the 16-bit copy is cast from the stored master weights, as
 * DeepSpeed copies its 16-bit partition from its master partition; with fp32 master weights the cast reads them). */
#define STORE_WEIGHT(MASTER16, I, P)                                                                      \
    do {                                                                                                  \
        const uint16_t stored = to_bf16(P); /* unused (and dropped) for fp32 master weights */            \
        if (MASTER16) OUT(param_h)[I] = stored, fresh[(I) - begin] = from_bf16(stored);                   \
        else OUT(param)[I] = (P);                                                                         \
    } while (0)

/* Adam's element i, the formula of the header, in torch's vector body's form or (REMAINDER) its scalar
 * remainder's: the body's contraction fuses the gradient's product into the second moment's add; the remainder's
 * (`v = v * beta2; v = v + c * g * g`, contracted by torch's compiler the other way) fuses the decay's. */
#define ADAM_ELEMENT(I, REMAINDER)                                                                        \
    do {                                                                                                  \
        float g = LOAD(master16, grad, grad_h, I);                                                        \
        if (unscale) g = g * inv_scale;                                                                   \
        float p = LOAD(master16, param, param_h, I);                                                      \
        if (decoupled) p = p * decay_factor;                                                              \
        else g = FMA(p, weight_decay, g);                                                                 \
        float m = LOAD(states16, state0, state0_h, I);                                                    \
        m = lerp_small ? FMA(lerp_coeff, g - m, m) : FMA(lerp_coeff, g - m, g);                           \
        const float v0 = LOAD(states16, state1, state1_h, I);                                             \
        float v = (REMAINDER) ? FMA(v0, beta2, sq_coeff * g * g) : FMA(sq_coeff * g, g, v0 * beta2);      \
        STORE(states16, OUT(state0), OUT(state0_h), I, m);                                                \
        STORE(states16, OUT(state1), OUT(state1_h), I, v);                                                \
        float denom = sqrtf(v) / bc2_sqrt + eps;                                                          \
        STORE_WEIGHT(master16, I, p + neg_step_size * m / denom);                                         \
    } while (0)

/* The step's scalars ADAM_ELEMENT reads, as locals. */
#define ADAM_SCALARS(JOB)                                                                                 \
    const float decay_factor = (JOB)->s.decay_factor, weight_decay = (JOB)->s.weight_decay;               \
    const float lerp_coeff = (JOB)->s.lerp_coeff, beta2 = (JOB)->s.beta2, sq_coeff = (JOB)->s.sq_coeff;   \
    const float bc2_sqrt = (JOB)->s.bc2_sqrt, eps = (JOB)->s.eps, neg_step_size = (JOB)->s.neg_step_size

/* Adam's block in torch's vector body's form: the same statements for every element. `unscale`, `decoupled`,
 * `lerp_small` and the two storage choices are constants in each caller below (this is inlined into each), so
 * every combination is its own loop without a test in it, which the compilers vectorize on every target. */
static inline __attribute__((always_inline)) void adam_block(const Job *job, float *restrict fresh, int64_t begin,
                                                             int64_t end, const int unscale, const int decoupled,
                                                             const int lerp_small, const int master16,
                                                             const int states16, const int outplace) {
    VIEWS(job);
    ADAM_SCALARS(job);
    /* Element i reads and writes element i only, and the out-of-place loop's seven arrays are distinct: without
     * the pragma GCC versions the loop for aliasing and, past its limit of checks (x86-64-v2), keeps it scalar. */
#pragma GCC ivdep
    for (int64_t i = begin; i < end; i++) { /* vectorized: adam loop */
        ADAM_ELEMENT(i, 0);
    }
}

/* Adam's elements [begin, end) in torch's scalar remainder's form: at most 15 of a call, so one loop out of line
 * with the choices tested inside (inlined into every variant, it kept GCC from vectorizing other loops there). */
static __attribute__((noinline)) void adam_remainder(const Job *job, float *restrict fresh, int64_t begin,
                                                     int64_t end, const int unscale, const int decoupled,
                                                     const int lerp_small, const int master16, const int states16,
                                                     const int outplace) {
    VIEWS(job);
    ADAM_SCALARS(job);
    for (int64_t i = begin; i < end; i++) ADAM_ELEMENT(i, 1);
}

/* Adagrad's block: torch.optim.Adagrad's single-tensor step as ATen's AVX2 kernels compute it (checked bit for
 * bit, vector body and tail, in tests/test_native_kernel.py): `grad.add(param, alpha=wd)` is one fused
 * multiply-add (ATen's vector add is fmadd(b, alpha, a)); `sum.addcmul_(g, g, value=1)` is fma(g, g, sum) (its
 * `self + value * t1 * t2`, contracted by torch's compiler; value * g is exact for value 1); `sqrt().add_(eps)`
 * two roundings; `param.addcdiv_(g, std, value=-clr)` is `p + (-clr * g) / std`, three roundings. */
static inline __attribute__((always_inline)) void adagrad_block(const Job *job, float *restrict fresh,
                                                                int64_t begin, int64_t end, const int unscale,
                                                                const int decays, const int master16,
                                                                const int states16, const int outplace) {
    VIEWS(job);
    const float weight_decay = job->s.weight_decay, eps = job->s.eps, neg_clr = job->s.neg_step_size;
    for (int64_t i = begin; i < end; i++) { /* vectorized: adagrad loop */
        float g = LOAD(master16, grad, grad_h, i);
        if (unscale) g = g * inv_scale;
        float p = LOAD(master16, param, param_h, i);
        if (decays) g = FMA(p, weight_decay, g);
        float sum = FMA(g, g, LOAD(states16, state0, state0_h, i));
        STORE(states16, OUT(state0), OUT(state0_h), i, sum);
        float std = sqrtf(sum) + eps;
        STORE_WEIGHT(master16, i, p + neg_clr * g / std);
    }
}

/* Lion: what DeepSpeed's DeepSpeedCPULion (csrc/includes/cpu_lion.h, csrc/lion/cpu_lion_impl.cpp, DeepSpeed 0.19.8)
 * computes when DeepSpeed builds it for the CPU this file is built for (its JIT build: g++ -O3 -march=native, with
 * GCC's default -ffp-contract=fast). It derives its scalars in float: 1 - b1 and 1 - b2 by a float subtraction,
 * after_decay = 1 - lr * wd (one fused multiply-add where the CPU has FMA, as the compiler contracts it; two
 * roundings where it has none). Over the elements of one call it runs two formulas:
 * - its vector body (Step_AVX: AVX-512 or AVX2 intrinsics), on the first numel - numel % width elements:
 *   c = fma(g, 1 - b1, b1 * m); p = fma(p, after_decay, -copysign(lr, c)) with decay, p + -copysign(lr, c)
 *   without; m = fma(g, 1 - b2, b2 * m). width is 16 with AVX-512 (every storage) and 8 with AVX2 (fp32 only:
 *   Step_AVX returns at once for bf16 weights or states without AVX-512, so bf16 runs the scalar loop throughout);
 * - its scalar loop (Step_1) on the rest. The compiler contracts `tmp = m * b1; tmp = g * (1 - b1) + tmp` across
 *   the two statements, fusing the first product into the add: c = fma(m, b1, g * (1 - b1)), and likewise
 *   m = fma(m, b2, g * (1 - b2)); the weight as above. Without FMA (x86-64-v2) nothing is fused: every product is
 *   rounded on its own (and there is no vector body: DeepSpeed's needs AVX2).
 * The direction's sign is its sign bit (c = +0 moves the weight by -lr, c = -0 by +lr). LION_VECTOR_WIDTH and
 * LION_VECTOR_BF16 say which elements take the vector body here; dos_host_update cuts each call there, so the
 * engine matches DeepSpeed called on the same tensors: a call's last numel % width elements take the scalar loop.
 * (The engine cuts DeepSpeed's flat partitions into sub-groups at multiples of 64 elements, sub_group_size >= 64,
 * so only a flat's last sub-group has such a remainder, the flat's own: what DeepSpeed's call on the flat has.) */
#if defined(__AVX512F__)
#define LION_VECTOR_WIDTH 16
#define LION_VECTOR_BF16 1
#elif defined(__AVX2__) && defined(__FMA__)
#define LION_VECTOR_WIDTH 8
#define LION_VECTOR_BF16 0
#else
#define LION_VECTOR_WIDTH 0
#define LION_VECTOR_BF16 0
#endif
#if defined(__FP_FAST_FMAF)
#define LION_FUSED 1 /* the CPU has FMA: DeepSpeed's compiler fuses its scalar loop's products and after_decay */
#else
#define LION_FUSED 0
#endif
enum { LION_VECTOR = 0, LION_SCALAR = 1 };

/* What this build's Lion takes DeepSpeed to run (for the engine's checks and tests): the width of the vector body
 * for storage `dtypes` (0: DeepSpeed runs its scalar loop throughout), and whether its scalar loop and after_decay
 * are fused (1) or rounded product by product (0). */
int dos_lion_vector_width(int dtypes) { return (dtypes == DTYPES_FP32 || LION_VECTOR_BF16) ? LION_VECTOR_WIDTH : 0; }
int dos_lion_fused(void) { return LION_FUSED; }

/* The first element of a call of `numel` elements stored as `dtypes` that DeepSpeed's scalar loop updates. */
static int64_t lion_vector_end(int dtypes, int64_t numel) {
    const int width = dos_lion_vector_width(dtypes);
    return width ? numel - numel % width : 0;
}

/* The first element of an Adam call of `numel` elements that torch's fused Adam (whose float vector width is
 * `width`) updates in its scalar remainder. torch runs its vector body over all but the last
 * numel % width; its compiler vectorizes the remainder loop once more at half the width where that is 8 (AVX-512:
 * 8 elements as the body rounds them, when 8 or more remain), and the rest is scalar. Measured on torch 2.13's
 * AVX-512 and AVX2 builds for every remainder (tests/test_native_kernel.py checks every element). bf16 storage is
 * computed as fp32 copies of it would be (the header), so the same cut applies. */
static int64_t adam_scalar_from(int width, int64_t numel) {
    if (width <= 0) return numel;
    const int64_t remainder = numel % width;
    return numel - remainder + (width == 16 && remainder >= 8 ? 8 : 0);
}

/* Lion's block [begin, end), all of it in DeepSpeed's vector body or all in its scalar loop (`form`). */
static inline __attribute__((always_inline)) void lion_block(const Job *job, float *restrict fresh, int64_t begin,
                                                             int64_t end, const int unscale, const int decays,
                                                             const int master16, const int states16,
                                                             const int form, const int outplace) {
    VIEWS(job);
    const float beta1 = job->s.beta1, beta2 = job->s.beta2, lr = job->s.neg_step_size, wd = job->s.weight_decay;
    const float one_minus_beta1 = 1.0f - beta1, one_minus_beta2 = 1.0f - beta2;
    const float after_decay = LION_FUSED ? FMA(-lr, wd, 1.0f) : 1.0f - lr * wd;
    for (int64_t i = begin; i < end; i++) { /* vectorized: lion loop */
        float g = LOAD(master16, grad, grad_h, i);
        if (unscale) g = g * inv_scale;
        float m = LOAD(states16, state0, state0_h, i);
        float p = LOAD(master16, param, param_h, i);
        float c, m_next;
        if (form == LION_VECTOR) {
            c = FMA(g, one_minus_beta1, m * beta1);
            m_next = FMA(g, one_minus_beta2, m * beta2);
        } else if (LION_FUSED) {
            c = FMA(m, beta1, g * one_minus_beta1);
            m_next = FMA(m, beta2, g * one_minus_beta2);
        } else {
            c = m * beta1 + g * one_minus_beta1;
            m_next = m * beta2 + g * one_minus_beta2;
        }
        const float move = -copysignf(lr, c);
        if (decays) p = (form == LION_VECTOR || LION_FUSED) ? FMA(p, after_decay, move) : p * after_decay + move;
        else p = p + move;
        STORE(states16, OUT(state0), OUT(state0_h), i, m_next);
        STORE_WEIGHT(master16, i, p);
    }
}

static inline __attribute__((always_inline)) void run_blocks(const Job *const given, const int rule, const int unscale,
                                                             const int flag0, const int flag1, const int master16,
                                                             const int states16, const int outplace) {
    float fresh[BLOCK] __attribute__((aligned(64)));
    const Job *job = given;
#if defined(STREAMING_STORES)
    /* Out of place, a block's results go into L1 here and are streamed out: a plain store into the slot would
     * first read each line it writes (the write-allocate). On an Intel Xeon with AVX-512 this took the update out
     * of place from 1.35-1.61x one in place to 1.22-1.33x (1 to 8 threads); on an AMD EPYC with AVX2 it changed
     * nothing measurable (1.26-1.41x either way). bench/RESULTS.md, 2026-11-27. */
    float out_block[3][BLOCK] __attribute__((aligned(64)));
    void *const targets[3] = {given->param_out, given->state0_out, given->state1_out};
    const int64_t sizes[3] = {master16 ? 2 : 4, states16 ? 2 : 4, states16 ? 2 : 4};
    const int outputs = rule == RULE_ADAM ? 3 : 2;
    Job staged = *given;
    if (outplace) job = &staged;
#endif
    for (int64_t begin = job->begin; begin < job->end; begin += BLOCK) {
        int64_t end = begin + BLOCK < job->end ? begin + BLOCK : job->end;
#if defined(STREAMING_STORES)
        if (outplace) { /* element i of the block is written at out_block[k][i - begin] (the address computed as an
                         * integer: no pointer outside an array is formed) */
            staged.param_out = (void *)((uintptr_t)out_block[0] - (uintptr_t)(begin * sizes[0]));
            staged.state0_out = (void *)((uintptr_t)out_block[1] - (uintptr_t)(begin * sizes[1]));
            staged.state1_out = (void *)((uintptr_t)out_block[2] - (uintptr_t)(begin * sizes[2]));
        }
#endif
        if (rule == RULE_ADAM) {
            /* torch's vector body before job->adam_scalar_from, its scalar remainder from there */
            int64_t cut = job->adam_scalar_from;
            cut = cut < begin ? begin : cut > end ? end : cut;
            adam_block(job, fresh, begin, cut, unscale, flag0, flag1, master16, states16, outplace);
            if (cut < end)
                adam_remainder(job, fresh + (cut - begin), cut, end, unscale, flag0, flag1, master16, states16,
                               outplace);
        } else if (rule == RULE_ADAGRAD)
            adagrad_block(job, fresh, begin, end, unscale, flag0, master16, states16, outplace);
        else {
            /* DeepSpeed's vector body before job->lion_vector_end, its scalar loop from there (fresh[k] is
             * element begin + k of the block in either part) */
            int64_t cut = job->lion_vector_end;
            cut = cut < begin ? begin : cut > end ? end : cut;
            lion_block(job, fresh, begin, cut, unscale, flag0, master16, states16, LION_VECTOR, outplace);
            lion_block(job, fresh + (cut - begin), cut, end, unscale, flag0, master16, states16, LION_SCALAR,
                       outplace);
        }
        const float *weights = master16 ? fresh : (const float *)(outplace ? job->param_out : job->param) + begin;
        cast_block(job->lp, job->lp_kind, weights, begin, end - begin);
#if defined(STREAMING_STORES)
        for (int k = 0; outplace && k < outputs; k++)
            stream_copy((char *)targets[k] + begin * sizes[k], out_block[k], (end - begin) * sizes[k], sizes[k]);
#endif
    }
}

/* One loop per rule, storage and loop-invariant choice: the key of a job is (rule, dtypes, unscale, flag0, flag1,
 * outplace) with flag0 = decoupled (Adam) or decays (Adagrad, Lion), flag1 = lerp_small (Adam; 0 for the others)
 * and outplace = the job writes into the `_out` arrays. */
#define KEY(RULE, DTYPES, UNSCALE, F0, F1, OUTPLACE)                                                       \
    ((((RULE) * 3 + (DTYPES)) << 3 | (UNSCALE) << 2 | (F0) << 1 | (F1)) << 1 | (OUTPLACE))
#define VARIANT(RULE, DTYPES, UNSCALE, F0, F1)                                                             \
    case KEY(RULE, DTYPES, UNSCALE, F0, F1, 0):                                                            \
        run_blocks(job, RULE, UNSCALE, F0, F1, (DTYPES) != DTYPES_FP32, (DTYPES) == DTYPES_BF16, 0);       \
        break;                                                                                             \
    case KEY(RULE, DTYPES, UNSCALE, F0, F1, 1):                                                            \
        run_blocks(job, RULE, UNSCALE, F0, F1, (DTYPES) != DTYPES_FP32, (DTYPES) == DTYPES_BF16, 1);       \
        break;
#define ADAM_VARIANTS(D)                                                                                   \
    VARIANT(RULE_ADAM, D, 0, 0, 0) VARIANT(RULE_ADAM, D, 0, 0, 1) VARIANT(RULE_ADAM, D, 0, 1, 0)          \
    VARIANT(RULE_ADAM, D, 0, 1, 1) VARIANT(RULE_ADAM, D, 1, 0, 0) VARIANT(RULE_ADAM, D, 1, 0, 1)          \
    VARIANT(RULE_ADAM, D, 1, 1, 0) VARIANT(RULE_ADAM, D, 1, 1, 1)
#define ONE_FLAG_VARIANTS(R, D) VARIANT(R, D, 0, 0, 0) VARIANT(R, D, 0, 1, 0) VARIANT(R, D, 1, 0, 0) VARIANT(R, D, 1, 1, 0)
#define RULE_VARIANTS(D) ADAM_VARIANTS(D) ONE_FLAG_VARIANTS(RULE_ADAGRAD, D) ONE_FLAG_VARIANTS(RULE_LION, D)

static void run_job(const Job *job) {
    int flag1 = job->rule == RULE_ADAM && job->s.lerp_small != 0;
    switch (KEY(job->rule, job->dtypes, job->unscale != 0, job->s.decoupled != 0, flag1, job->param_out != NULL)) {
        RULE_VARIANTS(DTYPES_FP32) RULE_VARIANTS(DTYPES_BF16_MASTER) RULE_VARIANTS(DTYPES_BF16)
    }
#if defined(STREAMING_STORES)
    _mm_sfence(); /* streaming stores are weakly ordered: complete them before the caller reads the copy */
#endif
}

#define MAX_THREADS 256
/* Threads start on multiples of this many elements: a 64-byte cache line of bf16 (two of fp32), so no two
 * threads write the same line. */
#define SHARE_ALIGN 32

#if !defined(_OPENMP)
static void *run_job_thread(void *arg) {
    run_job((const Job *)arg);
    return NULL;
}
#endif

/* One step of `rule` (RULE_*) over elements [0, numel) with `threads` threads (the caller is one of them):
 * param, grad and the states stored as `dtypes` (DTYPES_*) says, state1 used by Adam only, the new weights also
 * cast into lp (LP_*; NULL for LP_NONE); in place, or (param_out non-NULL) into param_out, state0_out and
 * state1_out (NULL without a second state), param and the states only read. Returns 0; -1 when a thread could not be started (the caller has then
 * run that share itself: the result is complete); -2 when rule, dtypes or lp_kind is none of those (nothing is
 * touched). */
int dos_host_update(int rule, int dtypes, void *param, const void *grad, void *state0, void *state1,
                    void *param_out, void *state0_out, void *state1_out, void *lp, int lp_kind, int64_t numel,
                    float inv_scale, const Step *step, int threads) {
    if (rule < RULE_ADAM || rule > RULE_LION || dtypes < DTYPES_FP32 || dtypes > DTYPES_BF16 || lp_kind < LP_NONE ||
        lp_kind > LP_FP32)
        return -2;
    if (threads < 1) threads = 1;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    Job jobs[MAX_THREADS];
    int64_t share = (numel + threads - 1) / threads;
    share = (share + SHARE_ALIGN - 1) / SHARE_ALIGN * SHARE_ALIGN;
    for (int t = 0; t < threads; t++) {
        Job job = {param, grad, state0, state1, param_out, state0_out, state1_out, lp, lp_kind, rule, dtypes,
                   t * share < numel ? t * share : numel, (t + 1) * share < numel ? (t + 1) * share : numel,
                   inv_scale, inv_scale != 1.0f, *step, lion_vector_end(dtypes, numel),
                   adam_scalar_from(step->torch_width, numel)};
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
