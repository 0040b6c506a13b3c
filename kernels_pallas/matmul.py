"""Batch-invariant matmul: one fixed tile program for every row count.

`tiled_matmul(x, w)` computes x [M, K] @ w [K, N] with a Pallas (Triton) kernel whose
program owns one BLOCK_M x block_n output tile and walks K in block_k steps, first to last,
accumulating in fp32. Nothing about the program depends on M: the rows are zero-padded to a
multiple of BLOCK_M, there is no split-K, and the tile sizes are functions of (K, N) alone,
so a token row gets the same bits whether it is one of 3 decode rows or of 4,096 packed
training rows. That is the property XLA:GPU's own dots lack (their autotuner and cuBLAS
pick another kernel, tiling or split-K per M: 1,023 of 1,024 log-probs differed on the
H200, benchmarks/results/gpu-check-h200-2026-12-04.txt); the sampler and the trainer both
route their weight matmuls here on a GPU (`models.dense`).

fp32 inputs use IEEE fp32 products (no TF32: its 10-bit mantissa is ~1e-3 relative), bf16
inputs bf16 MMA; both accumulate in fp32. Only the forward's bits are part of the contract:
the backward pass is two XLA dots (dx = g w^T, dw = x^T g).

backend: "pallas" (compiled, GPU) or "interpret" (the same kernel in Pallas interpret mode:
CPU tests of the program; slow).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

BLOCK_M = 64  # rows per program: every row count is padded up to a multiple of it
MAX_BLOCK_N = 128
MAX_BLOCK_K = 64  # bf16; fp32 (IEEE products, more registers per element) takes half
MIN_BLOCK = 16  # the smallest MMA extent
NUM_WARPS = 4


def _largest_block(n: int, cap: int) -> int:
    """The largest power of two <= cap dividing n, or cap when none >= MIN_BLOCK does
    (n is then zero-padded to a multiple of cap)."""
    block = cap
    while block >= MIN_BLOCK:
        if n % block == 0:
            return block
        block //= 2
    return cap


def tile_sizes(k: int, n: int, dtype) -> tuple[int, int]:
    """(block_k, block_n) for a [*, k] @ [k, n] product: functions of the weight's shape and
    dtype only, never of the row count."""
    cap_k = MAX_BLOCK_K if jnp.dtype(dtype).itemsize < 4 else MAX_BLOCK_K // 2
    return _largest_block(k, cap_k), _largest_block(n, MAX_BLOCK_N)


def _kernel(x_ref, w_ref, o_ref, *, block_k: int, steps: int, w_rows_out: bool, precision):
    # x_ref [BLOCK_M, Kp]; w_ref [Kp, BN] (or [BN, Kp] when w_rows_out); o_ref [BLOCK_M, BN]
    def step(i, acc):
        cols = pl.ds(pl.multiple_of(i * block_k, block_k), block_k)
        w = w_ref[:, cols] if w_rows_out else w_ref[cols, :]
        part = jax.lax.dot_general(x_ref[:, cols], w, (((1,), (1 if w_rows_out else 0,)),
                                                       ((), ())),
                                   precision=precision, preferred_element_type=jnp.float32)
        return acc + part

    acc = jax.lax.fori_loop(0, steps, step, jnp.zeros(o_ref.shape, jnp.float32))
    o_ref[...] = acc.astype(o_ref.dtype)


def _forward(x, w, w_rows_out: bool, backend: str, columns: int | None):
    """x [M, K], w [K, N] (or [N, K] when w_rows_out; same float dtype) -> f32 [M, N] by the
    fixed tile program (of the [K, columns] product when w is a slice of its columns)."""
    m, k = x.shape
    n = w.shape[0] if w_rows_out else w.shape[1]
    block_k, block_n = tile_sizes(k, columns or n, x.dtype)
    kp, np_ = -(-k // block_k) * block_k, -(-n // block_n) * block_n
    mp = -(-m // BLOCK_M) * BLOCK_M
    x = jnp.pad(x, ((0, mp - m), (0, kp - k)))
    if (kp, np_) != (k, n):  # zero rows / columns of w add exact zeros / are dropped
        w = jnp.pad(w, ((0, np_ - n), (0, kp - k)) if w_rows_out else ((0, kp - k), (0, np_ - n)))
    precision = jax.lax.Precision.HIGHEST if x.dtype == jnp.float32 else None
    kernel = functools.partial(_kernel, block_k=block_k, steps=kp // block_k,
                               w_rows_out=w_rows_out, precision=precision)
    w_spec = (pl.BlockSpec((block_n, kp), lambda i, j: (j, 0)) if w_rows_out
              else pl.BlockSpec((kp, block_n), lambda i, j: (0, j)))
    out = pl.pallas_call(
        kernel,
        grid=(mp // BLOCK_M, np_ // block_n),
        in_specs=[pl.BlockSpec((BLOCK_M, kp), lambda i, j: (i, 0)), w_spec],
        out_specs=pl.BlockSpec((BLOCK_M, block_n), lambda i, j: (i, j)),
        out_shape=jax.ShapeDtypeStruct((mp, np_), jnp.float32),
        interpret=backend == "interpret",
        compiler_params=plgpu.CompilerParams(num_warps=NUM_WARPS, num_stages=2),
        name="tiled_matmul",
    )(x, w)
    return out[:m, :n]


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _tiled(x, w, w_rows_out, backend, columns):
    return _forward(x, w, w_rows_out, backend, columns)


def _tiled_fwd(x, w, w_rows_out, backend, columns):
    return _forward(x, w, w_rows_out, backend, columns), (x, w)


def _tiled_bwd(w_rows_out, backend, columns, residuals, g):
    """g f32 [M, N] -> (dx [M, K], dw like w): plain XLA dots (only forward bits matter)."""
    x, w = residuals
    w32 = w.astype(jnp.float32)
    dx = (g @ w32 if w_rows_out else g @ w32.T).astype(x.dtype)
    dw = x.astype(jnp.float32).T @ g
    return dx, (dw.T if w_rows_out else dw).astype(w.dtype)


_tiled.defvjp(_tiled_fwd, _tiled_bwd)


def tiled_matmul(x, w, *, w_rows_out: bool = False, backend: str = "pallas",
                 columns: int | None = None):
    """x [M, K] @ w [K, N] (w [N, K] when w_rows_out) -> f32 [M, N], every row computed by
    the same tile program whatever M (see the module doc). Differentiable in x and w.

    columns: when w is a slice of the columns of a [K, columns] weight (a tensor-parallel
    shard), the tiles are the full product's (the slice zero-padded to whole tiles), so each
    column gets the bits the full product gives it: an element's program depends on the
    tile shape, not on where in the weight its column sits."""
    if backend not in ("pallas", "interpret"):
        raise ValueError(f"backend must be 'pallas' or 'interpret', got {backend!r}")
    if x.ndim != 2 or w.ndim != 2:
        raise ValueError(f"x and w must be 2-D, got shapes {x.shape} and {w.shape}")
    if x.shape[1] != w.shape[1 if w_rows_out else 0]:
        raise ValueError(f"x [M, {x.shape[1]}] does not contract with w {w.shape}")
    n = w.shape[0] if w_rows_out else w.shape[1]
    if columns is not None and columns < n:
        raise ValueError(f"columns={columns} is fewer than w's {n} output columns")
    if x.dtype != w.dtype:
        w = w.astype(x.dtype)
    return _tiled(x, w, w_rows_out, backend, columns)
