"""Batch-invariant matmul: one fixed tile program for every row count.

`tiled_matmul(x, w)` computes x [M, K] @ w.T for a weight w [N, K] (stored [out, in], as
every weight of the model is) with a Pallas (Triton) kernel whose
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
the backward pass is two XLA dots (dx = g w, dw = g^T x).

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
    """(block_k, block_n) for a [*, k] product with a weight [n, k]: functions of the weight's
    shape and dtype only, never of the row count."""
    cap_k = MAX_BLOCK_K if jnp.dtype(dtype).itemsize < 4 else MAX_BLOCK_K // 2
    return _largest_block(k, cap_k), _largest_block(n, MAX_BLOCK_N)


def _kernel(x_ref, w_ref, o_ref, *, block_k: int, steps: int, precision):
    # x_ref [BLOCK_M, Kp]; w_ref [BN, Kp]; o_ref [BLOCK_M, BN]
    def step(i, acc):
        cols = pl.ds(pl.multiple_of(i * block_k, block_k), block_k)
        part = jax.lax.dot_general(x_ref[:, cols], w_ref[:, cols], (((1,), (1,)), ((), ())),
                                   precision=precision, preferred_element_type=jnp.float32)
        return acc + part

    acc = jax.lax.fori_loop(0, steps, step, jnp.zeros(o_ref.shape, jnp.float32))
    o_ref[...] = acc.astype(o_ref.dtype)


def _forward(x, w, backend: str, columns: int | None):
    """x [M, K], w [N, K] (same float dtype) -> f32 [M, N] by the fixed tile program (of the
    [columns, K] weight's product when w is a slice of its output rows)."""
    m, k = x.shape
    n = w.shape[0]
    block_k, block_n = tile_sizes(k, columns or n, x.dtype)
    kp, np_ = -(-k // block_k) * block_k, -(-n // block_n) * block_n
    mp = -(-m // BLOCK_M) * BLOCK_M
    x = jnp.pad(x, ((0, mp - m), (0, kp - k)))
    if (kp, np_) != (k, n):  # zero rows / columns of w add exact zeros / are dropped
        w = jnp.pad(w, ((0, np_ - n), (0, kp - k)))
    precision = jax.lax.Precision.HIGHEST if x.dtype == jnp.float32 else None
    kernel = functools.partial(_kernel, block_k=block_k, steps=kp // block_k,
                               precision=precision)
    w_spec = pl.BlockSpec((block_n, kp), lambda i, j: (j, 0))
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


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _tiled(x, w, backend, columns):
    return _forward(x, w, backend, columns)


def _tiled_fwd(x, w, backend, columns):
    return _forward(x, w, backend, columns), (x, w)


def _tiled_bwd(backend, columns, residuals, g):
    """g f32 [M, N] -> (dx [M, K], dw [N, K]): plain XLA dots (only forward bits matter)."""
    x, w = residuals
    dx = (g @ w.astype(jnp.float32)).astype(x.dtype)
    dw = g.T @ x.astype(jnp.float32)
    return dx, dw.astype(w.dtype)


_tiled.defvjp(_tiled_fwd, _tiled_bwd)


def tiled_matmul(x, w, *, backend: str = "pallas", columns: int | None = None):
    """x [M, K] against w [N, K] -> x @ w.T f32 [M, N], every row computed by the same tile
    program whatever M (see the module doc). Differentiable in x and w.

    columns: when w is a slice of the output rows of a [columns, K] weight (a
    tensor-parallel shard), the tiles are the full product's (the slice zero-padded to whole
    tiles), so each output column gets the bits the full product gives it: an element's
    program depends on the tile shape, not on where in the weight its row sits."""
    if backend not in ("pallas", "interpret"):
        raise ValueError(f"backend must be 'pallas' or 'interpret', got {backend!r}")
    if x.ndim != 2 or w.ndim != 2:
        raise ValueError(f"x and w must be 2-D, got shapes {x.shape} and {w.shape}")
    if x.shape[1] != w.shape[1]:
        raise ValueError(f"x [M, {x.shape[1]}] does not contract with w [N, K] {w.shape}")
    if columns is not None and columns < w.shape[0]:
        raise ValueError(f"columns={columns} is fewer than w's {w.shape[0]} output rows")
    if x.dtype != w.dtype:
        w = w.astype(x.dtype)
    return _tiled(x, w, backend, columns)
