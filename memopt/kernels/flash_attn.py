"""FlashAttention (Dao et al., 2022) forward and backward as Triton kernels.

Why this exists (memory)
------------------------
Plain attention ``softmax(Q K^T * scale + mask) V`` materialises the
(B, H, Nq, Nk) score and probability matrices and autograd keeps them for the
backward pass, so the bytes saved per attention layer grow as O(N^2) with the
sequence length N.  FlashAttention never materialises them: the forward pass
streams key/value tiles through on-chip memory with an *online softmax*
(running max ``m`` and running normaliser ``l`` per query row, fp32
accumulation), and the backward pass *recomputes* the probabilities tile by
tile from Q, K and the per-row log-sum-exp (LSE).  What is saved for backward
is therefore only ``q, k, v, O`` (each O(N*D)) and ``LSE`` (fp32, O(N)):
O(N) bytes instead of O(N^2).  Doubling N doubles the saved bytes instead of
quadrupling them.

Kernels
-------
* ``_flash_fwd_kernel``: one program per (query block, batch*head).  Loops
  over key blocks (only up to the diagonal when causal), keeps ``m``, ``l`` and
  the fp32 output accumulator in registers, writes ``O`` (input dtype) and
  ``LSE`` (fp32, natural log).  Exponentials are computed with ``exp2`` on
  scores pre-multiplied by ``scale * log2(e)``.
* ``_flash_bwd_dq_kernel``: one program per (query block, batch*head); first
  forms its rows' ``delta_i = sum_d dO_id * O_id`` (fp32, which equals
  ``sum_j P_ij dP_ij``, needed by the softmax backward ``dS = P * (dP - delta)``)
  and stores it for the dK/dV kernel, then loops over key blocks and
  accumulates ``dQ = scale * dS K`` in fp32.
* ``_flash_bwd_dkdv_kernel``, launched after it: one program per (key block,
  batch*head); loops over query blocks (for causal, only those at or below the
  diagonal) and accumulates ``dV = P^T dO`` and ``dK = scale * dS^T Q`` in fp32.

``delta`` used to be a pre-pass kernel of its own; at N = 1k a forward +
backward is bound by the host's launches (experiments/flash_attn), so it is
folded into the dQ kernel, which loads ``dO`` for those rows anyway: three
launches per forward + backward instead of four.

Each loop runs in stages (jit helpers ``_fwd_tiles``, ``_dkdv_tiles``,
``_dq_tiles`` with constexpr mask flags): for causal attention the tiles wholly
below the diagonal without any mask and only the diagonal band with the
causal mask; the ragged tile at a sequence end that is not a multiple of the
block is masked against N in whichever stage reaches it.  See "Tile loops and
the causal stage split" below.

The backward uses two kernels (dQ, then dK/dV) rather than one fused kernel
with atomic adds on dQ: each output element is written by exactly one
program, so results are deterministic, no zero-initialised fp32 scratch buffer
is needed, and the price (P recomputed twice) is the same trade the Triton
tutorial and FlashAttention-2 make.  Unlike the tutorial's backward (which
bakes in the causal structure, and whose non-causal path is wrong), both
kernels here derive their loop bounds and masks from ``CAUSAL``, ``N_Q`` and
``N_K`` separately, so non-causal attention with ``Nq != Nk`` is correct.
Causal attention uses the top-left aligned mask (query ``i`` sees keys
``j <= i``) and requires ``Nq == Nk``.

Every load/store goes through explicit pointer arithmetic with the strides of
each tensor and, where a tile can cross the sequence end, boundary masks
(``tl.make_block_ptr`` is not used), so any
sequence length (1, 17, 200, ...) and any strided layout work.  Head dims are
16, 32, 64 or 128 (a tile spans the whole head dim, so no head-dim masking).

Devices
-------
On CUDA, block sizes are autotuned (``triton.autotune``) over a few configs
pruned per head dim and dtype.  Under Triton's interpreter
(``TRITON_INTERPRET=1``, which is how CPU tensors run) or with
``MEMOPT_FLASH_NO_AUTOTUNE=1``, fixed blocks are used.  Triton fixes
interpreter-vs-compiler when ``triton.language`` is first imported, so
TRITON_INTERPRET=1 must be set before triton is first imported; the kernels
are wrapped lazily (``_kernels``) in the mode triton is in, so the import order
of this module relative to triton does not matter.  Triton's interpreter
cannot compute bf16 ``tl.dot`` (it multiplies the raw bit patterns), so bf16 is
rejected under the interpreter and is GPU-only.  There is deliberately no
silent fallback to PyTorch SDPA: if the kernel cannot run, a clear error is
raised.

Numerics: fp16/bf16/fp32 inputs, fp32 accumulation everywhere.  For fp32
inputs the matmuls are asked for IEEE fp32 precision (``input_precision=
"ieee"``) rather than TF32, so fp32 results match an fp64 reference to ~1e-6.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import math
import os
import types
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from memopt.kernels import launch_cache

__all__ = [
    "flash_attn",
    "flash_attn_available",
    "SUPPORTED_HEAD_DIMS",
    "SUPPORTED_DTYPES",
]

SUPPORTED_HEAD_DIMS: tuple[int, ...] = (16, 32, 64, 128)
SUPPORTED_DTYPES: tuple[torch.dtype, ...] = (torch.float16, torch.bfloat16, torch.float32)

_LOG2E = 1.4426950408889634  # log2(e)

_NEEDS_CUDA_MSG = (
    "FlashAttention kernel needs CUDA, or TRITON_INTERPRET=1 to run Triton's "
    "interpreter on CPU (set TRITON_INTERPRET=1 in the environment before triton "
    "is first imported, or move the tensors to a CUDA device)"
)
_BF16_INTERPRETER_MSG = (
    "bf16 inputs are not supported under Triton's interpreter (TRITON_INTERPRET=1): "
    "the interpreter cannot compute bf16 tl.dot correctly (it multiplies the raw "
    "bit patterns); the bf16 path runs on CUDA only. Use fp16/fp32 here or a CUDA device."
)


# --------------------------------------------------------------------------
# Output allocation: every buffer a kernel writes (O, LSE, delta, dQ, dK, dV)
# is allocated here, so tests can monkeypatch this to return NaN-poisoned
# tensors and catch any element a kernel fails to write.
# --------------------------------------------------------------------------
def _is_fake(t: torch.Tensor) -> bool:
    """A fake tensor (``memopt.planner`` runs a step under ``FakeTensorMode``): shapes only, no data to launch on."""
    return type(t).__name__ == "FakeTensor"


def _alloc(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device=device)


# ==========================================================================
# Tile loops and the causal stage split.
#
# For causal attention a (query rows, key columns) tile pair is one of three
# kinds: *off-band* (every key <= every query row: nothing to mask), *diagonal*
# (the tile straddles the diagonal: a per-element causal mask) or *above*
# (every key > every row: never visited, by the loop bounds).  Each kernel
# walks its tiles in stages over contiguous ranges, calling one jit helper per
# stage with the masks as constexpr flags, so the compiled off-band loop has
# no compare/select at all and only the diagonal band (about one tile per
# program) pays for the mask.  The sequence end is a separate concern: when N
# is not a multiple of the tile, the last tile is ragged whether or not it is
# diagonal, so the stage that can reach it masks its loads against N
# (``END_MASK``) and, in the forward and dQ kernels, hides the zero-filled keys
# from the softmax (the non-causal end stage by that mask, the causal band by
# its causal mask, as Nq == Nk); the stages that cannot reach it load unmasked.
# (dK/dV needs no score mask at the end: zero-filled query rows add exactly 0.)
#
# Rows a program computes but never stores (queries past N_Q in the last query
# block, keys past N_K in the last key block) are fed zero-filled operands and
# may hold any value; each output row depends only on its own operand row
# (row-wise softmax, row-major matmuls), so they cannot leak into stored rows.
#
# They are plain functions here and wrapped for Triton lazily, together with
# the kernels, by ``_kernels(interpreted)`` (see there for why).
# ==========================================================================
def _fwd_tiles(
    acc, l_i, m_i, q, offs_m,
    k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
    lo, hi, N_K, qk_scale_log2,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL_MASK: tl.constexpr,
    END_MASK: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """One forward stage: online-softmax update of a query block over key tiles [lo, hi)."""
    offs_d = tl.arange(0, HEAD_DIM)
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k_ptrs = k_base + offs_n[:, None] * stride_kn + offs_d[None, :] * stride_kd
        v_ptrs = v_base + offs_n[:, None] * stride_vn + offs_d[None, :] * stride_vd
        if END_MASK:
            n_valid = offs_n < N_K
            k = tl.load(k_ptrs, mask=n_valid[:, None], other=0.0)
        else:
            k = tl.load(k_ptrs)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale_log2
        if CAUSAL_MASK:  # also hides keys past N_K from every stored row (Nq == Nk)
            s = tl.where(offs_n[None, :] <= offs_m[:, None], s, float("-inf"))
        elif END_MASK:
            s = tl.where(n_valid[None, :], s, float("-inf"))
        # Every stage sequence starts at the tile holding key 0, which every
        # row sees, so m_new is finite from the first tile on and no
        # (-inf) - (-inf) NaN arises in later, possibly all-masked, rows.
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if END_MASK:
            v = tl.load(v_ptrs, mask=n_valid[:, None], other=0.0)
        else:
            v = tl.load(v_ptrs)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, l_i, m_i


def _dkdv_tiles(
    dk, dv, k, v, offs_n,
    q_base, do_base, lse_base, delta_base,
    stride_qn, stride_qd, stride_don, stride_dod, stride_ln, stride_den,
    lo, hi, N_Q, qk_scale_log2,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    CAUSAL_MASK: tl.constexpr,
    END_MASK: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """One dK/dV stage: a key block's dK, dV accumulated over query tiles [lo, hi)."""
    offs_d = tl.arange(0, HEAD_DIM)
    for start_m in range(lo, hi, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        q_ptrs = q_base + offs_m[:, None] * stride_qn + offs_d[None, :] * stride_qd
        do_ptrs = do_base + offs_m[:, None] * stride_don + offs_d[None, :] * stride_dod
        if END_MASK:
            m_valid = offs_m < N_Q
            q = tl.load(q_ptrs, mask=m_valid[:, None], other=0.0)
            do = tl.load(do_ptrs, mask=m_valid[:, None], other=0.0)
            lse = tl.load(lse_base + offs_m * stride_ln, mask=m_valid, other=0.0)
            delta = tl.load(delta_base + offs_m * stride_den, mask=m_valid, other=0.0)
        else:
            q = tl.load(q_ptrs)
            do = tl.load(do_ptrs)
            lse = tl.load(lse_base + offs_m * stride_ln)
            delta = tl.load(delta_base + offs_m * stride_den)
        # Transposed probabilities P^T (BLOCK_N x BLOCK_M), recomputed from LSE.
        s_t = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION) * qk_scale_log2
        p_t = tl.exp2(s_t - lse[None, :] * 1.4426950408889634)
        # Query rows past N_Q need no mask here: their q, dO, LSE and delta load
        # as 0, so their p_t is exactly 1 and both dV += p_t dO and
        # dK += p_t (dP - delta) q add exactly 0.
        if CAUSAL_MASK:
            p_t = tl.where(offs_m[None, :] >= offs_n[:, None], p_t, 0.0)
        dv += tl.dot(p_t.to(do.dtype), do, input_precision=DOT_PRECISION)
        dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)
        ds_t = p_t * (dp_t - delta[None, :])
        dk += tl.dot(ds_t.to(q.dtype), q, input_precision=DOT_PRECISION)
    return dk, dv


def _dq_tiles(
    dq, q, do, lse_log2, delta, offs_m,
    k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
    lo, hi, N_K, qk_scale_log2,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL_MASK: tl.constexpr,
    END_MASK: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """One dQ stage: a query block's dQ accumulated over key tiles [lo, hi)."""
    offs_d = tl.arange(0, HEAD_DIM)
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k_ptrs = k_base + offs_n[:, None] * stride_kn + offs_d[None, :] * stride_kd
        v_ptrs = v_base + offs_n[:, None] * stride_vn + offs_d[None, :] * stride_vd
        if END_MASK:
            n_valid = offs_n < N_K
            k = tl.load(k_ptrs, mask=n_valid[:, None], other=0.0)
            v = tl.load(v_ptrs, mask=n_valid[:, None], other=0.0)
        else:
            k = tl.load(k_ptrs)
            v = tl.load(v_ptrs)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale_log2
        p = tl.exp2(s - lse_log2[:, None])
        # Keys past N_K load as 0, so their p = exp2(-LSE) overflows to inf when
        # LSE < -88 and inf * 0 would be NaN in dS K: they must be masked.
        if CAUSAL_MASK:  # also hides keys past N_K from every stored row (Nq == Nk)
            p = tl.where(offs_n[None, :] <= offs_m[:, None], p, 0.0)
        elif END_MASK:
            p = tl.where(n_valid[None, :], p, 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), k, input_precision=DOT_PRECISION)
    return dq


# ==========================================================================
# Kernels.  Each owns one block of rows and runs the stages over the other
# side's tiles; like the helpers they are wrapped lazily by ``_kernels``.
# ==========================================================================
def _flash_fwd_kernel(
    Q, K, V, O, LSE,
    stride_qb, stride_qh, stride_qn, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_ob, stride_oh, stride_on, stride_od,
    stride_lb, stride_lh, stride_ln,
    H, N_Q, N_K,
    qk_scale_log2,  # softmax_scale * log2(e)
    HEAD_DIM: tl.constexpr,
    CAUSAL: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    q_base = Q + b * stride_qb + h * stride_qh
    k_base = K + b * stride_kb + h * stride_kh
    v_base = V + b * stride_vb + h * stride_vh

    start_m = pid_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    m_valid = offs_m < N_Q

    q = tl.load(
        q_base + offs_m[:, None] * stride_qn + offs_d[None, :] * stride_qd,
        mask=m_valid[:, None], other=0.0,
    )
    # Online-softmax state, in the log2 domain, fp32.
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)

    if CAUSAL:
        # Off-band: key tiles ending before the block's first row (keys < start_m
        # < N_K).  Band: from there to the block's last row; keys beyond are masked.
        split = (start_m // BLOCK_N) * BLOCK_N
        hi = tl.minimum(start_m + BLOCK_M, N_K)
    else:
        # Whole key tiles, then the ragged last one (if any).
        split = (N_K // BLOCK_N) * BLOCK_N
        hi = N_K
    acc, l_i, m_i = _fwd_tiles(
        acc, l_i, m_i, q, offs_m, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
        0, split, N_K, qk_scale_log2,
        HEAD_DIM=HEAD_DIM, BLOCK_N=BLOCK_N, CAUSAL_MASK=False, END_MASK=False, DOT_PRECISION=DOT_PRECISION,
    )
    acc, l_i, m_i = _fwd_tiles(
        acc, l_i, m_i, q, offs_m, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
        split, hi, N_K, qk_scale_log2,
        HEAD_DIM=HEAD_DIM, BLOCK_N=BLOCK_N, CAUSAL_MASK=CAUSAL, END_MASK=True, DOT_PRECISION=DOT_PRECISION,
    )

    acc = acc / l_i[:, None]
    # Natural-log LSE: log(sum_j exp(scale * q.k_j)).
    lse = (m_i + tl.log2(l_i)) * 0.6931471805599453
    o_base = O + b * stride_ob + h * stride_oh
    tl.store(
        o_base + offs_m[:, None] * stride_on + offs_d[None, :] * stride_od,
        acc.to(O.dtype.element_ty), mask=m_valid[:, None],
    )
    tl.store(LSE + b * stride_lb + h * stride_lh + offs_m * stride_ln, lse, mask=m_valid)


def _flash_bwd_dkdv_kernel(
    Q, K, V, DO, LSE, DELTA, DK, DV,
    stride_qb, stride_qh, stride_qn, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_dob, stride_doh, stride_don, stride_dod,
    stride_lb, stride_lh, stride_ln,
    stride_deb, stride_deh, stride_den,
    stride_dkb, stride_dkh, stride_dkn, stride_dkd,
    stride_dvb, stride_dvh, stride_dvn, stride_dvd,
    H, N_Q, N_K,
    sm_scale,
    qk_scale_log2,
    HEAD_DIM: tl.constexpr,
    CAUSAL: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,  # query rows per inner step
    BLOCK_N: tl.constexpr,  # key rows owned by this program
):
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    q_base = Q + b * stride_qb + h * stride_qh
    do_base = DO + b * stride_dob + h * stride_doh
    lse_base = LSE + b * stride_lb + h * stride_lh
    delta_base = DELTA + b * stride_deb + h * stride_deh

    start_n = pid_n * BLOCK_N
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    n_valid = offs_n < N_K

    k = tl.load(
        K + b * stride_kb + h * stride_kh + offs_n[:, None] * stride_kn + offs_d[None, :] * stride_kd,
        mask=n_valid[:, None], other=0.0,
    )
    v = tl.load(
        V + b * stride_vb + h * stride_vh + offs_n[:, None] * stride_vn + offs_d[None, :] * stride_vd,
        mask=n_valid[:, None], other=0.0,
    )
    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)

    full_end = (N_Q // BLOCK_M) * BLOCK_M  # query tiles before this one are whole
    if CAUSAL:
        # Query tiles ending before start_n see none of these keys (skipped); the
        # band runs from the tile holding row start_n to the first tile starting
        # at or after the block's end, from where every row sees every key.
        lo = (start_n // BLOCK_M) * BLOCK_M
        split = tl.cdiv(start_n + BLOCK_N, BLOCK_M) * BLOCK_M
        dk, dv = _dkdv_tiles(
            dk, dv, k, v, offs_n, q_base, do_base, lse_base, delta_base,
            stride_qn, stride_qd, stride_don, stride_dod, stride_ln, stride_den,
            lo, tl.minimum(split, N_Q), N_Q, qk_scale_log2,
            HEAD_DIM=HEAD_DIM, BLOCK_M=BLOCK_M, CAUSAL_MASK=True, END_MASK=True, DOT_PRECISION=DOT_PRECISION,
        )
    else:
        split = 0
    # Off-band whole tiles, then the ragged last tile if the band did not take it.
    dk, dv = _dkdv_tiles(
        dk, dv, k, v, offs_n, q_base, do_base, lse_base, delta_base,
        stride_qn, stride_qd, stride_don, stride_dod, stride_ln, stride_den,
        split, full_end, N_Q, qk_scale_log2,
        HEAD_DIM=HEAD_DIM, BLOCK_M=BLOCK_M, CAUSAL_MASK=False, END_MASK=False, DOT_PRECISION=DOT_PRECISION,
    )
    dk, dv = _dkdv_tiles(
        dk, dv, k, v, offs_n, q_base, do_base, lse_base, delta_base,
        stride_qn, stride_qd, stride_don, stride_dod, stride_ln, stride_den,
        tl.maximum(split, full_end), N_Q, N_Q, qk_scale_log2,
        HEAD_DIM=HEAD_DIM, BLOCK_M=BLOCK_M, CAUSAL_MASK=False, END_MASK=True, DOT_PRECISION=DOT_PRECISION,
    )

    dk = dk * sm_scale
    tl.store(
        DK + b * stride_dkb + h * stride_dkh + offs_n[:, None] * stride_dkn + offs_d[None, :] * stride_dkd,
        dk.to(DK.dtype.element_ty), mask=n_valid[:, None],
    )
    tl.store(
        DV + b * stride_dvb + h * stride_dvh + offs_n[:, None] * stride_dvn + offs_d[None, :] * stride_dvd,
        dv.to(DV.dtype.element_ty), mask=n_valid[:, None],
    )


def _flash_bwd_dq_kernel(
    Q, K, V, O, DO, LSE, DELTA, DQ,
    stride_qb, stride_qh, stride_qn, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_ob, stride_oh, stride_on, stride_od,
    stride_dob, stride_doh, stride_don, stride_dod,
    stride_lb, stride_lh, stride_ln,
    stride_deb, stride_deh, stride_den,
    stride_dqb, stride_dqh, stride_dqn, stride_dqd,
    H, N_Q, N_K,
    sm_scale,
    qk_scale_log2,
    HEAD_DIM: tl.constexpr,
    CAUSAL: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,  # query rows owned by this program
    BLOCK_N: tl.constexpr,  # key rows per inner step
):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    k_base = K + b * stride_kb + h * stride_kh
    v_base = V + b * stride_vb + h * stride_vh

    start_m = pid_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    m_valid = offs_m < N_Q

    q = tl.load(
        Q + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qn + offs_d[None, :] * stride_qd,
        mask=m_valid[:, None], other=0.0,
    )
    do = tl.load(
        DO + b * stride_dob + h * stride_doh + offs_m[:, None] * stride_don + offs_d[None, :] * stride_dod,
        mask=m_valid[:, None], other=0.0,
    )
    lse = tl.load(LSE + b * stride_lb + h * stride_lh + offs_m * stride_ln, mask=m_valid, other=0.0)
    o = tl.load(
        O + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_on + offs_d[None, :] * stride_od,
        mask=m_valid[:, None], other=0.0,
    )
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)  # rows past N_Q: 0, never stored
    tl.store(DELTA + b * stride_deb + h * stride_deh + offs_m * stride_den, delta, mask=m_valid)  # for dK/dV
    lse_log2 = lse * 1.4426950408889634
    dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)

    # The forward pass's stages (see _flash_fwd_kernel).
    if CAUSAL:
        split = (start_m // BLOCK_N) * BLOCK_N
        hi = tl.minimum(start_m + BLOCK_M, N_K)
    else:
        split = (N_K // BLOCK_N) * BLOCK_N
        hi = N_K
    dq = _dq_tiles(
        dq, q, do, lse_log2, delta, offs_m, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
        0, split, N_K, qk_scale_log2,
        HEAD_DIM=HEAD_DIM, BLOCK_N=BLOCK_N, CAUSAL_MASK=False, END_MASK=False, DOT_PRECISION=DOT_PRECISION,
    )
    dq = _dq_tiles(
        dq, q, do, lse_log2, delta, offs_m, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
        split, hi, N_K, qk_scale_log2,
        HEAD_DIM=HEAD_DIM, BLOCK_N=BLOCK_N, CAUSAL_MASK=CAUSAL, END_MASK=True, DOT_PRECISION=DOT_PRECISION,
    )

    dq = dq * sm_scale
    tl.store(
        DQ + b * stride_dqb + h * stride_dqh + offs_m[:, None] * stride_dqn + offs_d[None, :] * stride_dqd,
        dq.to(DQ.dtype.element_ty), mask=m_valid[:, None],
    )


# ==========================================================================
# Block sizes: autotuned on CUDA, fixed under the interpreter / on request.
# ==========================================================================
def _prune_for_head_dim(configs, named_args, **kwargs):
    """Drop tiles that would not fit shared memory/registers for large head dims.

    The budget is in elements of a (BLOCK_M x BLOCK_N) score tile; it halves for
    D = 128 and again for fp32 inputs (twice the bytes per K/V/Q tile element).
    """
    head_dim = kwargs.get("HEAD_DIM", named_args.get("HEAD_DIM", 64))
    q = named_args.get("Q")
    elem = q.element_size() if hasattr(q, "element_size") else 2
    max_tile = 128 * 128 if head_dim <= 64 else 128 * 64
    if elem >= 4:
        max_tile //= 2
    kept = [c for c in configs if c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"] <= max_tile]
    return kept or [min(configs, key=lambda c: c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"])]


def _configs(shapes: list[tuple[int, int, int, int]]) -> list:
    return [
        triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=s)
        for bm, bn, w, s in shapes
    ]


# (BLOCK_M, BLOCK_N, num_warps, num_stages). The second row of each list (4 warps, deeper pipelines) was
# added after the first H100 measurement, where every case at N = 1024 was slower than SDPA's flash
# backend (experiments/flash_attn): fewer warps per tile leave more programs resident per SM when the
# grid is small.
_FWD_TUNE = [(128, 64, 8, 3), (128, 128, 8, 2), (64, 64, 4, 3), (64, 32, 4, 4), (128, 32, 4, 3),
             (128, 64, 4, 4), (64, 64, 4, 4), (64, 128, 4, 3)]
# For dK/dV: BLOCK_N = keys owned, BLOCK_M = query step.
_DKDV_TUNE = [(32, 128, 8, 2), (64, 128, 8, 2), (32, 64, 4, 3), (64, 64, 4, 2), (16, 64, 4, 3),
              (32, 128, 4, 3), (64, 64, 4, 4)]
# For dQ: BLOCK_M = queries owned, BLOCK_N = key step.
_DQ_TUNE = [(128, 32, 8, 2), (128, 64, 8, 2), (64, 32, 4, 3), (64, 64, 4, 2), (64, 16, 4, 3),
            (128, 64, 4, 3), (64, 64, 4, 4)]

_TUNE_KEY = ["N_Q", "N_K", "HEAD_DIM", "CAUSAL"]
_PRUNE = {"early_config_prune": _prune_for_head_dim}


def tuned_blocks() -> dict:
    """The autotuner's last choice per kernel (``BLOCK_M/BLOCK_N, warps, stages``), for the GPU check's
    record; empty where nothing was tuned (interpreter, fixed tiles)."""
    ks = _KERNEL_SETS.get(False)
    out = {}
    for name in ("fwd", "dkdv", "dq"):
        best = getattr(getattr(ks, f"{name}_tuned", None), "best_config", None) if ks else None
        if best is not None:
            out[name] = f"{best.kwargs.get('BLOCK_M')}x{best.kwargs.get('BLOCK_N')} w{best.num_warps} s{best.num_stages}"
    return out


@dataclass(frozen=True)
class _KernelSet:
    fwd: object
    dkdv: object
    dq: object
    fwd_tuned: object | None
    dkdv_tuned: object | None
    dq_tuned: object | None


_KERNEL_SETS: dict[bool, _KernelSet] = {}
_TILE_HELPERS = (_fwd_tiles, _dkdv_tiles, _dq_tiles)


def _rebind(fn, ns: dict):
    """A copy of ``fn`` (same code, so Triton reads the same source) whose globals are ``ns``."""
    out = types.FunctionType(fn.__code__, ns, fn.__name__, fn.__defaults__, fn.__closure__)
    out.__annotations__ = dict(fn.__annotations__)  # the tl.constexpr marks
    out.__qualname__, out.__module__, out.__doc__ = fn.__qualname__, fn.__module__, fn.__doc__
    return out


def _kernels(interpreted: bool) -> _KernelSet:
    """The Triton wrappers of the kernels, interpreted or compiled.

    A module-level ``@triton.jit`` would pick interpreter vs. compiler from
    TRITON_INTERPRET at *this* module's import, while ``triton.language``'s own
    jit helpers (``tl.zeros``, ``tl.max``, ``tl.sum``...) were fixed when
    *triton* was first imported; if the variable changed in between, the two
    disagree and kernels crash.  Wrapping lazily with the mode triton itself is
    in (``_triton_interpreted``) keeps them consistent whatever the import order.

    A kernel finds the tile helpers it calls by name in its globals, and both
    modes may be wrapped in one process (the block-choice test builds compiled
    wrappers under the interpreter), so each mode gets its own copy of this
    module's namespace in which the helper names are that mode's wrappers, and
    the kernels are rebound to it.
    """
    ks = _KERNEL_SETS.get(interpreted)
    if ks is not None:
        return ks
    if interpreted:
        from triton.runtime.interpreter import InterpretedFunction as wrap
    else:
        from triton.runtime.jit import JITFunction as wrap
    ns = dict(globals())
    for helper in _TILE_HELPERS:
        ns[helper.__name__] = wrap(_rebind(helper, ns))
    fwd, dkdv, dq = (wrap(_rebind(fn, ns)) for fn in (_flash_fwd_kernel, _flash_bwd_dkdv_kernel, _flash_bwd_dq_kernel))
    tuned = [None, None, None]
    if not interpreted:
        tuned = [
            triton.autotune(configs=_configs(cfgs), key=_TUNE_KEY, prune_configs_by=_PRUNE)(fn)
            for fn, cfgs in ((fwd, _FWD_TUNE), (dkdv, _DKDV_TUNE), (dq, _DQ_TUNE))
        ]
    ks = _KernelSet(fwd, dkdv, dq, *tuned)
    _KERNEL_SETS[interpreted] = ks
    return ks


@dataclass(frozen=True)
class _Blocks:
    fwd: tuple[int, int]  # (BLOCK_M, BLOCK_N)
    dkdv: tuple[int, int]  # (BLOCK_M query step, BLOCK_N keys owned)
    dq: tuple[int, int]  # (BLOCK_M queries owned, BLOCK_N key step)
    num_warps: int
    num_stages: int


def _fixed_blocks(head_dim: int, interpreted: bool, elem_size: int = 2) -> _Blocks:
    if interpreted:
        # Small, deliberately unequal tiles: they exercise masked tails, several
        # loop iterations and the causal loop bounds with BLOCK_M != BLOCK_N.
        return _Blocks(fwd=(32, 16), dkdv=(16, 32), dq=(32, 16), num_warps=4, num_stages=1)
    # Fixed GPU tiles (MEMOPT_FLASH_NO_AUTOTUNE=1), sized so the backward
    # kernels stay under ~64 KiB of shared memory (fits sm_80/86/89/90).
    if head_dim <= 64 and elem_size <= 2:
        return _Blocks(fwd=(64, 64), dkdv=(32, 64), dq=(64, 32), num_warps=4, num_stages=2)
    if head_dim <= 64 or elem_size <= 2:  # fp32 with D <= 64, or fp16/bf16 with D = 128
        return _Blocks(fwd=(64, 32), dkdv=(32, 64), dq=(64, 32), num_warps=4, num_stages=2)
    return _Blocks(fwd=(32, 32), dkdv=(16, 32), dq=(32, 16), num_warps=4, num_stages=2)


def _triton_interpreted() -> bool:
    """Whether triton.language was set up for the interpreter.

    Triton decides this once, from TRITON_INTERPRET when ``triton.language`` is
    first imported: its jit'd helpers are then InterpretedFunction objects.
    """
    return type(tl.zeros).__name__ == "InterpretedFunction"


def _kernels_interpreted() -> bool:
    """True when kernels launched now run under Triton's interpreter."""
    return _triton_interpreted()


def _interpret_env() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "yes", "on", "y")


def _use_autotune() -> bool:
    if _kernels_interpreted():
        return False
    return os.environ.get("MEMOPT_FLASH_NO_AUTOTUNE", "0").strip().lower() not in ("1", "true", "yes", "on", "y")


def _dot_precision(dtype: torch.dtype) -> str:
    # Ask for true fp32 matmuls for fp32 inputs (TF32 would lose ~3 digits);
    # the setting is irrelevant for fp16/bf16 operands.
    return "ieee" if dtype == torch.float32 else "tf32"


# ==========================================================================
# Availability and validation
# ==========================================================================
def flash_attn_available(device: torch.device | str) -> tuple[bool, str]:
    """Whether the FlashAttention kernel can run for tensors on ``device``.

    Returns ``(ok, reason)``; ``reason`` is empty when ``ok`` and otherwise
    explains what is missing.
    """
    device = torch.device(device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            return False, "FlashAttention kernel: CUDA device requested but torch.cuda.is_available() is False"
        return True, ""
    if device.type == "cpu":
        if not _interpret_env():
            return False, _NEEDS_CUDA_MSG
        if not _triton_interpreted():
            return False, (
                "TRITON_INTERPRET=1 is set now, but triton was first imported before it was set, so "
                "Triton is in compiled (GPU) mode for this process; set TRITON_INTERPRET=1 in the "
                "environment before triton (or memopt) is first imported"
            )
        return _interpreter_runs_tile_loops()
    return False, f"FlashAttention kernel does not support device type {device.type!r}. " + _NEEDS_CUDA_MSG


@triton.jit
def _loop_probe_kernel(Out, N):
    hi = tl.program_id(0) + N  # a loop bound computed from the program id, as the tile loops' are
    acc = 0
    for _ in range(0, hi, 1):
        acc += 1
    tl.store(Out, acc)


@functools.lru_cache(maxsize=1)
def _interpreter_runs_tile_loops() -> tuple[bool, str]:
    """Some Triton interpreters cannot loop to a bound computed in the kernel (Triton 3.6's with
    numpy 2.4: a one-element array is no longer an index); say so instead of failing mid-kernel. The probe
    runs on a real tensor outside any dispatch mode: the first call may come from the planner's fake step
    (under its fake mode and meta default device the probe's tensor had no storage, and the interpreter read
    that as "cannot run")."""
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes(), torch.device("cpu"):
        out = torch.zeros(1, dtype=torch.int32)
        try:
            _loop_probe_kernel[(1,)](out, 3)
        except Exception as e:  # noqa: BLE001 - any failure means the kernels cannot run here
            import numpy

            return False, (f"Triton {triton.__version__}'s interpreter cannot run the kernel's tile loops with numpy "
                           f"{numpy.__version__} ({type(e).__name__}: {str(e)[:120]}); use the project's pinned "
                           "triton, or run on a CUDA device")
        ran = int(out.item())
    if ran != 3:
        return False, f"Triton {triton.__version__}'s interpreter ran a 3-step loop {ran} times"
    return True, ""


def _validate(q, k, v, causal, softmax_scale) -> float:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"flash_attn: {name} must be a torch.Tensor, got {type(t).__name__}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.ndim != 4:
            raise ValueError(
                f"flash_attn: {name} must be 4-D (batch, heads, seq_len, head_dim), got shape {tuple(t.shape)}"
            )
    if q.dtype not in SUPPORTED_DTYPES:
        raise TypeError(
            f"flash_attn: unsupported dtype {q.dtype}; supported dtypes are "
            f"{', '.join(str(d) for d in SUPPORTED_DTYPES)}"
        )
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"flash_attn: q, k, v must share a dtype, got q={q.dtype}, k={k.dtype}, v={v.dtype}")
    if k.device != q.device or v.device != q.device:
        raise ValueError(
            f"flash_attn: q, k, v must be on the same device, got q={q.device}, k={k.device}, v={v.device}"
        )
    bq, hq, nq, dq = q.shape
    bk, hk, nk, dk = k.shape
    bv, hv, nv, dv = v.shape
    if not (bq == bk == bv):
        raise ValueError(f"flash_attn: batch sizes differ: q={bq}, k={bk}, v={bv}")
    if not (hq == hk == hv):
        raise ValueError(f"flash_attn: head counts differ: q={hq}, k={hk}, v={hv}")
    if not (dq == dk == dv):
        raise ValueError(f"flash_attn: head dims differ: q={dq}, k={dk}, v={dv}")
    if nk != nv:
        raise ValueError(f"flash_attn: k and v sequence lengths differ: k={nk}, v={nv}")
    if dq not in SUPPORTED_HEAD_DIMS:
        raise ValueError(
            f"flash_attn: unsupported head dim {dq}; supported head dims are {list(SUPPORTED_HEAD_DIMS)}"
        )
    if nq == 0 or nk == 0:
        raise ValueError(f"flash_attn: sequence lengths must be >= 1, got Nq={nq}, Nk={nk}")
    if causal and nq != nk:
        raise ValueError(
            f"flash_attn: causal attention requires Nq == Nk (top-left aligned mask), got Nq={nq}, Nk={nk}"
        )
    if softmax_scale is None:
        scale = 1.0 / math.sqrt(dq)
    else:
        scale = float(softmax_scale)
        if not math.isfinite(scale):
            raise ValueError(f"flash_attn: softmax_scale must be finite, got {softmax_scale}")
    ok, why = flash_attn_available(q.device)
    if not ok:
        raise RuntimeError(why)
    if q.dtype == torch.bfloat16 and _kernels_interpreted():
        raise RuntimeError(_BF16_INTERPRETER_MSG)
    return scale


# ==========================================================================
# Launchers
# ==========================================================================
def _cdiv(a: int, b: int) -> int:
    """``triton.cdiv`` in plain Python: that one is a jit function, and called from the host it goes through
    Triton's dispatch (~5 us a call, three a forward + backward)."""
    return -(-a // b)


def _s4(t: torch.Tensor) -> tuple[int, int, int, int]:
    return tuple(t.stride())  # type: ignore[return-value]


def _flash_forward(q, k, v, causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    B, H, Nq, D = q.shape
    Nk = k.shape[2]
    o = _alloc((B, H, Nq, D), q.dtype, q.device)
    lse = _alloc((B, H, Nq), torch.float32, q.device)
    if B * H == 0 or _is_fake(q):  # the planner's fake step: the bytes are these outputs, no kernel runs
        return o, lse
    args = (
        q, k, v, o, lse,
        *_s4(q), *_s4(k), *_s4(v), *_s4(o), *lse.stride(),
        H, Nq, Nk, scale * _LOG2E,
    )
    meta = dict(HEAD_DIM=D, CAUSAL=bool(causal), DOT_PRECISION=_dot_precision(q.dtype))
    ks = _kernels(_kernels_interpreted())
    with _launches(_kernels_interpreted()):
        if _use_autotune():
            grid = lambda m: (_cdiv(Nq, m["BLOCK_M"]), B * H)  # noqa: E731
            _launch_tuned(ks.fwd_tuned, ks.fwd, grid, args, meta, ("fwd", Nq, Nk, D, bool(causal), q.dtype, q.device))
        else:
            blk = _fixed_blocks(D, _kernels_interpreted(), q.element_size())
            bm, bn = blk.fwd
            _launch_fixed(ks.fwd, (_cdiv(Nq, bm), B * H), args, meta, bm, bn, blk)
    return o, lse


_TUNED: dict[tuple, dict] = {}  # (kernel, N_Q, N_K, HEAD_DIM, CAUSAL, dtype, device) -> the autotuner's choice


def _launch_tuned(tuned, plain, grid, args: tuple, meta: dict, key: tuple) -> None:
    """An autotuned launch the first time for ``key``; afterwards the plain kernel with the autotuner's
    choice (the same compiled binary). Why: Triton's ``Autotuner.run`` rebuilds dicts of every argument
    (~40 here) on each call, and at N = 1024 the host's launches, not the GPU, bound a forward + backward
    (on an H100 the kernels took 0.26 ms of GPU time, SDPA's 0.41, but the call 0.75 ms of host time:
    experiments/flash_attn/README.md)."""
    kw = _TUNED.get(key)
    if kw is None:
        tuned[grid](*args, **meta)
        best = tuned.best_config
        _TUNED[key] = {**best.kwargs, "num_warps": best.num_warps, "num_stages": best.num_stages}
        return
    blocks = {name: kw[name] for name in ("BLOCK_M", "BLOCK_N")}
    launch_cache.launch(plain, grid(kw), args, {**meta, **blocks},
                        {"num_warps": kw["num_warps"], "num_stages": kw["num_stages"]})


@contextlib.contextmanager
def _launches(interpreted: bool):
    """Around a pass's kernel launches. Triton's interpreter copies a launch's arguments into a dict
    that its recursive ``_to_cpu`` closure keeps in a reference cycle, so every argument's storage
    lives until Python's cyclic collector next runs (a 2-layer run still held the last backward's
    ``do``, ``dq`` and ``delta`` at its optimizer step: 66,560 B of ``temp``); a compiled launch holds
    nothing. So an interpreted pass collects that cycle when it returns, and a CPU run holds what a GPU
    run holds (which the planner plans). The objects older than the pass are frozen during the
    collection, so it scans the pass's own objects only (a full collection took 0.18 s in a test process)."""
    if not interpreted:
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.collect()
        gc.unfreeze()


def _launch_fixed(kernel, grid: tuple, args: tuple, meta: dict, bm: int, bn: int, blk: _Blocks) -> None:
    """A launch with fixed tiles: the interpreter's through Triton, a compiled one through the launch cache."""
    if _kernels_interpreted():
        kernel[grid](*args, **meta, BLOCK_M=bm, BLOCK_N=bn)
        return
    launch_cache.launch(kernel, grid, args, {**meta, "BLOCK_M": bm, "BLOCK_N": bn},
                        {"num_warps": blk.num_warps, "num_stages": blk.num_stages})


def _flash_backward(do, q, k, v, o, lse, causal: bool, scale: float):
    B, H, Nq, D = q.shape
    Nk = k.shape[2]
    dq = _alloc((B, H, Nq, D), q.dtype, q.device)
    dk = _alloc((B, H, Nk, D), k.dtype, k.device)
    dv = _alloc((B, H, Nk, D), v.dtype, v.device)
    delta = _alloc((B, H, Nq), torch.float32, q.device)
    if B * H == 0 or _is_fake(q):
        return dq, dk, dv
    interpreted = _kernels_interpreted()
    ks = _kernels(interpreted)
    blk = _fixed_blocks(D, interpreted, q.element_size())

    meta = dict(HEAD_DIM=D, CAUSAL=bool(causal), DOT_PRECISION=_dot_precision(q.dtype))
    qkv = (*_s4(q), *_s4(k), *_s4(v))
    rows = (*_s4(do), *lse.stride(), *delta.stride())
    # dQ first: it writes delta (rowsum(dO * O)), which the dK/dV kernel reads (same stream, in order)
    dq_args = (q, k, v, o, do, lse, delta, dq, *qkv, *_s4(o), *rows, *_s4(dq), H, Nq, Nk, scale, scale * _LOG2E)
    dkdv_args = (q, k, v, do, lse, delta, dk, dv, *qkv, *rows, *_s4(dk), *_s4(dv), H, Nq, Nk, scale, scale * _LOG2E)
    with _launches(interpreted):
        if _use_autotune():
            key = (Nq, Nk, D, bool(causal), q.dtype, q.device)
            _launch_tuned(ks.dq_tuned, ks.dq, lambda m: (_cdiv(Nq, m["BLOCK_M"]), B * H), dq_args, meta, ("dq", *key))
            _launch_tuned(ks.dkdv_tuned, ks.dkdv, lambda m: (_cdiv(Nk, m["BLOCK_N"]), B * H), dkdv_args, meta,
                          ("dkdv", *key))
        else:
            bm, bn = blk.dq
            _launch_fixed(ks.dq, (_cdiv(Nq, bm), B * H), dq_args, meta, bm, bn, blk)
            bm, bn = blk.dkdv
            _launch_fixed(ks.dkdv, (_cdiv(Nk, bn), B * H), dkdv_args, meta, bm, bn, blk)
    return dq, dk, dv


class _FlashAttnFunction(torch.autograd.Function):
    """Saves only q, k, v, O and LSE (O(N) bytes) for backward."""

    @staticmethod
    def forward(ctx, q, k, v, causal: bool, scale: float):
        o, lse = _flash_forward(q, k, v, causal, scale)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.causal = causal
        ctx.scale = scale
        return o

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        do = do.contiguous()
        dq, dk, dv = _flash_backward(do, q, k, v, o, lse, ctx.causal, ctx.scale)
        return dq, dk, dv, None, None


def flash_attn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = True,
    softmax_scale: float | None = None,
) -> torch.Tensor:
    """Exact attention ``softmax(q k^T * scale + mask) v`` with O(N) saved memory.

    Args:
        q: (B, H, Nq, D) queries.
        k, v: (B, H, Nk, D) keys and values (same dtype and device as ``q``).
        causal: top-left aligned causal mask (query i sees keys j <= i);
            requires ``Nq == Nk``.
        softmax_scale: defaults to ``1 / sqrt(D)``.

    Returns:
        (B, H, Nq, D) tensor in ``q``'s dtype.  Differentiable w.r.t. q, k, v.

    Supported: D in (16, 32, 64, 128); fp16, bf16 (CUDA only), fp32 with fp32
    accumulation; any sequence lengths >= 1; arbitrary strides.  Runs on CUDA,
    or on CPU tensors under Triton's interpreter (``TRITON_INTERPRET=1`` set
    before import).  Raises ``TypeError``/``ValueError``/``RuntimeError`` on
    invalid input or when the kernel cannot run; never falls back silently.

    Memory: autograd saves q, k, v, the output and an fp32 log-sum-exp per
    query row -- O(N * D) bytes -- instead of the O(N^2) probability matrix
    kept by naive attention.
    """
    causal = bool(causal)
    scale = _validate(q, k, v, causal, softmax_scale)
    return _FlashAttnFunction.apply(q, k, v, causal, scale)
