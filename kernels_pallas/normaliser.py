"""Batch-invariant log-sum-exp over the vocabulary: one fixed program for every row count.

`log_sum_exp(x)` is the log-softmax normaliser of every recorded and recomputed log-prob
(`rollout.sampling.log_normaliser`) under JAXRL_CACHE_KERNELS. Written in jnp, the
normaliser is a max reduction, a broadcast subtraction, exp and a sum: XLA:GPU may compile
that diamond as one of its own Triton normalization fusions in one program and as loop
fusions in another (its choice depends on the shapes around it: the sampler's [rows, V] vs
the trainer's [rows, chunk, V]), and the two use different exp code. Here one Pallas
program owns BLOCK_ROWS rows (zero-padded) and walks the vocabulary in BLOCK_V columns
twice, first to last: the row max (exact in any order), then the sum of exp(x - max) block
by block, each block reduced by the same row reduction. Nothing depends on the row count,
so a row's bits are the same among 3 decode rows or 4,096 training positions.

The backward pass is XLA's softmax (only forward bits are part of the contract).
backend: "pallas" (compiled, GPU) or "interpret" (CPU tests of the program).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

BLOCK_ROWS = 16  # rows per program: every row count is padded up to a multiple of it
BLOCK_V = 512  # vocabulary columns per step (padded with -inf: exp gives exact zeros)
NUM_WARPS = 4


def _kernel(x_ref, o_ref, *, steps: int):
    # x_ref f32 [BLOCK_ROWS, steps * BLOCK_V]; o_ref f32 [BLOCK_ROWS]
    def block(i):
        return x_ref[:, pl.ds(pl.multiple_of(i * BLOCK_V, BLOCK_V), BLOCK_V)]

    top = jax.lax.fori_loop(0, steps, lambda i, m: jnp.maximum(m, block(i).max(axis=1)),
                            jnp.full(o_ref.shape, -jnp.inf, jnp.float32))
    top = jnp.where((top > -jnp.inf) & (top < jnp.inf), top, 0.0)  # isfinite: no finite max
    total = jax.lax.fori_loop(
        0, steps, lambda i, s: s + jnp.sum(jnp.exp(block(i) - top[:, None]), axis=1),
        jnp.zeros(o_ref.shape, jnp.float32))
    o_ref[...] = top + jnp.log(total)


def _forward(x, backend: str):
    """x f32 [M, V] -> f32 [M] by the fixed program."""
    m, v = x.shape
    mp, vp = -(-m // BLOCK_ROWS) * BLOCK_ROWS, -(-v // BLOCK_V) * BLOCK_V
    x = jnp.pad(x, ((0, mp - m), (0, 0)))
    x = jnp.pad(x, ((0, 0), (0, vp - v)), constant_values=-jnp.inf)
    out = pl.pallas_call(
        functools.partial(_kernel, steps=vp // BLOCK_V),
        grid=(mp // BLOCK_ROWS,),
        in_specs=[pl.BlockSpec((BLOCK_ROWS, vp), lambda i: (i, 0))],
        out_specs=pl.BlockSpec((BLOCK_ROWS,), lambda i: (i,)),
        out_shape=jax.ShapeDtypeStruct((mp,), jnp.float32),
        interpret=backend == "interpret",
        compiler_params=plgpu.CompilerParams(num_warps=NUM_WARPS, num_stages=2),
        name="log_sum_exp",
    )(x)
    return out[:m]


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _lse(x, backend):
    return _forward(x, backend)


def _lse_fwd(x, backend):
    out = _forward(x, backend)
    return out, (x, out)


def _lse_bwd(backend, residuals, g):
    """g f32 [M] -> dx f32 [M, V] = g * softmax(x); excluded (-inf) entries get 0, also in
    a row with nothing left (whose softmax is undefined)."""
    x, out = residuals
    return (jnp.where(x > -jnp.inf, g[:, None] * jnp.exp(x - out[:, None]), 0.0),)


_lse.defvjp(_lse_fwd, _lse_bwd)


def log_sum_exp(x, *, backend: str = "pallas"):
    """x f32 [..., V] (-inf = excluded) -> log sum exp over V, f32 [...], every row by the
    same program whatever the leading shape (see the module doc). A row with no finite
    entry gives -inf. Differentiable."""
    if backend not in ("pallas", "interpret"):
        raise ValueError(f"backend must be 'pallas' or 'interpret', got {backend!r}")
    if x.ndim < 1 or x.shape[-1] == 0:
        raise ValueError(f"x must be [..., V] with V > 0, got shape {x.shape}")
    lead = x.shape[:-1]
    rows = x.reshape(-1, x.shape[-1]).astype(jnp.float32)
    if rows.shape[0] == 0:
        return jnp.zeros(lead, jnp.float32)
    return _lse(rows, backend).reshape(lead)
