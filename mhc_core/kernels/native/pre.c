/* The CPU forward of the fused pre-op: one pass over the streams per block of tokens.

   `mhc_core.kernels.native` builds this into `mhc_core.kernels.native._pre` (setup.py, optional: without a
   C compiler the compiled backend keeps its torch.compile forward). Per block of tokens of x [T, K]
   (K = n*C, fp32 or bf16, row-major):

     pass 1, the rows from memory:  proj[t, j] = sum_k x[t, k] W[j, k]  (j < N = n*n + 2n; rounded to bf16
                                    where the mapping computes in bf16, as a bf16 GEMM's output)
                                    sumsq[t]  = sum_k x[t, k]^2
     per token:                     rms, r = 1 / (rms + eps) or rsqrt(sumsq / K + eps)
                                    h_pre[t, i] = sigmoid(r * proj[t, i] * alpha_pre + bias[i]) + h_pre_eps
                                    (rounded to bf16 where the coefficients are bf16)
     pass 2, the rows from cache:   agg[t, c] = sum_i h_pre[t, i] x[t, i*C + c]   (rounded to x's dtype)

   All sums in fp32, in vector lanes. Three kernels, named: `avx512` (AVX-512 F/BW/VL, 16 lanes), `avx2`
   (AVX2 + FMA, 8 lanes), both from one template (pre_simd.h) and chosen at run time with
   __builtin_cpu_supports, so the file builds with the compiler's default flags, and `portable` (scalar).
   They sum in different orders, so their results differ by rounding; each is deterministic. The GIL is
   released while they run. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define MHC_X86 1
#else
#define MHC_X86 0
#endif

#define MAX_N 8 /* residual streams the kernels take (N = n*n + 2n <= 80) */

typedef struct {
    const void *x;    /* [T, K] fp32 or bf16 */
    int x_bf16;
    Py_ssize_t T, K, n, N;
    Py_ssize_t t_begin, t_end; /* the tokens this call (one thread's slice) computes */
    const float *w;   /* [N, K] rows w_stride apart */
    Py_ssize_t w_stride;
    float alpha_pre;
    const float *bias_pre; /* [n] */
    float norm_eps;
    int eps_inside;
    float h_pre_eps;
    int h_pre_bf16;   /* round h_pre to bf16 before it is used and returned */
    int proj_bf16;    /* round the projection to bf16 (a mapping computed in bf16) before it is used and returned */
    float *proj;      /* [T, N] */
    float *rms;       /* [T] */
    float *h_pre;     /* [T, n] */
    void *agg;        /* [T, C] in x's dtype */
} PreArgs;

static inline float bf16_to_f32(uint16_t v) {
    uint32_t u = (uint32_t)v << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even, as torch's .to(bfloat16) */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* NaN stays NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline float load_x(const PreArgs *a, Py_ssize_t t, Py_ssize_t k) {
    if (a->x_bf16) return bf16_to_f32(((const uint16_t *)a->x)[t * a->K + k]);
    return ((const float *)a->x)[t * a->K + k];
}

static inline float round_bf16(float f) { return bf16_to_f32(f32_to_bf16(f)); }

/* The RMS and h_pre of token t from its sum of squares and projection (`hp`: h_pre as used, [n]). */
static void token_coefficients(const PreArgs *a, Py_ssize_t t, float sumsq, float *hp) {
    const Py_ssize_t K = a->K, n = a->n;
    float rms, r;
    if (a->eps_inside) {
        rms = sqrtf(sumsq / (float)K + a->norm_eps);
        r = 1.0f / rms;
    } else {
        rms = sqrtf(sumsq) / sqrtf((float)K);
        r = 1.0f / (rms + a->norm_eps);
    }
    a->rms[t] = rms;
    for (Py_ssize_t i = 0; i < n; i++) {
        float h = r * a->proj[t * a->N + i] * a->alpha_pre + a->bias_pre[i];
        float s = 1.0f / (1.0f + expf(-h)) + a->h_pre_eps;
        if (a->h_pre_bf16) s = round_bf16(s);
        hp[i] = s;
        a->h_pre[t * n + i] = s;
    }
}

/* Pass 2 of token t from channel c0 on: agg[t, c] = sum_i hp[i] x[t, i*C + c]. */
static void aggregate_from(const PreArgs *a, Py_ssize_t t, const float *hp, Py_ssize_t c0) {
    const Py_ssize_t n = a->n, C = a->K / n;
    for (Py_ssize_t c = c0; c < C; c++) {
        float acc = 0.0f;
        for (Py_ssize_t i = 0; i < n; i++) acc += hp[i] * load_x(a, t, i * C + c);
        if (a->x_bf16)
            ((uint16_t *)a->agg)[t * C + c] = f32_to_bf16(acc);
        else
            ((float *)a->agg)[t * C + c] = acc;
    }
}

static void pre_forward_portable(const PreArgs *a) {
    const Py_ssize_t K = a->K, N = a->N;
    for (Py_ssize_t t = a->t_begin; t < a->t_end; t++) {
        float sumsq = 0.0f;
        for (Py_ssize_t k = 0; k < K; k++) {
            float v = load_x(a, t, k);
            sumsq += v * v;
        }
        for (Py_ssize_t j = 0; j < N; j++) {
            float acc = 0.0f;
            const float *wj = a->w + j * a->w_stride;
            for (Py_ssize_t k = 0; k < K; k++) acc += load_x(a, t, k) * wj[k];
            a->proj[t * N + j] = a->proj_bf16 ? round_bf16(acc) : acc;
        }
        float hp[MAX_N];
        token_coefficients(a, t, sumsq, hp);
        aggregate_from(a, t, hp, 0);
    }
}

#define KC 1024 /* K per chunk of the projection (pre_simd.h) */

#if MHC_X86
/* AVX2 + FMA: 8 lanes, 16 registers (3 x 4 accumulators, 4 rows of W, one of x). */
#define AVX2_TARGET __attribute__((target("avx2,fma")))
AVX2_TARGET __attribute__((always_inline)) static inline __m256 loadx8(const void *x, int bf16, Py_ssize_t i) {
    if (bf16) {
        __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)x + i));
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
    return _mm256_loadu_ps((const float *)x + i);
}

AVX2_TARGET __attribute__((always_inline)) static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
}

/* fp32 -> bf16, round to nearest even and NaN kept NaN as f32_to_bf16, 8 lanes at a time. */
AVX2_TARGET __attribute__((always_inline)) static inline void store_bf16x8(uint16_t *p, __m256 v) {
    const __m256i u = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
    const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)),
                                           _mm256_set1_epi32(0x7f800000));
    r = _mm256_blendv_epi8(r, _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40)), nan);
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0xD8); /* lanes 0-7 in order */
    _mm_storeu_si128((__m128i *)p, _mm256_castsi256_si128(packed));
}

#define SIMD_TARGET AVX2_TARGET
#define SIMD_FN(name) name##_avx2
#define VEC __m256
#define LANES 8
#define TBS 3
#define JBS 4
#define VZERO() _mm256_setzero_ps()
#define VLOADF(p) _mm256_loadu_ps(p)
#define VLOADX(x, bf16, i) loadx8((x), (bf16), (i))
#define VFMA(a, b, c) _mm256_fmadd_ps((a), (b), (c))
#define VSET1(f) _mm256_set1_ps(f)
#define VSTOREF(p, v) _mm256_storeu_ps((p), (v))
#define VHSUM(v) hsum8(v)
#define VSTOREBF16(p, v) store_bf16x8((p), (v))
#include "pre_simd.h"
#undef SIMD_TARGET
#undef SIMD_FN
#undef VEC
#undef LANES
#undef TBS
#undef JBS
#undef VZERO
#undef VLOADF
#undef VLOADX
#undef VFMA
#undef VSET1
#undef VSTOREF
#undef VHSUM
#undef VSTOREBF16

/* AVX-512 F + BW + VL: 16 lanes, 32 registers (4 x 6 accumulators, 6 rows of W, one of x). */
#define AVX512_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma")))
AVX512_TARGET __attribute__((always_inline)) static inline __m512 loadx16(const void *x, int bf16, Py_ssize_t i) {
    if (bf16) {
        __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)x + i));
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    return _mm512_loadu_ps((const float *)x + i);
}

AVX512_TARGET __attribute__((always_inline)) static inline void store_bf16x16(uint16_t *p, __m512 v) {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                                  _mm512_set1_epi32(0x7f800000));
    r = _mm512_mask_or_epi32(r, nan, _mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
    _mm256_storeu_si256((__m256i *)p, _mm512_cvtepi32_epi16(r));
}

#define SIMD_TARGET AVX512_TARGET
#define SIMD_FN(name) name##_avx512
#define VEC __m512
#define LANES 16
#define TBS 4
#define JBS 6
#define VZERO() _mm512_setzero_ps()
#define VLOADF(p) _mm512_loadu_ps(p)
#define VLOADX(x, bf16, i) loadx16((x), (bf16), (i))
#define VFMA(a, b, c) _mm512_fmadd_ps((a), (b), (c))
#define VSET1(f) _mm512_set1_ps(f)
#define VSTOREF(p, v) _mm512_storeu_ps((p), (v))
#define VHSUM(v) _mm512_reduce_add_ps(v)
#define VSTOREBF16(p, v) store_bf16x16((p), (v))
#include "pre_simd.h"
#undef SIMD_TARGET
#undef SIMD_FN
#undef VEC
#undef LANES
#undef TBS
#undef JBS
#undef VZERO
#undef VLOADF
#undef VLOADX
#undef VFMA
#undef VSET1
#undef VSTOREF
#undef VHSUM
#undef VSTOREBF16
#endif

/* The kernels by name; a CPU runs those whose instruction sets it has. */
typedef enum { KERNEL_PORTABLE, KERNEL_AVX2, KERNEL_AVX512, KERNEL_COUNT } Kernel;
static const char *const KERNEL_NAMES[KERNEL_COUNT] = {"portable", "avx2", "avx512"};

static int cpu_has(Kernel k) {
    if (k == KERNEL_PORTABLE) return 1;
#if MHC_X86 && (defined(__GNUC__) || defined(__clang__))
    __builtin_cpu_init();
    const int avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    if (k == KERNEL_AVX2) return avx2;
    return avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl");
#else
    return 0;
#endif
}

static Kernel best_kernel(void) {
    for (int k = KERNEL_COUNT - 1; k > KERNEL_PORTABLE; k--)
        if (cpu_has((Kernel)k)) return (Kernel)k;
    return KERNEL_PORTABLE;
}

/* One thread's slice of the tokens. Every token's results depend on its row of x alone, so the split into
   slices (and the number of threads) does not change a bit. */
typedef struct {
    PreArgs a;
    Kernel kernel;
} Slice;

static void run_slice(const Slice *s) {
    switch (s->kernel) {
#if MHC_X86
    case KERNEL_AVX512: pre_forward_avx512(&s->a); break;
    case KERNEL_AVX2: pre_forward_avx2(&s->a); break;
#endif
    default: pre_forward_portable(&s->a);
    }
}

#define MAX_THREADS 256
#define SLICE_ALIGN 12 /* tokens: a multiple of every kernel's block */

/* The tokens split over `threads` slices of whole blocks, run by OpenMP's threads. Built with -fopenmp
   (setup.py), the extension links libgomp.so.1, which resolves to the one torch has loaded: the slices run
   on torch's own intra-op pool, whose threads would otherwise spin-wait beside threads of ours after each
   torch op and take their cores. Built without OpenMP, the slices run one after another. */
static void run_threads(const PreArgs *a, Kernel kernel, int threads) {
    Slice slices[MAX_THREADS];
    const Py_ssize_t per = ((a->T + threads - 1) / threads + SLICE_ALIGN - 1) / SLICE_ALIGN * SLICE_ALIGN;
    for (int i = 0; i < threads; i++) {
        slices[i].a = *a;
        slices[i].kernel = kernel;
        slices[i].a.t_begin = (Py_ssize_t)i * per < a->T ? (Py_ssize_t)i * per : a->T;
        slices[i].a.t_end = slices[i].a.t_begin + per < a->T ? slices[i].a.t_begin + per : a->T;
    }
#ifdef _OPENMP
#pragma omp parallel num_threads(threads)
    /* Fewer threads than asked for (a nested region, OMP_THREAD_LIMIT) still run every slice. */
    for (int i = omp_get_thread_num(); i < threads; i += omp_get_num_threads()) run_slice(&slices[i]);
#else
    for (int i = 0; i < threads; i++) run_slice(&slices[i]);
#endif
}

static PyObject *forward(PyObject *self, PyObject *args) {
    (void)self;
    unsigned long long x, w, bias_pre, proj, rms, h_pre, agg;
    PreArgs a;
    const char *name;
    int threads;
    if (!PyArg_ParseTuple(args, "KinnnKfKfifiiKKKKsi", &x, &a.x_bf16, &a.T, &a.K, &a.n, &w, &a.alpha_pre, &bias_pre,
                          &a.norm_eps, &a.eps_inside, &a.h_pre_eps, &a.h_pre_bf16, &a.proj_bf16, &proj, &rms, &h_pre, &agg,
                          &name, &threads))
        return NULL;
    if (a.n < 1 || a.n > MAX_N || a.K % a.n != 0 || a.T < 0) {
        PyErr_Format(PyExc_ValueError, "mhc_core.kernels.native._pre.forward: n=%zd must be in [1, 8] and divide "
                     "K=%zd; T=%zd", a.n, a.K, a.T);
        return NULL;
    }
    Kernel kernel = KERNEL_COUNT;
    if (strcmp(name, "auto") == 0) kernel = best_kernel();
    for (int k = 0; k < KERNEL_COUNT; k++)
        if (strcmp(name, KERNEL_NAMES[k]) == 0) kernel = (Kernel)k;
    if (kernel == KERNEL_COUNT) {
        PyErr_Format(PyExc_ValueError, "mhc_core.kernels.native._pre.forward: kernel='%s' is none of 'auto', "
                     "'portable', 'avx2', 'avx512'", name);
        return NULL;
    }
    if (!cpu_has(kernel)) {
        PyErr_Format(PyExc_ValueError, "mhc_core.kernels.native._pre.forward: this CPU lacks the instructions of "
                     "kernel '%s' (its best: '%s')", KERNEL_NAMES[kernel], KERNEL_NAMES[best_kernel()]);
        return NULL;
    }
    if (threads < 1 || threads > MAX_THREADS) {
        PyErr_Format(PyExc_ValueError, "mhc_core.kernels.native._pre.forward: threads=%d must be in [1, %d]", threads,
                     MAX_THREADS);
        return NULL;
    }
    a.N = a.n * a.n + 2 * a.n;
    a.x = (const void *)(uintptr_t)x;
    /* W's rows copied 64 B-aligned with a stride that is no multiple of 4 KiB: with K a multiple of 1024 (C a
       multiple of 256 at n = 4), rows K apart all fall in one L1 set, and a pass's JBS rows of W beside its
       TBS rows of x are more lines than the set has ways. */
    Py_ssize_t ws = (a.K + 15) / 16 * 16 + 16;
    if ((ws * (Py_ssize_t)sizeof(float)) % 4096 == 0) ws += 16;
    void *w_block = PyMem_RawMalloc((size_t)(a.N * ws) * sizeof(float) + 64);
    if (w_block == NULL) return PyErr_NoMemory();
    float *w_pad = (float *)(((uintptr_t)w_block + 63) & ~(uintptr_t)63);
    for (Py_ssize_t j = 0; j < a.N; j++) {
        memcpy(w_pad + j * ws, (const float *)(uintptr_t)w + j * a.K, (size_t)a.K * sizeof(float));
        memset(w_pad + j * ws + a.K, 0, (size_t)(ws - a.K) * sizeof(float));
    }
    a.w = w_pad;
    a.w_stride = ws;
    a.bias_pre = (const float *)(uintptr_t)bias_pre;
    a.proj = (float *)(uintptr_t)proj;
    a.rms = (float *)(uintptr_t)rms;
    a.h_pre = (float *)(uintptr_t)h_pre;
    a.agg = (void *)(uintptr_t)agg;
    a.t_begin = 0;
    a.t_end = a.T;
    Py_BEGIN_ALLOW_THREADS
    run_threads(&a, kernel, threads);
    Py_END_ALLOW_THREADS
    PyMem_RawFree(w_block);
    return PyUnicode_FromString(KERNEL_NAMES[kernel]);
}

static PyObject *kernels(PyObject *self, PyObject *args) {
    (void)self;
    (void)args;
    PyObject *out = PyList_New(0);
    for (int k = KERNEL_COUNT - 1; out != NULL && k >= 0; k--) {
        if (!cpu_has((Kernel)k)) continue;
        PyObject *s = PyUnicode_FromString(KERNEL_NAMES[k]);
        if (s == NULL || PyList_Append(out, s) < 0) Py_CLEAR(out);
        Py_XDECREF(s);
    }
    return out;
}

static PyMethodDef methods[] = {
    {"forward", forward, METH_VARARGS,
     "forward(x_ptr, x_bf16, T, K, n, w_ptr, alpha_pre, bias_pre_ptr, norm_eps, eps_inside, h_pre_eps, h_pre_bf16, "
     "proj_bf16, proj_ptr, rms_ptr, h_pre_ptr, agg_ptr, kernel, threads) -> str: the pre-op's forward pass (see the "
     "file's comment) with `kernel` ('auto': the first of kernels()) on `threads` threads; returns the kernel that ran"},
    {"kernels", kernels, METH_NOARGS, "kernels() -> list[str]: the kernels this CPU runs, the fastest first"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_pre", "The CPU forward of mHC's fused pre-op.", -1,
                                    methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__pre(void) { return PyModule_Create(&module); }
