/* The CPU forward of the fused pre-op: one pass over the streams per block of tokens.

   `mhc_core.kernels.native` builds this into `mhc_core.kernels.native._pre` (setup.py, optional: without a
   C compiler the compiled backend keeps its torch.compile forward). Per block of TB tokens of x [T, K]
   (K = n*C, fp32 or bf16, row-major):

     pass 1, the rows from memory:  proj[t, j] = sum_k x[t, k] W[j, k]  (j < N = n*n + 2n)
                                    sumsq[t]  = sum_k x[t, k]^2
     per token:                     rms, r = 1 / (rms + eps) or rsqrt(sumsq / K + eps)
                                    h_pre[t, i] = sigmoid(r * proj[t, i] * alpha_pre + bias[i]) + h_pre_eps
                                    (rounded to bf16 where the coefficients are bf16)
     pass 2, the rows from cache:   agg[t, c] = sum_i h_pre[t, i] x[t, i*C + c]   (rounded to x's dtype)

   All sums in fp32, in blocks of 8 lanes. Kernels for AVX2 + FMA (selected at run time with
   __builtin_cpu_supports, so the file builds with the compiler's default flags) and a portable one. The
   GIL is released while they run. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define MHC_X86 1
#else
#define MHC_X86 0
#endif

#define TB 3 /* tokens per block: their rows stay in cache between the passes */
#define JB 4 /* projection columns per pass over the block (TB * JB accumulators in registers) */
#define MAX_N 8 /* residual streams the kernels take (N = n*n + 2n <= 80) */

typedef struct {
    const void *x;    /* [T, K] fp32 or bf16 */
    int x_bf16;
    Py_ssize_t T, K, n, N;
    const float *w;   /* [N, K] */
    float alpha_pre;
    const float *bias_pre; /* [n] */
    float norm_eps;
    int eps_inside;
    float h_pre_eps;
    int h_pre_bf16;   /* round h_pre to bf16 before it is used and returned */
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
    for (Py_ssize_t t = 0; t < a->T; t++) {
        float sumsq = 0.0f;
        for (Py_ssize_t k = 0; k < K; k++) {
            float v = load_x(a, t, k);
            sumsq += v * v;
        }
        for (Py_ssize_t j = 0; j < N; j++) {
            float acc = 0.0f;
            const float *wj = a->w + j * K;
            for (Py_ssize_t k = 0; k < K; k++) acc += load_x(a, t, k) * wj[k];
            a->proj[t * N + j] = acc;
        }
        float hp[MAX_N];
        token_coefficients(a, t, sumsq, hp);
        aggregate_from(a, t, hp, 0);
    }
}

#if MHC_X86
__attribute__((target("avx2,fma"), always_inline)) static inline __m256 loadx8(const void *x, int bf16, Py_ssize_t i) {
    if (bf16) {
        __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)x + i));
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
    return _mm256_loadu_ps((const float *)x + i);
}

__attribute__((target("avx2,fma"), always_inline)) static inline __m256 load8(const PreArgs *a, Py_ssize_t t,
                                                                             Py_ssize_t k) {
    return loadx8(a->x, a->x_bf16, t * a->K + k);
}

__attribute__((target("avx2,fma"))) static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
}

/* Projection and sum of squares of a block of TB tokens, K in chunks of KC: per chunk the block's slices of x
   (TB * KC floats) and, group by group, JB rows of W stay in L1; the vector partial sums of every (token,
   column) pair live in `part` across chunks. Per 8 columns of K, TB loads of x and JB of W feed TB * JB FMAs. */
#define KC 512
__attribute__((target("avx2,fma"), always_inline)) static inline void project_block_as(
        const PreArgs *a, Py_ssize_t t0, Py_ssize_t tb, float *sumsq, const int bf16) {
    const Py_ssize_t K = a->K, N = a->N, K8 = K - K % 8;
    const void *x = a->x;
    const float *w = a->w;
    __m256 part[TB][MAX_N * (MAX_N + 2)], sq[TB];
    for (Py_ssize_t u = 0; u < TB; u++) {
        sq[u] = _mm256_setzero_ps();
        for (Py_ssize_t j = 0; j < N; j++) part[u][j] = _mm256_setzero_ps();
    }
    const int full = tb == TB;
    for (Py_ssize_t k0 = 0; k0 < K8; k0 += KC) {
        const Py_ssize_t k1 = k0 + KC < K8 ? k0 + KC : K8;
        for (Py_ssize_t j0 = 0; j0 < N; j0 += JB) {
            const Py_ssize_t jb = N - j0 < JB ? N - j0 : JB;
            __m256 acc[TB][JB];
            for (int u = 0; u < TB; u++)
                for (int v = 0; v < JB; v++) acc[u][v] = part[u][j0 + v < N ? j0 + v : N - 1];
            if (full && jb == JB) {
                /* Constant trip counts: the TB * JB accumulators live in registers. */
                const float *w0 = w + j0 * K;
                for (Py_ssize_t k = k0; k < k1; k += 8) {
                    __m256 wv[JB];
                    for (int v = 0; v < JB; v++) wv[v] = _mm256_loadu_ps(w0 + v * K + k);
                    for (int u = 0; u < TB; u++) {
                        __m256 xv = loadx8(x, bf16, (t0 + u) * K + k);
                        for (int v = 0; v < JB; v++) acc[u][v] = _mm256_fmadd_ps(xv, wv[v], acc[u][v]);
                    }
                }
            } else {
                for (Py_ssize_t k = k0; k < k1; k += 8) {
                    __m256 wv[JB];
                    for (Py_ssize_t v = 0; v < jb; v++) wv[v] = _mm256_loadu_ps(a->w + (j0 + v) * K + k);
                    for (Py_ssize_t u = 0; u < tb; u++) {
                        __m256 xv = load8(a, t0 + u, k);
                        for (Py_ssize_t v = 0; v < jb; v++) acc[u][v] = _mm256_fmadd_ps(xv, wv[v], acc[u][v]);
                    }
                }
            }
            for (Py_ssize_t u = 0; u < TB; u++)
                for (Py_ssize_t v = 0; v < jb; v++) part[u][j0 + v] = acc[u][v];
        }
        for (Py_ssize_t u = 0; u < tb; u++)
            for (Py_ssize_t k = k0; k < k1; k += 8) {
                __m256 xv = loadx8(x, bf16, (t0 + u) * K + k);
                sq[u] = _mm256_fmadd_ps(xv, xv, sq[u]);
            }
    }
    for (Py_ssize_t u = 0; u < tb; u++) {
        for (Py_ssize_t j = 0; j < N; j++) {
            float s = hsum8(part[u][j]);
            for (Py_ssize_t k = K8; k < K; k++) s += load_x(a, t0 + u, k) * a->w[j * K + k];
            a->proj[(t0 + u) * N + j] = s;
        }
        float q = hsum8(sq[u]);
        for (Py_ssize_t k = K8; k < K; k++) {
            float x = load_x(a, t0 + u, k);
            q += x * x;
        }
        sumsq[u] = q;
    }
}

__attribute__((target("avx2,fma"))) static void project_block(const PreArgs *a, Py_ssize_t t0, Py_ssize_t tb,
                                                                float *sumsq) {
    if (a->x_bf16)
        project_block_as(a, t0, tb, sumsq, 1);
    else
        project_block_as(a, t0, tb, sumsq, 0);
}

__attribute__((target("avx2,fma"))) static void pre_forward_avx2(const PreArgs *a) {
    const Py_ssize_t K = a->K, N = a->N;
    for (Py_ssize_t t0 = 0; t0 < a->T; t0 += TB) {
        const Py_ssize_t tb = a->T - t0 < TB ? a->T - t0 : TB;
        float sumsq[TB] = {0};
        project_block(a, t0, tb, sumsq);
        for (Py_ssize_t u = 0; u < tb; u++) {
            const Py_ssize_t t = t0 + u, n = a->n, C = K / n;
            float hp[MAX_N];
            token_coefficients(a, t, sumsq[u], hp);
            const Py_ssize_t C8 = C - C % 8;
            for (Py_ssize_t c = 0; c < C8; c += 8) {
                __m256 acc = _mm256_setzero_ps();
                for (Py_ssize_t i = 0; i < n; i++)
                    acc = _mm256_fmadd_ps(_mm256_set1_ps(hp[i]), load8(a, t, i * C + c), acc);
                if (a->x_bf16) {
                    float tmp[8];
                    _mm256_storeu_ps(tmp, acc);
                    for (int l = 0; l < 8; l++) ((uint16_t *)a->agg)[t * C + c + l] = f32_to_bf16(tmp[l]);
                } else {
                    _mm256_storeu_ps((float *)a->agg + t * C + c, acc);
                }
            }
            aggregate_from(a, t, hp, C8);
        }
    }
}
#endif

static int have_avx2(void) {
#if MHC_X86 && (defined(__GNUC__) || defined(__clang__))
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#else
    return 0;
#endif
}

static PyObject *forward(PyObject *self, PyObject *args) {
    (void)self;
    unsigned long long x, w, bias_pre, proj, rms, h_pre, agg;
    PreArgs a;
    int portable;
    if (!PyArg_ParseTuple(args, "KinnnKfKfifiKKKKp", &x, &a.x_bf16, &a.T, &a.K, &a.n, &w, &a.alpha_pre, &bias_pre,
                          &a.norm_eps, &a.eps_inside, &a.h_pre_eps, &a.h_pre_bf16, &proj, &rms, &h_pre, &agg,
                          &portable))
        return NULL;
    if (a.n < 1 || a.n > MAX_N || a.K % a.n != 0 || a.T < 0) {
        PyErr_Format(PyExc_ValueError, "mhc_core.kernels.native._pre.forward: n=%zd must be in [1, 8] and divide "
                     "K=%zd; T=%zd", a.n, a.K, a.T);
        return NULL;
    }
    a.N = a.n * a.n + 2 * a.n;
    a.x = (const void *)(uintptr_t)x;
    a.w = (const float *)(uintptr_t)w;
    a.bias_pre = (const float *)(uintptr_t)bias_pre;
    a.proj = (float *)(uintptr_t)proj;
    a.rms = (float *)(uintptr_t)rms;
    a.h_pre = (float *)(uintptr_t)h_pre;
    a.agg = (void *)(uintptr_t)agg;
    int vec = !portable && have_avx2();
    Py_BEGIN_ALLOW_THREADS
#if MHC_X86
    if (vec)
        pre_forward_avx2(&a);
    else
#endif
        pre_forward_portable(&a);
    Py_END_ALLOW_THREADS
    return PyBool_FromLong(vec);
}

static PyObject *simd(PyObject *self, PyObject *args) {
    (void)self;
    (void)args;
    return PyUnicode_FromString(have_avx2() ? "avx2" : "portable");
}

static PyMethodDef methods[] = {
    {"forward", forward, METH_VARARGS,
     "forward(x_ptr, x_bf16, T, K, n, w_ptr, alpha_pre, bias_pre_ptr, norm_eps, eps_inside, h_pre_eps, h_pre_bf16, "
     "proj_ptr, rms_ptr, h_pre_ptr, agg_ptr, portable) -> bool: the pre-op's forward pass (see the file's comment); "
     "True when the AVX2 kernel ran"},
    {"simd", simd, METH_NOARGS, "simd() -> 'avx2' or 'portable': the kernel this CPU runs"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_pre", "The CPU forward of mHC's fused pre-op.", -1,
                                    methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__pre(void) { return PyModule_Create(&module); }
