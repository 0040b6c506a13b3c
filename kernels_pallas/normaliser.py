"""Batch-invariant log-sum-exp over the vocabulary: one fixed program for every row count.

`log_sum_exp(x)` is the log-softmax normaliser of every recorded and recomputed log-prob
(`distribution.log_normaliser`) under JAXRL_CACHE_KERNELS. Written in jnp, the
normaliser is a max reduction, a broadcast subtraction, exp and a sum: XLA:GPU may compile
that diamond as one of its own Triton normalization fusions in one program and as loop
fusions in another (its choice depends on the shapes around it: the sampler's [rows, V] vs
the trainer's [rows, chunk, V]), and the two use different exp code. Here a Pallas program
owns BLOCK_ROWS rows (zero-padded) of one vocabulary chunk (`chunk_size`: up to CHUNK_V
columns, a function of V alone) and walks it in BLOCK_V columns, first to last: one pass for the row max, whose max over the chunks is
exact in any order, and a second for the sum of exp(x - max), each block reduced by the
same row reduction; the chunks' sums are added by a fixed halving tree. Nothing depends on
the row count, so a row's bits are the same among 3 decode rows or 4,096 training
positions, and a decode step's few rows still spread over V / chunk programs each.

The backward pass is XLA's softmax (only forward bits are part of the contract).
backend: "pallas" (compiled, GPU) or "interpret" (CPU tests of the program).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from kernels_pallas.blocked import tree_sum

BLOCK_ROWS = 16  # rows per program: every row count is padded up to a multiple of it
BLOCK_V = 512  # vocabulary columns per step
CHUNK_V = 4096  # vocabulary columns per program at most (padded with -inf: exact zeros)
NUM_WARPS = 4


def chunk_size(vocab: int) -> int:
    """Vocabulary columns per program: a function of the vocabulary alone (a power of two,
    BLOCK_V <= chunk <= CHUNK_V), never of the row count."""
    chunk = BLOCK_V
    while chunk < min(vocab, CHUNK_V):
        chunk *= 2
    return chunk


def _chunk_max(x_ref, o_ref, *, block: int):
    # x_ref f32 [BLOCK_ROWS, chunk] -> o_ref f32 [BLOCK_ROWS]: the chunk's row max
    def step(i, m):
        return jnp.maximum(m, x_ref[:, pl.ds(pl.multiple_of(i * block, block),
                                             block)].max(axis=1))

    o_ref[...] = jax.lax.fori_loop(0, x_ref.shape[1] // block, step,
                                   jnp.full(o_ref.shape, -jnp.inf, jnp.float32))


def _chunk_sum(x_ref, top_ref, o_ref, *, block: int):
    # x_ref f32 [BLOCK_ROWS, chunk], top_ref f32 [BLOCK_ROWS] -> o_ref f32 [BLOCK_ROWS]:
    # the chunk's sum of exp(x - top), its `block`-column blocks chained first to last
    top = top_ref[...]

    def step(i, s):
        part = x_ref[:, pl.ds(pl.multiple_of(i * block, block), block)]
        return s + jnp.sum(jnp.exp(part - top[:, None]), axis=1)

    o_ref[...] = jax.lax.fori_loop(0, x_ref.shape[1] // block, step,
                                   jnp.zeros(o_ref.shape, jnp.float32))


def _per_chunk(kernel, name: str, backend: str, chunk: int, x, *extra):
    """kernel over a (row tile, vocabulary chunk) grid: x f32 [Mp, Vp], extra f32 [Mp]
    each -> f32 [Vp / chunk, Mp], one value per row and chunk."""
    mp, vp = x.shape
    return pl.pallas_call(
        functools.partial(kernel, block=min(BLOCK_V, chunk)),
        grid=(mp // BLOCK_ROWS, vp // chunk),
        in_specs=[pl.BlockSpec((BLOCK_ROWS, chunk), lambda i, j: (i, j))]
        + [pl.BlockSpec((BLOCK_ROWS,), lambda i, j: (i,)) for _ in extra],
        out_specs=pl.BlockSpec((None, BLOCK_ROWS), lambda i, j: (j, i)),
        out_shape=jax.ShapeDtypeStruct((vp // chunk, mp), jnp.float32),
        interpret=backend == "interpret",
        compiler_params=plgpu.CompilerParams(num_warps=NUM_WARPS, num_stages=2),
        name=name,
    )(x, *extra)


def _forward(x, backend: str):
    """x f32 [M, V] -> f32 [M]: per (row tile, chunk) the max, their max (exact in any
    order), per (row tile, chunk) the sum of exp(x - max), the chunks' sums added by the
    halving tree (`blocked.tree_sum`), then max + log(sum)."""
    m, v = x.shape
    chunk = chunk_size(v)
    mp, vp = -(-m // BLOCK_ROWS) * BLOCK_ROWS, -(-v // chunk) * chunk
    x = jnp.pad(x, ((0, mp - m), (0, 0)))
    x = jnp.pad(x, ((0, 0), (0, vp - v)), constant_values=-jnp.inf)
    top = jnp.max(_per_chunk(_chunk_max, "log_sum_exp_max", backend, chunk, x), axis=0)
    top = jnp.where(jnp.isfinite(top), top, 0.0)  # a row with no finite entry
    partial = _per_chunk(_chunk_sum, "log_sum_exp", backend, chunk, x, top)  # [chunks, Mp]
    return (top + jnp.log(tree_sum(partial.T, -1)))[:m]


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
