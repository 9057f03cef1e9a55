/* The CPU forward and backward passes of the fused pre-op: one pass over the streams per block of tokens.

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

   In the single-pass form (DeepSeek-V4.1) pass 2 weights the streams with the previous sublayer's H_pre, `mix`
   [T, n] fp32, instead of the h_pre just computed (which is still returned: the next sublayer's).

   The backward, in two passes over x (grad_h, then the compiled gates in Python, then grad_x_w):

     g_h[t, i] = sum_c g_agg[t, c] x[t, i*C + c]
     g_x[t, k] = sum_j g_proj[t, j] W[j, k] + coef[t] x[t, k] + h_pre[t, i] g_agg[t, c]   (k = i*C + c)
     g_W[j, k] = sum_t g_proj[t, j] x[t, k]

   All sums in fp32, in vector lanes. Four kernels, named: `avx512` (AVX-512 F/BW/VL, 16 lanes), `avx2`
   (AVX2 + FMA, 8 lanes), both from one template (pre_simd.h), `avx512_bf16` (the avx512 kernel, with pass 1
   and the backward's g_x / g_W pass from dot products of bf16 pairs where the mapping computes in bf16 on bf16
   x), chosen at run time with
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

/* MHC_X86: the SIMD kernels; MHC_BF16: the avx512_bf16 kernel, whose compiler must know AVX512_BF16 (GCC 11,
   clang 12). Either can be set to 0 on the command line to build without it. */
#ifndef MHC_X86
#if defined(__x86_64__) || defined(_M_X64)
#define MHC_X86 1
#else
#define MHC_X86 0
#endif
#endif
#ifndef MHC_BF16
#if MHC_X86 && ((defined(__clang__) && __clang_major__ >= 12) || (!defined(__clang__) && __GNUC__ >= 11))
#define MHC_BF16 1
#else
#define MHC_BF16 0
#endif
#endif
#if MHC_X86
#include <immintrin.h>
#endif

#define MAX_N 8 /* residual streams the kernels take (N = n*n + 2n <= 80) */

typedef struct {
    const void *x;    /* [T, K] fp32 or bf16 */
    int x_bf16;
    Py_ssize_t T, K, n, N;
    Py_ssize_t t_begin, t_end; /* the tokens this call (one thread's slice) computes */
    const float *w;   /* [N, K] rows w_stride apart */
    const uint16_t *w_bf16; /* W in bf16, rows w_stride apart, for the kernel with bf16 dot products, or NULL */
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
    const float *mix; /* [T, n]: the aggregate's weights in the single-pass form, or NULL (h_pre's) */
} PreArgs;

/* The backward's two passes (grad_h and grad_x_w below). */
typedef struct {
    const void *x;    /* [T, K] fp32 or bf16 */
    int x_bf16;       /* x, g_agg and g_x in bf16 (else fp32) */
    Py_ssize_t T, K, n, N;
    Py_ssize_t t_begin, t_end;
    const void *g_agg; /* [T, C] in x's dtype */
    float *g_h;       /* pass 1: [T, n] */
    const float *w;   /* pass 2: [N, K] rows w_stride apart */
    Py_ssize_t w_stride;
    const float *g_proj; /* [T, N] */
    const float *coef;   /* [T] */
    const float *h_pre;  /* [T, n] */
    void *g_x;        /* [T, K] in x's dtype, or NULL */
    float *g_w;       /* [N, K] rows w_stride apart: this slice's sum over its tokens, or NULL */
    const uint32_t *w_pairs; /* [(N + 1) / 2, K] rows w_stride apart: (W[2p, k], W[2p + 1, k]) in bf16 (0 past N),
                                for the kernel with bf16 dot products where W and g_proj are exact in bf16, or NULL */
    const uint32_t *gp_pairs; /* with w_pairs: g_proj in pairs of bf16 (fill_gp_pairs) */
} GradArgs;

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

/* Two bf16 values as one 32-bit lane: `lo` in the lane's low half, the element vdpbf16ps multiplies first. */
static inline uint32_t bf16_pair(float lo, float hi) {
    return (uint32_t)f32_to_bf16(lo) | (uint32_t)f32_to_bf16(hi) << 16;
}

/* Element i of a buffer in bf16 or fp32, read as / written from fp32 (rounded to nearest even). */
static inline float load_v(const void *p, int bf16, Py_ssize_t i) {
    return bf16 ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

static inline void store_v(void *p, int bf16, Py_ssize_t i, float v) {
    if (bf16)
        ((uint16_t *)p)[i] = f32_to_bf16(v);
    else
        ((float *)p)[i] = v;
}

static inline float load_x(const PreArgs *a, Py_ssize_t t, Py_ssize_t k) { return load_v(a->x, a->x_bf16, t * a->K + k); }

static inline float round_bf16(float f) { return bf16_to_f32(f32_to_bf16(f)); }

/* The RMS and h_pre of token t from its sum of squares and projection (`hp`: the aggregate's weights, [n]: h_pre,
   or the single-pass form's `mix`). */
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
        hp[i] = a->mix ? a->mix[t * n + i] : s;
        a->h_pre[t * n + i] = s;
    }
}

#if MHC_X86
/* The end of pass 1 for token t, from its vector sums `sums` [N] (over K's first KV columns) and `sq`: the columns
   from KV on added, the projection stored (rounded to bf16 where the mapping computes in bf16); returns the sum of
   squares. */
static float projection_tail(const PreArgs *a, Py_ssize_t t, Py_ssize_t KV, const float *sums, float sq) {
    const Py_ssize_t K = a->K, N = a->N;
    for (Py_ssize_t j = 0; j < N; j++) {
        float s = sums[j];
        for (Py_ssize_t k = KV; k < K; k++) s += load_x(a, t, k) * a->w[j * a->w_stride + k];
        a->proj[t * N + j] = a->proj_bf16 ? round_bf16(s) : s;
    }
    for (Py_ssize_t k = KV; k < K; k++) {
        float v = load_x(a, t, k);
        sq += v * v;
    }
    return sq;
}
#endif

/* Pass 2 of token t from channel c0 on: agg[t, c] = sum_i hp[i] x[t, i*C + c]. */
static void aggregate_from(const PreArgs *a, Py_ssize_t t, const float *hp, Py_ssize_t c0) {
    const Py_ssize_t n = a->n, C = a->K / n;
    for (Py_ssize_t c = c0; c < C; c++) {
        float acc = 0.0f;
        for (Py_ssize_t i = 0; i < n; i++) acc += hp[i] * load_x(a, t, i * C + c);
        store_v(a->agg, a->x_bf16, t * C + c, acc);
    }
}

/* Backward pass 1 of token t and stream i from channel c0 on, added to `*sum`. */
static void grad_h_from(const GradArgs *g, Py_ssize_t t, Py_ssize_t i, Py_ssize_t c0, float *sum) {
    const Py_ssize_t C = g->K / g->n;
    for (Py_ssize_t c = c0; c < C; c++)
        *sum += load_v(g->g_agg, g->x_bf16, t * C + c) * load_v(g->x, g->x_bf16, t * g->K + i * C + c);
}

/* Backward pass 2 of token t at column k = i*C + c (scalar): g_x[t, k] and, for each j, g_w[j, k] += gp[t, j] x[t, k]. */
static void grad_x_w_at(const GradArgs *g, Py_ssize_t t, Py_ssize_t i, Py_ssize_t c) {
    const Py_ssize_t K = g->K, C = K / g->n, N = g->N, k = i * C + c;
    const float xv = load_v(g->x, g->x_bf16, t * K + k);
    float gx = g->coef[t] * xv + g->h_pre[t * g->n + i] * load_v(g->g_agg, g->x_bf16, t * C + c);
    for (Py_ssize_t j = 0; j < N; j++) {
        const float gp = g->g_proj[t * N + j];
        gx += gp * g->w[j * g->w_stride + k];
        if (g->g_w) g->g_w[j * g->w_stride + k] += gp * xv;
    }
    if (g->g_x) store_v(g->g_x, g->x_bf16, t * K + k, gx);
}

static void grad_h_portable(const GradArgs *g) {
    for (Py_ssize_t t = g->t_begin; t < g->t_end; t++)
        for (Py_ssize_t i = 0; i < g->n; i++) {
            float sum = 0.0f;
            grad_h_from(g, t, i, 0, &sum);
            g->g_h[t * g->n + i] = sum;
        }
}

static void grad_x_w_portable(const GradArgs *g) {
    const Py_ssize_t C = g->K / g->n;
    for (Py_ssize_t t = g->t_begin; t < g->t_end; t++)
        for (Py_ssize_t i = 0; i < g->n; i++)
            for (Py_ssize_t c = 0; c < C; c++) grad_x_w_at(g, t, i, c);
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
#define BWD_KC 2048 /* columns of a stream per chunk of grad_x_w_dot (the fp32 template's pass gained nothing from it) */

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
#define TBG 6
#define VZERO() _mm256_setzero_ps()
#define VLOADF(p) _mm256_loadu_ps(p)
#define VLOADX(x, bf16, i) loadx8((x), (bf16), (i))
#define VFMA(a, b, c) _mm256_fmadd_ps((a), (b), (c))
#define VSET1(f) _mm256_set1_ps(f)
#define VSTOREF(p, v) _mm256_storeu_ps((p), (v))
#define VHSUM(v) hsum8(v)
#define VSTOREBF16(p, v) store_bf16x8((p), (v))
#include "pre_simd.h"

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
#define TBG 6
#define VZERO() _mm512_setzero_ps()
#define VLOADF(p) _mm512_loadu_ps(p)
#define VLOADX(x, bf16, i) loadx16((x), (bf16), (i))
#define VFMA(a, b, c) _mm512_fmadd_ps((a), (b), (c))
#define VSET1(f) _mm512_set1_ps(f)
#define VSTOREF(p, v) _mm512_storeu_ps((p), (v))
#define VHSUM(v) _mm512_reduce_add_ps(v)
#define VSTOREBF16(p, v) store_bf16x16((p), (v))
#include "pre_simd.h"
#endif

#if MHC_BF16
/* AVX-512 with AVX512_BF16: the avx512 kernel, whose forward, where the mapping computes in bf16 on bf16 x (W
   then exact in bf16: `w_bf16`), takes pass 1 from dot products of bf16 pairs, and so does its backward's second
   pass (grad_x_w_dot, W and g_proj then exact in bf16: `w_pairs`). vdpbf16ps adds to each of 16
   lanes x[2l] w[2l] + x[2l+1] w[2l+1], the products exact and summed in fp32 (denormals flushed): 32 products
   per instruction against the fp32 FMA's 16, and x is read without widening. */
#define AVX512BF16_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma")))
#define DOT_STEP 32 /* bf16 values per operand */
#define DOT_TBS 4   /* tokens per block: 4 x 6 accumulators, 6 rows of W and one of x in 32 registers */
#define DOT_JBS 6

AVX512BF16_TARGET __attribute__((always_inline)) static inline __m512bh load_bf16x32(const uint16_t *p) {
    return (__m512bh)_mm512_loadu_si512((const void *)p);
}

/* Pass 1 of the block of tb <= DOT_TBS tokens from t0, as project_block_as. Rows past the block's tokens or past
   N repeat its last one (constant trip counts keep the accumulators in registers); their sums are not used. */
AVX512BF16_TARGET static void project_block_dot(const PreArgs *a, Py_ssize_t t0, Py_ssize_t tb, float *sumsq) {
    const Py_ssize_t K = a->K, N = a->N, KV = K - K % DOT_STEP, WS = a->w_stride;
    const uint16_t *xr[DOT_TBS];
    for (int u = 0; u < DOT_TBS; u++) xr[u] = (const uint16_t *)a->x + (t0 + (u < tb ? u : tb - 1)) * K;
    __m512 part[DOT_TBS][MAX_N * (MAX_N + 2)], sq[DOT_TBS];
    for (int u = 0; u < DOT_TBS; u++) {
        sq[u] = _mm512_setzero_ps();
        for (Py_ssize_t j = 0; j < N; j++) part[u][j] = _mm512_setzero_ps();
    }
    for (Py_ssize_t k0 = 0; k0 < KV; k0 += KC) {
        const Py_ssize_t k1 = k0 + KC < KV ? k0 + KC : KV;
        for (Py_ssize_t j0 = 0; j0 < N; j0 += DOT_JBS) {
            const uint16_t *wr[DOT_JBS];
            __m512 acc[DOT_TBS][DOT_JBS];
            for (int v = 0; v < DOT_JBS; v++) {
                const Py_ssize_t j = j0 + v < N ? j0 + v : N - 1;
                wr[v] = a->w_bf16 + j * WS;
                for (int u = 0; u < DOT_TBS; u++) acc[u][v] = part[u][j];
            }
            for (Py_ssize_t k = k0; k < k1; k += DOT_STEP) {
                __m512bh wv[DOT_JBS];
                for (int v = 0; v < DOT_JBS; v++) wv[v] = load_bf16x32(wr[v] + k);
                for (int u = 0; u < DOT_TBS; u++) {
                    const __m512bh xv = load_bf16x32(xr[u] + k);
                    for (int v = 0; v < DOT_JBS; v++) acc[u][v] = _mm512_dpbf16_ps(acc[u][v], xv, wv[v]);
                }
            }
            for (int u = 0; u < DOT_TBS; u++)
                for (Py_ssize_t v = 0; v < DOT_JBS && j0 + v < N; v++) part[u][j0 + v] = acc[u][v];
        }
        for (Py_ssize_t u = 0; u < tb; u++)
            for (Py_ssize_t k = k0; k < k1; k += DOT_STEP) {
                const __m512bh xv = load_bf16x32(xr[u] + k);
                sq[u] = _mm512_dpbf16_ps(sq[u], xv, xv);
            }
    }
    for (Py_ssize_t u = 0; u < tb; u++) {
        float sums[MAX_N * (MAX_N + 2)];
        for (Py_ssize_t j = 0; j < N; j++) sums[j] = _mm512_reduce_add_ps(part[u][j]);
        sumsq[u] = projection_tail(a, t0 + u, KV, sums, _mm512_reduce_add_ps(sq[u]));
    }
}

/* Backward pass 2 (as grad_x_w_lanes) over 16 columns k = i*C + c of a block of TBG_DOT tokens from t0, where W,
   g_proj and x are exact in bf16, from dot products of bf16 pairs: g_x's sum over j in pairs of columns of W
   (`w_pairs`), g_W's sum over the block's tokens in pairs of tokens (x of tokens 2p and 2p + 1 interleaved). The
   pairs of g_proj are `gpx [TBG_DOT][NP]` (a token's columns 2p, 2p + 1) and `gpw [TBG_DOT / 2][N]` (a column's
   tokens 2p, 2p + 1). */
#define TBG_DOT 6
AVX512BF16_TARGET __attribute__((always_inline)) static inline void grad_x_w_dot_lanes(
        const GradArgs *g, Py_ssize_t t0, Py_ssize_t i, Py_ssize_t c, const uint32_t *gpx, const uint32_t *gpw) {
    const Py_ssize_t K = g->K, n = g->n, N = g->N, NP = (N + 1) / 2, C = K / n, k = i * C + c, WS = g->w_stride;
    const uint16_t *x = (const uint16_t *)g->x, *g_agg = (const uint16_t *)g->g_agg;
    __m512 gx[TBG_DOT] = {0}; /* unused where g_x is not asked for */
    __m512bh x2[TBG_DOT / 2];
    for (int u = 0; u < TBG_DOT && g->g_x; u++) {
        const Py_ssize_t t = t0 + u;
        gx[u] = _mm512_fmadd_ps(_mm512_set1_ps(g->coef[t]), loadx16(x, 1, t * K + k),
                                _mm512_mul_ps(_mm512_set1_ps(g->h_pre[t * n + i]), loadx16(g_agg, 1, t * C + c)));
    }
    for (int q = 0; q < TBG_DOT / 2; q++) {
        const __m512i lo = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(x + (t0 + 2 * q) * K + k)));
        const __m512i hi = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(x + (t0 + 2 * q + 1) * K + k)));
        x2[q] = (__m512bh)_mm512_or_si512(lo, _mm512_slli_epi32(hi, 16));
    }
    for (Py_ssize_t p = 0; p < NP && g->g_x; p++) {
        const __m512bh wv = (__m512bh)_mm512_loadu_si512((const void *)(g->w_pairs + p * WS + k));
        for (int u = 0; u < TBG_DOT; u++)
            gx[u] = _mm512_dpbf16_ps(gx[u], wv, (__m512bh)_mm512_set1_epi32((int)gpx[u * NP + p]));
    }
    if (g->g_w)
        for (Py_ssize_t j = 0; j < N; j++) {
            __m512 gw = _mm512_loadu_ps(g->g_w + j * WS + k);
            for (int q = 0; q < TBG_DOT / 2; q++)
                gw = _mm512_dpbf16_ps(gw, x2[q], (__m512bh)_mm512_set1_epi32((int)gpw[q * N + j]));
            _mm512_storeu_ps(g->g_w + j * WS + k, gw);
        }
    if (g->g_x)
        for (int u = 0; u < TBG_DOT; u++) store_bf16x16((uint16_t *)g->g_x + (t0 + u) * K + k, gx[u]);
}

/* g_proj's pairs for grad_x_w_dot, per block of TBG_DOT tokens from token 0 (`T / TBG_DOT` blocks of
   `gp_pairs_per_block(N)`): gpx [TBG_DOT][(N + 1) / 2] (a token's columns 2p, 2p + 1; 0 past N), then
   gpw [TBG_DOT / 2][N] (a column's tokens 2q, 2q + 1). */
static Py_ssize_t gp_pairs_per_block(Py_ssize_t N) { return TBG_DOT * ((N + 1) / 2) + TBG_DOT / 2 * N; }

static void fill_gp_pairs(uint32_t *pairs, const float *g_proj, Py_ssize_t T, Py_ssize_t N) {
    const Py_ssize_t NP = (N + 1) / 2, per_block = gp_pairs_per_block(N);
    for (Py_ssize_t b = 0; b < T / TBG_DOT; b++) {
        const float *gp = g_proj + b * TBG_DOT * N;
        uint32_t *gpx = pairs + b * per_block, *gpw = gpx + TBG_DOT * NP;
        for (int u = 0; u < TBG_DOT; u++)
            for (Py_ssize_t p = 0; p < NP; p++)
                gpx[u * NP + p] = bf16_pair(gp[u * N + 2 * p], 2 * p + 1 < N ? gp[u * N + 2 * p + 1] : 0.0f);
        for (int q = 0; q < TBG_DOT / 2; q++)
            for (Py_ssize_t j = 0; j < N; j++) gpw[q * N + j] = bf16_pair(gp[2 * q * N + j], gp[(2 * q + 1) * N + j]);
    }
}

/* Backward pass 2 where W, g_proj and x are exact in bf16 (`w_pairs` set): blocks of TBG_DOT tokens through
   grad_x_w_dot_lanes, BWD_KC columns of a stream at a time over all the slice's blocks, so that those columns'
   rows of g_W and W stay in L2 (at C 2048 all of them, 1.2 MB, would not: 40 against 17 ms for g_W at T 4096 on
   one thread; 512 columns slowed g_x's pass, 30 against 22 ms); a short last block, and columns past the last 16
   of each stream, as the portable kernel. Each g_W element still sums the tokens in order. */
AVX512BF16_TARGET static void grad_x_w_dot(const GradArgs *g) {
    const Py_ssize_t n = g->n, N = g->N, NP = (N + 1) / 2, C = g->K / n, CV = C - C % 16;
    const Py_ssize_t blocks = (g->t_end - g->t_begin) / TBG_DOT, t_full = g->t_begin + blocks * TBG_DOT;
    const Py_ssize_t per_block = gp_pairs_per_block(N);
    const uint32_t *pairs = g->gp_pairs + g->t_begin / TBG_DOT * per_block; /* slices begin at whole blocks */
    for (Py_ssize_t i = 0; i < n; i++)
        for (Py_ssize_t c0 = 0; c0 < CV; c0 += BWD_KC) {
            const Py_ssize_t c1 = c0 + BWD_KC < CV ? c0 + BWD_KC : CV;
            for (Py_ssize_t b = 0; b < blocks; b++) {
                const uint32_t *gpx = pairs + b * per_block, *gpw = gpx + TBG_DOT * NP;
                for (Py_ssize_t c = c0; c < c1; c += 16)
                    grad_x_w_dot_lanes(g, g->t_begin + b * TBG_DOT, i, c, gpx, gpw);
            }
        }
    for (Py_ssize_t t = g->t_begin; t < t_full; t++)
        for (Py_ssize_t i = 0; i < n; i++)
            for (Py_ssize_t c = CV; c < C; c++) grad_x_w_at(g, t, i, c);
    for (Py_ssize_t t = t_full; t < g->t_end; t++)
        for (Py_ssize_t i = 0; i < n; i++)
            for (Py_ssize_t c = 0; c < C; c++) grad_x_w_at(g, t, i, c);
}

AVX512BF16_TARGET static void pre_forward_avx512_bf16(const PreArgs *a) {
    if (a->w_bf16 == NULL) {
        pre_forward_avx512(a);
        return;
    }
    for (Py_ssize_t t0 = a->t_begin; t0 < a->t_end; t0 += DOT_TBS) {
        const Py_ssize_t tb = a->t_end - t0 < DOT_TBS ? a->t_end - t0 : DOT_TBS;
        float sumsq[DOT_TBS] = {0};
        project_block_dot(a, t0, tb, sumsq);
        finish_block_avx512(a, t0, tb, sumsq);
    }
}
#endif

/* The kernels by name; a CPU runs those whose instruction sets it has. */
typedef enum { KERNEL_PORTABLE, KERNEL_AVX2, KERNEL_AVX512, KERNEL_AVX512_BF16, KERNEL_COUNT } Kernel;
static const char *const KERNEL_NAMES[KERNEL_COUNT] = {"portable", "avx2", "avx512", "avx512_bf16"};

static int cpu_has(Kernel k) {
    if (k == KERNEL_PORTABLE) return 1;
#if MHC_X86 && (defined(__GNUC__) || defined(__clang__))
    __builtin_cpu_init();
    const int avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    if (k == KERNEL_AVX2) return avx2;
    const int avx512 = avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                       __builtin_cpu_supports("avx512vl");
    if (k == KERNEL_AVX512) return avx512;
#if MHC_BF16
    return avx512 && __builtin_cpu_supports("avx512bf16");
#else
    return 0;
#endif
#else
    return 0;
#endif
}

static Kernel best_kernel(void) {
    for (int k = KERNEL_COUNT - 1; k > KERNEL_PORTABLE; k--)
        if (cpu_has((Kernel)k)) return (Kernel)k;
    return KERNEL_PORTABLE;
}

/* Work split over threads: `threads` slices of the tokens, each whole blocks (SLICE_ALIGN tokens, a multiple of
   every kernel's blocks), run by OpenMP's threads. Built with -fopenmp (setup.py), the extension links
   libgomp.so.1, which resolves to the one torch has loaded: the slices run on torch's own intra-op pool, whose
   threads would otherwise spin-wait beside threads of ours after each torch op and take their cores. Built
   without OpenMP, the slices run one after another. Every token's forward results and gradient of x depend on
   its own rows alone, so the split changes none of their bits; the gradient of W sums each slice's tokens in
   order, then the slices in order: the same thread count gives the same bits. */
#define MAX_THREADS 256
#define SLICE_ALIGN 24
#if MHC_BF16
_Static_assert(SLICE_ALIGN % TBG_DOT == 0, "a slice must begin at a whole block of grad_x_w_dot");
#endif

typedef enum { JOB_FORWARD, JOB_GRAD_H, JOB_GRAD_X_W } Job;

typedef struct {
    Job job;
    Kernel kernel;
    PreArgs a;   /* JOB_FORWARD */
    GradArgs g;  /* the backward's passes */
} Slice;

static void run_slice(const Slice *s) {
    switch (s->kernel) {
#if MHC_BF16
    case KERNEL_AVX512_BF16:
        if (s->job == JOB_FORWARD) pre_forward_avx512_bf16(&s->a);
        else if (s->job == JOB_GRAD_H) grad_h_avx512(&s->g);
        else if (s->g.w_pairs != NULL) grad_x_w_dot(&s->g);
        else grad_x_w_avx512(&s->g);
        break;
#endif
#if MHC_X86
    case KERNEL_AVX512:
        if (s->job == JOB_FORWARD) pre_forward_avx512(&s->a);
        else if (s->job == JOB_GRAD_H) grad_h_avx512(&s->g);
        else grad_x_w_avx512(&s->g);
        break;
    case KERNEL_AVX2:
        if (s->job == JOB_FORWARD) pre_forward_avx2(&s->a);
        else if (s->job == JOB_GRAD_H) grad_h_avx2(&s->g);
        else grad_x_w_avx2(&s->g);
        break;
#endif
    default:
        if (s->job == JOB_FORWARD) pre_forward_portable(&s->a);
        else if (s->job == JOB_GRAD_H) grad_h_portable(&s->g);
        else grad_x_w_portable(&s->g);
    }
}

static void slice_bounds(Py_ssize_t T, int threads, int i, Py_ssize_t *begin, Py_ssize_t *end) {
    const Py_ssize_t per = ((T + threads - 1) / threads + SLICE_ALIGN - 1) / SLICE_ALIGN * SLICE_ALIGN;
    *begin = (Py_ssize_t)i * per < T ? (Py_ssize_t)i * per : T;
    *end = *begin + per < T ? *begin + per : T;
}

static void run_slices(const Slice *slices, int threads) {
#ifdef _OPENMP
#pragma omp parallel num_threads(threads)
    /* Fewer threads than asked for (a nested region, OMP_THREAD_LIMIT) still run every slice. */
    for (int i = omp_get_thread_num(); i < threads; i += omp_get_num_threads()) run_slice(&slices[i]);
#else
    for (int i = 0; i < threads; i++) run_slice(&slices[i]);
#endif
}

/* `job` over `threads` slices of the tokens, the GIL released (a forward reads `a`, a backward pass `g`; the
   gradient of W of slice i, where asked for, goes to `g_w_sums + i * rows`). */
static void run_job(Job job, Kernel kernel, const PreArgs *a, const GradArgs *g, int threads, float *g_w_sums,
                    Py_ssize_t rows) {
    Slice slices[MAX_THREADS];
    for (int i = 0; i < threads; i++) {
        slices[i] = (Slice){.job = job, .kernel = kernel};
        if (a != NULL) {
            slices[i].a = *a;
            slice_bounds(a->T, threads, i, &slices[i].a.t_begin, &slices[i].a.t_end);
        } else {
            slices[i].g = *g;
            slices[i].g.g_w = g_w_sums ? g_w_sums + i * rows : NULL;
            slice_bounds(g->T, threads, i, &slices[i].g.t_begin, &slices[i].g.t_end);
        }
    }
    Py_BEGIN_ALLOW_THREADS
    run_slices(slices, threads);
    Py_END_ALLOW_THREADS
}

/* The kernel named `name` ('auto': the fastest here) and a thread count in range, else -1 with ValueError set. */
static int resolve(const char *fn, const char *name, int threads, Py_ssize_t n, Py_ssize_t K, Py_ssize_t T,
                   Kernel *kernel) {
    if (n < 1 || n > MAX_N || K % n != 0 || T < 0) {
        PyErr_Format(PyExc_ValueError, "mhc_core.kernels.native._pre.%s: n=%zd must be in [1, 8] and divide K=%zd; "
                     "T=%zd", fn, n, K, T);
        return -1;
    }
    *kernel = KERNEL_COUNT;
    if (strcmp(name, "auto") == 0) *kernel = best_kernel();
    for (int k = 0; k < KERNEL_COUNT; k++)
        if (strcmp(name, KERNEL_NAMES[k]) == 0) *kernel = (Kernel)k;
    if (*kernel == KERNEL_COUNT) {
        PyErr_Format(PyExc_ValueError, "mhc_core.kernels.native._pre.%s: kernel='%s' is none of 'auto', 'portable', "
                     "'avx2', 'avx512', 'avx512_bf16'", fn, name);
        return -1;
    }
    if (!cpu_has(*kernel)) {
        PyErr_Format(PyExc_ValueError, "mhc_core.kernels.native._pre.%s: this CPU lacks the instructions of kernel "
                     "'%s' (its best: '%s')", fn, KERNEL_NAMES[*kernel], KERNEL_NAMES[best_kernel()]);
        return -1;
    }
    if (threads < 1 || threads > MAX_THREADS) {
        PyErr_Format(PyExc_ValueError, "mhc_core.kernels.native._pre.%s: threads=%d must be in [1, %d]", fn, threads,
                     MAX_THREADS);
        return -1;
    }
    return 0;
}

/* The row stride of W's copy: no multiple of 4 KiB. With K a multiple of 1024 (C a multiple of 256 at n = 4),
   rows K apart all fall in one L1 set, and a pass's rows of W beside its rows of x are more lines than the set
   has ways. */
static Py_ssize_t padded_stride(Py_ssize_t K) {
    Py_ssize_t ws = (K + 15) / 16 * 16 + 16;
    if ((ws * (Py_ssize_t)sizeof(float)) % 4096 == 0) ws += 16;
    return ws;
}

/* `copies` zeroed blocks of rows x stride floats, 64 B-aligned; `*block` is what to free. NULL when out of memory. */
static float *padded_blocks(Py_ssize_t rows, Py_ssize_t stride, int copies, void **block) {
    const size_t bytes = (size_t)(rows * stride) * sizeof(float) * (size_t)copies;
    *block = PyMem_RawCalloc(1, bytes + 64);
    return *block == NULL ? NULL : (float *)(((uintptr_t)*block + 63) & ~(uintptr_t)63);
}

static void copy_rows(float *dst, Py_ssize_t stride, const float *src, Py_ssize_t rows, Py_ssize_t K) {
    for (Py_ssize_t j = 0; j < rows; j++) memcpy(dst + j * stride, src + j * K, (size_t)K * sizeof(float));
}

static PyObject *forward(PyObject *self, PyObject *args) {
    (void)self;
    unsigned long long x, w, bias_pre, proj, rms, h_pre, agg, mix;
    PreArgs a;
    const char *name;
    int threads;
    Kernel kernel;
    if (!PyArg_ParseTuple(args, "KinnnKfKfifiiKKKKKsi", &x, &a.x_bf16, &a.T, &a.K, &a.n, &w, &a.alpha_pre,
                          &bias_pre, &a.norm_eps, &a.eps_inside, &a.h_pre_eps, &a.h_pre_bf16, &a.proj_bf16, &proj, &rms,
                          &h_pre, &agg, &mix, &name, &threads) ||
        resolve("forward", name, threads, a.n, a.K, a.T, &kernel) < 0)
        return NULL;
    a.N = a.n * a.n + 2 * a.n;
    a.w_stride = padded_stride(a.K);
    void *w_block;
    float *w_pad = padded_blocks(a.N, a.w_stride, 1, &w_block);
    if (w_pad == NULL) return PyErr_NoMemory();
    copy_rows(w_pad, a.w_stride, (const float *)(uintptr_t)w, a.N, a.K);
    /* The bf16 copy of W for the dot products (W's values are exact in bf16 where the mapping computes in it). */
    uint16_t *w_bf16 = NULL;
    if (MHC_BF16 && kernel == KERNEL_AVX512_BF16 && a.x_bf16 && a.proj_bf16) {
        w_bf16 = PyMem_RawCalloc((size_t)(a.N * a.w_stride), sizeof(uint16_t));
        if (w_bf16 == NULL) {
            PyMem_RawFree(w_block);
            return PyErr_NoMemory();
        }
        for (Py_ssize_t j = 0; j < a.N; j++)
            for (Py_ssize_t k = 0; k < a.K; k++) w_bf16[j * a.w_stride + k] = f32_to_bf16(w_pad[j * a.w_stride + k]);
    }
    a.w_bf16 = w_bf16;
    a.x = (const void *)(uintptr_t)x;
    a.w = w_pad;
    a.bias_pre = (const float *)(uintptr_t)bias_pre;
    a.proj = (float *)(uintptr_t)proj;
    a.rms = (float *)(uintptr_t)rms;
    a.h_pre = (float *)(uintptr_t)h_pre;
    a.agg = (void *)(uintptr_t)agg;
    a.mix = (const float *)(uintptr_t)mix;
    run_job(JOB_FORWARD, kernel, &a, NULL, threads, NULL, 0);
    PyMem_RawFree(w_bf16);
    PyMem_RawFree(w_block);
    return PyUnicode_FromString(KERNEL_NAMES[kernel]);
}

static PyObject *grad_h(PyObject *self, PyObject *args) {
    (void)self;
    unsigned long long x, g_agg, g_h;
    GradArgs g = {0};
    const char *name;
    int threads;
    Kernel kernel;
    if (!PyArg_ParseTuple(args, "KinnnKKsi", &x, &g.x_bf16, &g.T, &g.K, &g.n, &g_agg, &g_h, &name, &threads) ||
        resolve("grad_h", name, threads, g.n, g.K, g.T, &kernel) < 0)
        return NULL;
    g.x = (const void *)(uintptr_t)x;
    g.g_agg = (const void *)(uintptr_t)g_agg;
    g.g_h = (float *)(uintptr_t)g_h;
    run_job(JOB_GRAD_H, kernel, NULL, &g, threads, NULL, 0);
    return PyUnicode_FromString(KERNEL_NAMES[kernel]);
}

static PyObject *grad_x_w(PyObject *self, PyObject *args) {
    (void)self;
    unsigned long long x, g_agg, w, g_proj, coef, h_pre, g_x, g_w;
    GradArgs g = {0};
    const char *name;
    int threads;
    Kernel kernel;
    int bf16_products;
    if (!PyArg_ParseTuple(args, "KinnnKKKKKKKisi", &x, &g.x_bf16, &g.T, &g.K, &g.n, &g_agg, &w, &g_proj, &coef,
                          &h_pre, &g_x, &g_w, &bf16_products, &name, &threads) ||
        resolve("grad_x_w", name, threads, g.n, g.K, g.T, &kernel) < 0)
        return NULL;
    g.N = g.n * g.n + 2 * g.n;
    g.w_stride = padded_stride(g.K);
    /* W's copy, then one zeroed sum of the gradient of W per slice (where it is asked for). */
    const int sums = g_w ? threads : 0;
    void *block;
    float *pad = padded_blocks(g.N, g.w_stride, 1 + sums, &block);
    if (pad == NULL) return PyErr_NoMemory();
    copy_rows(pad, g.w_stride, (const float *)(uintptr_t)w, g.N, g.K);
    g.x = (const void *)(uintptr_t)x;
    g.g_agg = (const void *)(uintptr_t)g_agg;
    g.w = pad;
    g.g_proj = (const float *)(uintptr_t)g_proj;
    g.coef = (const float *)(uintptr_t)coef;
    g.h_pre = (const float *)(uintptr_t)h_pre;
    g.g_x = (void *)(uintptr_t)g_x;
    /* W's columns in pairs of bf16 for the dot products (W and g_proj exact in bf16: a mapping computed in it). */
    uint32_t *w_pairs = NULL;
#if MHC_BF16
    if (kernel == KERNEL_AVX512_BF16 && bf16_products && g.x_bf16) {
        const size_t w_len = (size_t)((g.N + 1) / 2 * g.w_stride), gp_len = (size_t)(g.T / TBG_DOT * gp_pairs_per_block(g.N));
        w_pairs = PyMem_RawCalloc(w_len + gp_len, sizeof(uint32_t));
        if (w_pairs == NULL) {
            PyMem_RawFree(block);
            return PyErr_NoMemory();
        }
        g.gp_pairs = w_pairs + w_len;
        fill_gp_pairs(w_pairs + w_len, g.g_proj, g.T, g.N);
        for (Py_ssize_t q = 0; q < (g.N + 1) / 2; q++)
            for (Py_ssize_t k = 0; k < g.K; k++)
                w_pairs[q * g.w_stride + k] = bf16_pair(pad[2 * q * g.w_stride + k],
                                                        2 * q + 1 < g.N ? pad[(2 * q + 1) * g.w_stride + k] : 0.0f);
    }
#endif
    g.w_pairs = w_pairs;
    const Py_ssize_t rows = g.N * g.w_stride;
    run_job(JOB_GRAD_X_W, kernel, NULL, &g, threads, sums ? pad + rows : NULL, rows);
    PyMem_RawFree(w_pairs);
    if (sums) {
        float *out = (float *)(uintptr_t)g_w; /* [N, K]: the slices' sums added in slice order */
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t j = 0; j < g.N; j++)
            for (Py_ssize_t k = 0; k < g.K; k++) {
                float s = 0.0f;
                for (int i = 0; i < sums; i++) s += pad[(1 + i) * rows + j * g.w_stride + k];
                out[j * g.K + k] = s;
            }
        Py_END_ALLOW_THREADS
    }
    PyMem_RawFree(block);
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
     "proj_bf16, proj_ptr, rms_ptr, h_pre_ptr, agg_ptr, mix_ptr, kernel, threads) -> str: the pre-op's forward pass "
     "(mix_ptr: the single-pass form's aggregate weights [T, n] fp32, or 0 for h_pre's; see the "
     "file's comment) with `kernel` ('auto': the first of kernels()) on `threads` threads; returns the kernel that ran"},
    {"grad_h", grad_h, METH_VARARGS,
     "grad_h(x_ptr, x_bf16, T, K, n, g_agg_ptr, g_h_ptr, kernel, threads) -> str: the backward's first pass, "
     "g_h [T, n] fp32 = sum_c g_agg[t, c] x[t, i*C + c]"},
    {"grad_x_w", grad_x_w, METH_VARARGS,
     "grad_x_w(x_ptr, x_bf16, T, K, n, g_agg_ptr, w_ptr, g_proj_ptr, coef_ptr, h_pre_ptr, g_x_ptr, g_w_ptr, "
     "bf16_products, kernel, threads) -> str: the backward's second pass, g_x [T, K] in x's dtype = g_proj @ W + "
     "coef x + h_pre (x) g_agg and g_w [N, K] fp32 = g_proj^T @ x (a null pointer skips either); bf16_products: W "
     "and g_proj hold bf16 values, which the avx512_bf16 kernel multiplies with bf16 x as bf16 pairs"},
    {"kernels", kernels, METH_NOARGS, "kernels() -> list[str]: the kernels this CPU runs, the fastest first"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_pre", "The CPU forward and backward of mHC's fused pre-op.",
                                    -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__pre(void) { return PyModule_Create(&module); }
