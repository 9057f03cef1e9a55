/* One instruction set's kernels of the fused pre-op, included by pre.c once per set. The includer defines:

     SIMD_TARGET        the function attribute that enables the set, e.g. __attribute__((target("avx2,fma")))
     SIMD_FN(name)      the set's name for a function (name##_avx2)
     VEC, LANES         the fp32 vector type and its lane count
     TBS, JBS           tokens per block and projection columns per pass: TBS * JBS accumulators, JBS rows of
                        W and one row of x fill the registers of the set (16 for AVX2, 32 for AVX-512)
     TBG                tokens per block of the backward's second pass (2 * TBG vectors in registers)
     VZERO(), VLOADF(p), VLOADX(x, bf16, i), VFMA(a, b, c), VSET1(f), VSTOREF(p, v), VHSUM(v) and
                        VSTOREBF16(p, v) (rounded to nearest even, as f32_to_bf16)

   and gets SIMD_FN(pre_forward)(const PreArgs *), its per-block SIMD_FN(finish_block), and the backward's passes
   SIMD_FN(grad_h) and SIMD_FN(grad_x_w)(const GradArgs *); the file undefines the parameters at its end.

   Forward: projection and sum of squares of a block of TBS tokens run over K in chunks of KC: per chunk the
   block's slices of x (TBS * KC values) and, group by group, JBS rows of W stay in L1 / L2; the vector partial
   sums of every (token, column) pair live in `part` across chunks. Per LANES columns of K, TBS loads of x and
   JBS of W feed TBS * JBS FMAs. Then, per token, the coefficients, and the aggregate from the block's rows
   while they are in cache. */

/* LANES values to element i of a buffer in bf16 (rounded to nearest even) or fp32. */
SIMD_TARGET __attribute__((always_inline)) static inline void SIMD_FN(store_lanes)(void *p, int bf16, Py_ssize_t i,
                                                                                   VEC v) {
    if (bf16)
        VSTOREBF16((uint16_t *)p + i, v);
    else
        VSTOREF((float *)p + i, v);
}

SIMD_TARGET __attribute__((always_inline)) static inline void SIMD_FN(project_block_as)(
        const PreArgs *a, Py_ssize_t t0, Py_ssize_t tb, float *sumsq, const int bf16) {
    const Py_ssize_t K = a->K, N = a->N, KV = K - K % LANES, WS = a->w_stride;
    const void *x = a->x;
    const float *w = a->w;
    VEC part[TBS][MAX_N * (MAX_N + 2)], sq[TBS];
    for (Py_ssize_t u = 0; u < TBS; u++) {
        sq[u] = VZERO();
        for (Py_ssize_t j = 0; j < N; j++) part[u][j] = VZERO();
    }
    const int full = tb == TBS;
    for (Py_ssize_t k0 = 0; k0 < KV; k0 += KC) {
        const Py_ssize_t k1 = k0 + KC < KV ? k0 + KC : KV;
        for (Py_ssize_t j0 = 0; j0 < N; j0 += JBS) {
            const Py_ssize_t jb = N - j0 < JBS ? N - j0 : JBS;
            VEC acc[TBS][JBS];
            for (int u = 0; u < TBS; u++)
                for (int v = 0; v < JBS; v++) acc[u][v] = part[u][j0 + v < N ? j0 + v : N - 1];
            if (full && jb == JBS) {
                /* Constant trip counts: the TBS * JBS accumulators live in registers. */
                const float *w0 = w + j0 * WS;
                for (Py_ssize_t k = k0; k < k1; k += LANES) {
                    VEC wv[JBS];
                    for (int v = 0; v < JBS; v++) wv[v] = VLOADF(w0 + v * WS + k);
                    for (int u = 0; u < TBS; u++) {
                        VEC xv = VLOADX(x, bf16, (t0 + u) * K + k);
                        for (int v = 0; v < JBS; v++) acc[u][v] = VFMA(xv, wv[v], acc[u][v]);
                    }
                }
            } else {
                for (Py_ssize_t k = k0; k < k1; k += LANES) {
                    VEC wv[JBS];
                    for (Py_ssize_t v = 0; v < jb; v++) wv[v] = VLOADF(w + (j0 + v) * WS + k);
                    for (Py_ssize_t u = 0; u < tb; u++) {
                        VEC xv = VLOADX(x, bf16, (t0 + u) * K + k);
                        for (Py_ssize_t v = 0; v < jb; v++) acc[u][v] = VFMA(xv, wv[v], acc[u][v]);
                    }
                }
            }
            for (Py_ssize_t u = 0; u < TBS; u++)
                for (Py_ssize_t v = 0; v < jb; v++) part[u][j0 + v] = acc[u][v];
        }
        for (Py_ssize_t u = 0; u < tb; u++)
            for (Py_ssize_t k = k0; k < k1; k += LANES) {
                VEC xv = VLOADX(x, bf16, (t0 + u) * K + k);
                sq[u] = VFMA(xv, xv, sq[u]);
            }
    }
    for (Py_ssize_t u = 0; u < tb; u++) {
        float sums[MAX_N * (MAX_N + 2)];
        for (Py_ssize_t j = 0; j < N; j++) sums[j] = VHSUM(part[u][j]);
        sumsq[u] = projection_tail(a, t0 + u, KV, sums, VHSUM(sq[u]));
    }
}

/* Per token of a block whose projection and sums of squares are in: the coefficients, then the aggregate from
   the block's rows while they are in cache. */
SIMD_TARGET static void SIMD_FN(finish_block)(const PreArgs *a, Py_ssize_t t0, Py_ssize_t tb, const float *sumsq) {
    const Py_ssize_t K = a->K, n = a->n, C = K / n, CV = C - C % LANES;
    for (Py_ssize_t u = 0; u < tb; u++) {
        const Py_ssize_t t = t0 + u;
        float hp[MAX_N];
        token_coefficients(a, t, sumsq[u], hp);
        for (Py_ssize_t c = 0; c < CV; c += LANES) {
            VEC acc = VZERO();
            for (Py_ssize_t i = 0; i < n; i++) acc = VFMA(VSET1(hp[i]), VLOADX(a->x, a->x_bf16, t * K + i * C + c), acc);
            SIMD_FN(store_lanes)(a->agg, a->x_bf16, t * C + c, acc);
        }
        aggregate_from(a, t, hp, CV);
    }
}

SIMD_TARGET static void SIMD_FN(pre_forward)(const PreArgs *a) {
    for (Py_ssize_t t0 = a->t_begin; t0 < a->t_end; t0 += TBS) {
        const Py_ssize_t tb = a->t_end - t0 < TBS ? a->t_end - t0 : TBS;
        float sumsq[TBS] = {0};
        if (a->x_bf16) /* one copy of the block's loop per dtype, so that the loads are not branches */
            SIMD_FN(project_block_as)(a, t0, tb, sumsq, 1);
        else
            SIMD_FN(project_block_as)(a, t0, tb, sumsq, 0);
        SIMD_FN(finish_block)(a, t0, tb, sumsq);
    }
}

/* Backward pass 1: g_h[t, i] = sum_c g_agg[t, c] x[t, i*C + c] (the aggregate's gradient of h_pre). */
SIMD_TARGET static void SIMD_FN(grad_h)(const GradArgs *g) {
    const Py_ssize_t K = g->K, n = g->n, C = K / n, CV = C - C % LANES;
    for (Py_ssize_t t = g->t_begin; t < g->t_end; t++)
        for (Py_ssize_t i = 0; i < n; i++) {
            VEC acc = VZERO();
            for (Py_ssize_t c = 0; c < CV; c += LANES)
                acc = VFMA(VLOADX(g->g_agg, g->x_bf16, t * C + c), VLOADX(g->x, g->x_bf16, t * K + i * C + c), acc);
            float sum = VHSUM(acc);
            grad_h_from(g, t, i, CV, &sum);
            g->g_h[t * n + i] = sum;
        }
}

/* Backward pass 2 over LANES columns k = i*C + c of a block of `tb` tokens (called with the constant TBG for a
   whole block, so that the 2 * TBG vectors of x and g_x stay in registers):
     g_x[t, k] = coef[t] x[t, k] + h_pre[t, i] g_agg[t, c] + sum_j g_proj[t, j] W[j, k]
     g_w[j, k] += sum_t g_proj[t, j] x[t, k]                (t in the block, in order) */
SIMD_TARGET __attribute__((always_inline)) static inline void SIMD_FN(grad_x_w_lanes)(
        const GradArgs *g, Py_ssize_t t0, Py_ssize_t tb, Py_ssize_t i, Py_ssize_t c, const int bf16) {
    const Py_ssize_t K = g->K, n = g->n, N = g->N, C = K / n, k = i * C + c, WS = g->w_stride;
    VEC xv[TBG], gx[TBG];
    for (Py_ssize_t u = 0; u < tb; u++) {
        const Py_ssize_t t = t0 + u;
        xv[u] = VLOADX(g->x, bf16, t * K + k);
        gx[u] = VFMA(VSET1(g->coef[t]), xv[u],
                     VFMA(VSET1(g->h_pre[t * n + i]), VLOADX(g->g_agg, bf16, t * C + c), VZERO()));
    }
    const float *gp = g->g_proj + t0 * N;
    for (Py_ssize_t j = 0; j < N; j++) {
        const VEC wv = VLOADF(g->w + j * WS + k);
        if (g->g_w) {
            VEC gw = VLOADF(g->g_w + j * WS + k);
            for (Py_ssize_t u = 0; u < tb; u++) {
                const VEC b = VSET1(gp[u * N + j]);
                gx[u] = VFMA(b, wv, gx[u]);
                gw = VFMA(b, xv[u], gw);
            }
            VSTOREF(g->g_w + j * WS + k, gw);
        } else {
            for (Py_ssize_t u = 0; u < tb; u++) gx[u] = VFMA(VSET1(gp[u * N + j]), wv, gx[u]);
        }
    }
    if (g->g_x)
        for (Py_ssize_t u = 0; u < tb; u++) SIMD_FN(store_lanes)(g->g_x, bf16, (t0 + u) * K + k, gx[u]);
}

SIMD_TARGET __attribute__((always_inline)) static inline void SIMD_FN(grad_x_w_as)(const GradArgs *g, const int bf16) {
    const Py_ssize_t n = g->n, C = g->K / n, CV = C - C % LANES;
    for (Py_ssize_t t0 = g->t_begin; t0 < g->t_end; t0 += TBG) {
        const Py_ssize_t tb = g->t_end - t0 < TBG ? g->t_end - t0 : TBG;
        for (Py_ssize_t i = 0; i < n; i++) {
            for (Py_ssize_t c = 0; c < CV; c += LANES) {
                if (tb == TBG)
                    SIMD_FN(grad_x_w_lanes)(g, t0, TBG, i, c, bf16);
                else
                    SIMD_FN(grad_x_w_lanes)(g, t0, tb, i, c, bf16);
            }
            for (Py_ssize_t u = 0; u < tb; u++)
                for (Py_ssize_t c = CV; c < C; c++) grad_x_w_at(g, t0 + u, i, c);
        }
    }
}

SIMD_TARGET static void SIMD_FN(grad_x_w)(const GradArgs *g) {
    if (g->x_bf16) /* one copy per dtype, so that the loads are not branches */
        SIMD_FN(grad_x_w_as)(g, 1);
    else
        SIMD_FN(grad_x_w_as)(g, 0);
}

/* The parameters, undefined for the next instruction set. */
#undef SIMD_TARGET
#undef SIMD_FN
#undef VEC
#undef LANES
#undef TBS
#undef JBS
#undef TBG
#undef VZERO
#undef VLOADF
#undef VLOADX
#undef VFMA
#undef VSET1
#undef VSTOREF
#undef VHSUM
#undef VSTOREBF16
