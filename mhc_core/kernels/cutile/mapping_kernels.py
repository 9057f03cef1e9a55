"""cuTile kernels for the mHC coefficient mapping, forward and backward.

The projection weight `[N, K]` (N = n*n + 2n, K = n*C) is read through two row views,
`w_pp = weight[:2n]` (pre | post) and `w_res = weight[2n:]` (res), so every tile has a power-of-two
width (2n and n*n) without copying or padding the weight. Biases and projections are split the
same way.

Forward (two launches):
1. `mapping_fwd_partial_kernel`, grid `(cdiv(T, TILE_M), S)`: split `s` of K; one pass over `x`
   computes both projections with `ct.mma` (fp32 accumulators) and the sum of squares of `x`;
   writes fp32 partials `part_pp [S, T, 2n]`, `part_res [S, T, n*n]`, `part_sq [S, T]`.
2. `mapping_fwd_epilogue_kernel`, grid `(cdiv(T, TILE_M),)`: sums the S partials,
   `rms = sqrt(sumsq / K + eps_inside)`, `r = 1 / (rms + norm_eps)`, `h = r * proj * alpha + bias`
   (the spec's eps placement gives the eps to one of `eps_inside` and `norm_eps`, the other is 0),
   `h_pre = sigmoid(h) + h_pre_eps`, `h_post = 2 sigmoid(h)`, `h_res = h`; also keeps the fp32
   `proj` and `rms` for the backward.

Backward (two launches):
1. `mapping_bwd_coef_kernel`, grid `(cdiv(T, TILE_M),)`: gate derivatives, `gp = dL/dproj`
   (fp32), the per-token RMS coefficient `cx = dL/dr * dr/dx / x`, and per-block partial sums
   for the gradients of `bias` and the three alphas.
2. `mapping_bwd_dx_dw_kernel`, grid `(cdiv(K, TILE_K), S)`: `grad_x = gp @ W + cx * x`
   (stored per tile) and `grad_W = gp^T @ x`, accumulated over this split's token tiles into
   fp32 partials `[S, N, K]`. The fused pre-op launches `pre_bwd_dx_dw_kernel` instead: the same with the
   aggregate's `h_pre[t, i] * grad_agg[t, c]` added to `grad_x`, its one gradient of x.

`MMA` selects the tensor-core precision: 0 = bf16 operands (forward of the `megatron_main` bf16
path, whose reference rounds the weight to bf16), 1 = TF32, 2 = 3xTF32 (hi/lo split, about fp32
accuracy: the default for fp32 activations unless `torch.backends.cuda.matmul.allow_tf32` is
set). The backward never uses 0. Accumulation is always fp32.
"""

from __future__ import annotations

import cuda.tile as ct

from mhc_core.kernels.cutile.constants import MMA_3XTF32
from mhc_core.kernels.cutile.mma import mma_at

ConstInt = ct.Constant[int]
PAD_ZERO = ct.PaddingMode.ZERO
F32 = ct.float32


def _fma_rows(g, w, acc, J, TILE_M):
    """`acc + g @ w` as `J` broadcast FMAs: `g [TILE_M, J]` fp32, `w [J, TILE_K]`."""
    for j in ct.static_iter(range(J)):
        acc = acc + ct.extract(g, (0, j), shape=(TILE_M, 1)) * ct.astype(
            ct.extract(w, (j, 0), shape=(1, w.shape[1])), F32
        )
    return acc


def _fma_cols(g, af, J, TILE_M):
    """`g^T @ af` as `[J, TILE_K]`: row `j` is `sum_m g[m, j] af[m, :]` (fp32 throughout)."""
    rows = ct.arange(J, dtype=ct.int32)
    out = ct.zeros((J, af.shape[1]), dtype=F32)
    for j in ct.static_iter(range(J)):
        col = ct.sum(ct.extract(g, (0, j), shape=(TILE_M, 1)) * af, axis=0, keepdims=True)
        out = out + ct.reshape(ct.where(rows == j, 1.0, 0.0), (J, 1)) * col
    return out


def _load_f32(arr, index, shape):
    return ct.astype(ct.load(arr, index=index, shape=shape, padding_mode=PAD_ZERO), F32)


def _scalar_f32(arr):
    """A `[1]` parameter as a `(1, 1)` fp32 tile."""
    return ct.reshape(_load_f32(arr, (0,), (1,)), (1, 1))


def _alpha_pp(alpha_pre, alpha_post, N):
    """`[alpha_pre x n | alpha_post x n]` as a `(1, 2n)` fp32 tile."""
    lanes = ct.reshape(ct.arange(2 * N, dtype=ct.int32), (1, 2 * N))
    a_pre = ct.broadcast_to(_scalar_f32(alpha_pre), (1, 2 * N))
    a_post = ct.broadcast_to(_scalar_f32(alpha_post), (1, 2 * N))
    return ct.where(lanes < N, a_pre, a_post)


def _sigmoid(v):
    return 1.0 / (1.0 + ct.exp(-v))


@ct.kernel
def mapping_fwd_partial_kernel(
    x,
    w_pp,
    w_res,
    part_pp,
    part_res,
    part_sq,
    k_tiles_per_split: int,
    N: ConstInt,
    TILE_M: ConstInt,
    TILE_K: ConstInt,
    MMA: ConstInt,
):
    """Partial projections and sum of squares of one K split; grid `(cdiv(T, TILE_M), S)`."""
    pm = ct.bid(0)
    ps = ct.bid(1)
    k_tiles = ct.num_tiles(x, axis=1, shape=(TILE_M, TILE_K))
    k_begin = ps * k_tiles_per_split
    k_end = ct.minimum(k_begin + k_tiles_per_split, k_tiles)
    acc_pp = ct.zeros((TILE_M, 2 * N), dtype=F32)
    acc_res = ct.zeros((TILE_M, N * N), dtype=F32)
    sq = ct.zeros((TILE_M, 1), dtype=F32)
    for kt in range(k_begin, k_end):
        a = ct.load(x, index=(pm, kt), shape=(TILE_M, TILE_K), padding_mode=PAD_ZERO)
        b_pp = ct.load(w_pp, index=(kt, 0), shape=(TILE_K, 2 * N), order=(1, 0), padding_mode=PAD_ZERO)
        b_res = ct.load(w_res, index=(kt, 0), shape=(TILE_K, N * N), order=(1, 0), padding_mode=PAD_ZERO)
        af = ct.astype(a, F32)
        sq = sq + ct.sum(af * af, axis=1, keepdims=True)
        acc_pp = mma_at(a, b_pp, acc_pp, MMA)
        acc_res = mma_at(a, b_res, acc_res, MMA)
    ct.store(part_pp, index=(ps, pm, 0), tile=ct.reshape(acc_pp, (1, TILE_M, 2 * N)))
    ct.store(part_res, index=(ps, pm, 0), tile=ct.reshape(acc_res, (1, TILE_M, N * N)))
    ct.store(part_sq, index=(ps, pm), tile=ct.reshape(sq, (1, TILE_M)))


@ct.kernel
def mapping_fwd_epilogue_kernel(
    part_pp,
    part_res,
    part_sq,
    alpha_pre,
    alpha_post,
    alpha_res,
    bias_pp,
    bias_res,
    h_pre,
    h_post,
    h_res,
    proj_pp,
    proj_res,
    rms_out,
    inv_k: float,
    norm_eps: float,
    h_pre_eps: float,
    eps_inside: float,
    N: ConstInt,
    TILE_M: ConstInt,
):
    """Reduce the K splits and apply RMS, alphas, bias and gates; grid `(cdiv(T, TILE_M),)`."""
    pm = ct.bid(0)
    p_pp = ct.zeros((TILE_M, 2 * N), dtype=F32)
    p_res = ct.zeros((TILE_M, N * N), dtype=F32)
    sq = ct.zeros((TILE_M,), dtype=F32)
    for s in range(part_sq.shape[0]):
        p_pp = p_pp + ct.reshape(_load_f32(part_pp, (s, pm, 0), (1, TILE_M, 2 * N)), (TILE_M, 2 * N))
        p_res = p_res + ct.reshape(_load_f32(part_res, (s, pm, 0), (1, TILE_M, N * N)), (TILE_M, N * N))
        sq = sq + ct.reshape(_load_f32(part_sq, (s, pm), (1, TILE_M)), (TILE_M,))
    rms = ct.sqrt(sq * inv_k + eps_inside)
    r = ct.reshape(1.0 / (rms + norm_eps), (TILE_M, 1))
    b_pp = ct.reshape(_load_f32(bias_pp, (0,), (2 * N,)), (1, 2 * N))
    b_res = ct.reshape(_load_f32(bias_res, (0,), (N * N,)), (1, N * N))
    gates = _sigmoid(r * p_pp * _alpha_pp(alpha_pre, alpha_post, N) + b_pp)
    logits = r * p_res * _scalar_f32(alpha_res) + b_res
    pre = ct.extract(gates, (0, 0), shape=(TILE_M, N)) + h_pre_eps
    post = 2.0 * ct.extract(gates, (0, 1), shape=(TILE_M, N))
    ct.store(h_pre, index=(pm, 0), tile=ct.astype(pre, h_pre.dtype))
    ct.store(h_post, index=(pm, 0), tile=ct.astype(post, h_post.dtype))
    ct.store(h_res, index=(pm, 0, 0), tile=ct.astype(ct.reshape(logits, (TILE_M, N, N)), h_res.dtype))
    ct.store(proj_pp, index=(pm, 0), tile=p_pp)
    ct.store(proj_res, index=(pm, 0), tile=p_res)
    ct.store(rms_out, index=(pm,), tile=rms)


@ct.kernel
def mapping_bwd_coef_kernel(
    grad_pre,
    grad_post,
    grad_res,
    proj_pp,
    proj_res,
    rms_in,
    alpha_pre,
    alpha_post,
    alpha_res,
    bias_pp,
    bias_res,
    gp_pp,
    gp_res,
    cx,
    gbias_pp_part,
    gbias_res_part,
    galpha_part,
    inv_k: float,
    norm_eps: float,
    N: ConstInt,
    TILE_M: ConstInt,
):
    """Per-token gradients of the epilogue; grid `(cdiv(T, TILE_M),)`.

    Writes `gp = dL/dproj` (fp32 `[T, 2n]`, `[T, n*n]`), `cx [T]` with
    `dL/dx (RMS term) = cx * x`, and this block's partial sums: `gbias_pp_part [B, 2n]`,
    `gbias_res_part [B, n*n]`, `galpha_part [B, 4]` (pre, post, res, 0).
    """
    pm = ct.bid(0)
    p_pp = _load_f32(proj_pp, (pm, 0), (TILE_M, 2 * N))
    p_res = _load_f32(proj_res, (pm, 0), (TILE_M, N * N))
    rms = ct.reshape(_load_f32(rms_in, (pm,), (TILE_M,)), (TILE_M, 1))
    # With the eps inside the square root, norm_eps is 0 here and rms > 0 on every real row: the zero
    # rms of a row past T gets r = 0, so it adds nothing (not inf * 0).
    r = ct.where(rms + norm_eps > 0.0, 1.0 / (rms + norm_eps), 0.0)
    a_pp = _alpha_pp(alpha_pre, alpha_post, N)
    a_res = _scalar_f32(alpha_res)
    b_pp = ct.reshape(_load_f32(bias_pp, (0,), (2 * N,)), (1, 2 * N))
    gates = _sigmoid(r * p_pp * a_pp + b_pp)
    g_gates = ct.cat(
        (_load_f32(grad_pre, (pm, 0), (TILE_M, N)), 2.0 * _load_f32(grad_post, (pm, 0), (TILE_M, N))), axis=1
    )
    gh_pp = g_gates * gates * (1.0 - gates)
    gh_res = ct.reshape(_load_f32(grad_res, (pm, 0, 0), (TILE_M, N, N)), (TILE_M, N * N))
    # Rows past T load as zeros, so they add nothing below.
    ct.store(gbias_pp_part, index=(pm, 0), tile=ct.sum(gh_pp, axis=0, keepdims=True))
    ct.store(gbias_res_part, index=(pm, 0), tile=ct.sum(gh_res, axis=0, keepdims=True))
    t_pp = gh_pp * r * p_pp
    lanes_pp = ct.reshape(ct.arange(2 * N, dtype=ct.int32), (1, 2 * N))
    ga_pre = ct.sum(ct.where(lanes_pp < N, t_pp, 0.0))
    ga_post = ct.sum(ct.where(lanes_pp < N, 0.0, t_pp))
    ga_res = ct.sum(gh_res * r * p_res)
    slot = ct.reshape(ct.arange(4, dtype=ct.int32), (1, 4))
    ga = ct.where(slot == 0, ga_pre, ct.where(slot == 1, ga_post, ct.where(slot == 2, ga_res, 0.0)))
    ct.store(galpha_part, index=(pm, 0), tile=ga)
    ct.store(gp_pp, index=(pm, 0), tile=gh_pp * r * a_pp)
    ct.store(gp_res, index=(pm, 0), tile=gh_res * r * a_res)
    g_r = ct.sum(gh_pp * p_pp * a_pp, axis=1, keepdims=True) + ct.sum(
        gh_res * p_res * a_res, axis=1, keepdims=True
    )
    # r = 1 / (rms + eps), rms = ||x|| / sqrt(K): dr/dx = -r^2 x / (K rms); zero where rms == 0.
    safe = ct.where(rms > 0.0, rms, 1.0)
    c = ct.where(rms > 0.0, -g_r * r * r * inv_k / safe, 0.0)
    ct.store(cx, index=(pm,), tile=ct.reshape(c, (TILE_M,)))


def _bwd_weights(w_pp, w_res, pk, N, TILE_K):
    """The weight columns of K tile `pk`: `wt_pp [2n, TILE_K]`, `wt_res [n*n, TILE_K]`, and at n = 2
    both joined (`wt_all`, see `_grad_x`)."""
    wt_pp = ct.load(w_pp, index=(0, pk), shape=(2 * N, TILE_K), padding_mode=PAD_ZERO)
    wt_res = ct.load(w_res, index=(0, pk), shape=(N * N, TILE_K), padding_mode=PAD_ZERO)
    if N == 2:
        wt_all = ct.cat((wt_pp, wt_res), axis=0)
    else:
        wt_all = wt_pp  # unused
    return wt_pp, wt_res, wt_all


def _joined(g_pp, g_res, N, MMA):
    """At n = 2 with TF32 operands, `[g_pp | g_res]` `[TILE_M, 2n + n*n]` (see `_grad_x`); else unused."""
    if N == 2 and MMA != MMA_3XTF32:
        g_all = ct.cat((g_pp, g_res), axis=1)
    else:
        g_all = g_pp  # unused
    return g_all


def _grad_x(a, g_pp, g_res, g_all, c, wt_pp, wt_res, wt_all, N, TILE_M, MMA):
    """`grad_x = gp @ W + cx * x` for one `[TILE_M, TILE_K]` tile, fp32 (`g_all`: `_joined`).

    At n = 2 both heads are 4 wide, under the MMA's k = 8: a K = 4 MMA gave a wrong grad_x on
    sm_90. With TF32 operands the two heads are joined into one 8-wide operand (ct.cat; the shape
    n = 4 uses; passes the GPU parity test); with 3xTF32 that join hit a tileiras 13.4 loop
    scheduling error, so the fp32 path does eight fp32 FMAs per element instead (exact fp32).
    """
    gx = ct.astype(a, F32) * c
    if N == 2 and MMA == MMA_3XTF32:
        gx = _fma_rows(g_pp, wt_pp, gx, 2 * N, TILE_M)
        gx = _fma_rows(g_res, wt_res, gx, N * N, TILE_M)
    elif N == 2:
        gx = mma_at(g_all, wt_all, gx, MMA)
    else:
        gx = mma_at(g_pp, wt_pp, gx, MMA)
        gx = mma_at(g_res, wt_res, gx, MMA)
    return gx


def _dx_dw(
    x,
    w_pp,
    w_res,
    gp_pp,
    gp_res,
    cx,
    grad_agg,
    h_pre,
    grad_x,
    gw_pp_part,
    gw_res_part,
    m_tiles_per_split,
    N,
    TILE_M,
    TILE_K,
    MMA,
    AGG,
):
    """The body of the dx / dW kernels (`AGG`: also the aggregate's `h_pre[t, i] * grad_agg[t, c]` in `grad_x`)."""
    pk = ct.bid(0)
    ps = ct.bid(1)
    m_tiles = ct.num_tiles(x, axis=0, shape=(TILE_M, TILE_K))
    m_begin = ps * m_tiles_per_split
    m_end = ct.minimum(m_begin + m_tiles_per_split, m_tiles)
    wt_pp, wt_res, wt_all = _bwd_weights(w_pp, w_res, pk, N, TILE_K)
    acc_pp = ct.zeros((2 * N, TILE_K), dtype=F32)
    acc_res = ct.zeros((N * N, TILE_K), dtype=F32)
    acc_all = ct.zeros((4 * N, TILE_K), dtype=F32)  # 2n + n*n rows at n = 2; unused otherwise
    if AGG:
        # K tile pk is channel tile pc of the stream `stream` (TILE_K divides C).
        per_stream = ct.num_tiles(grad_agg, axis=1, shape=(TILE_M, TILE_K))
        stream = pk // per_stream
        pc = pk - stream * per_stream
    else:
        stream = 0  # unused
        pc = 0  # unused
    for mt in range(m_begin, m_end):
        a = ct.load(x, index=(mt, pk), shape=(TILE_M, TILE_K), padding_mode=PAD_ZERO)
        g_pp = _load_f32(gp_pp, (mt, 0), (TILE_M, 2 * N))
        g_res = _load_f32(gp_res, (mt, 0), (TILE_M, N * N))
        g_all = _joined(g_pp, g_res, N, MMA)
        c = ct.reshape(_load_f32(cx, (mt,), (TILE_M,)), (TILE_M, 1))
        gx = _grad_x(a, g_pp, g_res, g_all, c, wt_pp, wt_res, wt_all, N, TILE_M, MMA)
        if AGG:
            lanes = ct.reshape(ct.arange(N, dtype=ct.int32), (1, N))
            weight = ct.sum(
                ct.where(lanes == stream, _load_f32(h_pre, (mt, 0), (TILE_M, N)), 0.0), axis=1, keepdims=True
            )
            gx = gx + weight * _load_f32(grad_agg, (mt, pc), (TILE_M, TILE_K))
        ct.store(grad_x, index=(mt, pk), tile=ct.astype(gx, grad_x.dtype))
        if N == 2 and MMA == MMA_3XTF32:
            af = ct.astype(a, F32)
            acc_pp = acc_pp + _fma_cols(g_pp, af, 2 * N, TILE_M)
            acc_res = acc_res + _fma_cols(g_res, af, N * N, TILE_M)
        elif N == 2:
            acc_all = mma_at(ct.transpose(g_all), a, acc_all, MMA)
        else:
            acc_pp = mma_at(ct.transpose(g_pp), a, acc_pp, MMA)
            acc_res = mma_at(ct.transpose(g_res), a, acc_res, MMA)
    if N == 2 and MMA != MMA_3XTF32:
        acc_pp = ct.extract(acc_all, (0, 0), shape=(2 * N, TILE_K))
        acc_res = ct.extract(acc_all, (1, 0), shape=(N * N, TILE_K))
    ct.store(gw_pp_part, index=(ps, 0, pk), tile=ct.reshape(acc_pp, (1, 2 * N, TILE_K)))
    ct.store(gw_res_part, index=(ps, 0, pk), tile=ct.reshape(acc_res, (1, N * N, TILE_K)))


@ct.kernel
def mapping_bwd_dx_dw_kernel(
    x,
    w_pp,
    w_res,
    gp_pp,
    gp_res,
    cx,
    grad_x,
    gw_pp_part,
    gw_res_part,
    m_tiles_per_split: int,
    N: ConstInt,
    TILE_M: ConstInt,
    TILE_K: ConstInt,
    MMA: ConstInt,
):
    """`grad_x = gp @ W + cx * x` and partial `grad_W = gp^T @ x`; grid `(cdiv(K, TILE_K), S)`."""
    _dx_dw(
        x,
        w_pp,
        w_res,
        gp_pp,
        gp_res,
        cx,
        x,
        x,
        grad_x,
        gw_pp_part,
        gw_res_part,
        m_tiles_per_split,
        N,
        TILE_M,
        TILE_K,
        MMA,
        0,
    )


@ct.kernel
def pre_bwd_dx_dw_kernel(
    x,
    w_pp,
    w_res,
    gp_pp,
    gp_res,
    cx,
    grad_agg,
    h_pre,
    grad_x,
    gw_pp_part,
    gw_res_part,
    m_tiles_per_split: int,
    N: ConstInt,
    TILE_M: ConstInt,
    TILE_K: ConstInt,
    MMA: ConstInt,
):
    """The fused pre-op's one gradient of x: `grad_x = gp @ W + cx * x + h_pre[t, i] * grad_agg[t, c]` (k = i*C + c,
    TILE_K divides C) and partial `grad_W = gp^T @ x`; grid `(cdiv(K, TILE_K), S)`."""
    _dx_dw(
        x,
        w_pp,
        w_res,
        gp_pp,
        gp_res,
        cx,
        grad_agg,
        h_pre,
        grad_x,
        gw_pp_part,
        gw_res_part,
        m_tiles_per_split,
        N,
        TILE_M,
        TILE_K,
        MMA,
        1,
    )
