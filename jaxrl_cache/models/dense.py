"""Batch-invariant projections: a token row's x @ w.T gives the same bits however many rows
share the call, so the sampler (a few decode rows) and the trainer (thousands of packed
rows) agree bit for bit.

Every weight is stored [out, in] (Hugging Face's Linear layout) and the dot contracts its
last axis. XLA:CPU picks its dot kernel by shape, and for few rows it may pick one that
reduces in another order. In this layout, fp32, every SmolLM2 projection gives a row the
same bits from 2 rows up as among 256 (the [in, out] layout needed 33 at K = 576: a 16-row
decode then paid for 33 rows); bf16 from 4. So the bound is measured, once per (K, N,
dtype) on the backend in use (`invariant_rows`), and smaller calls are zero-padded up to
it. tests/test_numerics.py pins the measured facts.

XLA:GPU's dots have no such bound (their kernel, tiling and split-K change with the row
count), so there the projections can run on `kernels_pallas.matmul.tiled_matmul`, one fixed
tile program for every row count, the trainer's attention on the sampler's own prefill
kernel (`models.llama`) and the log-softmax normaliser on `kernels_pallas.log_sum_exp`:
JAXRL_CACHE_KERNELS=pallas (`kernels_pallas.invariant_kernels`).
Not the default yet: no GPU has confirmed the bits (benchmarks/gpu_check.py measures them).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_cache.spmd import per_batch_shard
from kernels_pallas import invariant_kernels
from kernels_pallas.blocked import pad_rows
from kernels_pallas.matmul import tiled_matmul

PROBE_ROWS = (1, 2, 4, 8, 16, 24, 32, 33, 36, 40, 48, 56, 64, 80, 96, 128)  # counts tried
REFERENCE_ROWS = 256
FALLBACK_ROWS = 128  # when no probed count agrees (a backend without the property)


def _dot(x, w):  # x [M, K], w [N, K] -> f32 [M, N]
    return jax.lax.dot_general(x, w, (((1,), (1,)), ((), ())),
                               preferred_element_type=jnp.float32)


@functools.lru_cache(maxsize=None)
def invariant_rows(k: int, n: int, dtype: str) -> int:
    """Smallest probed row count r such that every probed count >= r gives each row the
    bits it gets among REFERENCE_ROWS rows, for x [rows, k] against w [n, k] in `dtype` on
    the default backend. Measured eagerly, once per process."""
    rng = np.random.default_rng(0)
    with jax.ensure_compile_time_eval(), jax.transfer_guard("allow"):  # a one-off probe
        x = jnp.asarray(rng.standard_normal((REFERENCE_ROWS, k)), dtype)
        w = jnp.asarray(rng.standard_normal((n, k)), dtype)
        dot = jax.jit(_dot)
        ref = np.asarray(dot(x, w))
        agrees = [np.array_equal(np.asarray(dot(x[:r], w)), ref[:r]) for r in PROBE_ROWS]
    bound = FALLBACK_ROWS
    for r, ok in zip(reversed(PROBE_ROWS), reversed(agrees)):
        if not ok:
            break
        bound = r
    return bound


def dense(x, w, out_dtype=None, *, columns: int | None = None):
    """x [..., K] against w [N, K] (a weight stored [out, in]) -> x @ w.T [..., N],
    batch-invariant (see the module doc).

    Accumulates in fp32; out_dtype: the result's dtype (default x's). w may be a
    tensor-parallel shard (`parallel.tensor_parallel.ColumnShard`: it runs its own product
    through this function, with `columns` the full weight's N so the kernels tile the slice
    as they tile the whole weight; XLA's dots ignore it).
    """
    if hasattr(w, "shard_product"):
        return w.shard_product(x, functools.partial(dense, out_dtype=out_dtype))
    lead = x.shape[:-1]
    rows = x.reshape(-1, x.shape[-1])
    kernels = invariant_kernels()
    if kernels is not None:  # per batch shard under a training mesh (a custom call)
        out = per_batch_shard(
            lambda r: tiled_matmul(r, w, backend=kernels, columns=columns), rows)
        return out.reshape(*lead, out.shape[-1]).astype(out_dtype or x.dtype)
    if rows.shape[0] < FALLBACK_ROWS:
        minimum = invariant_rows(rows.shape[1], w.shape[0], jnp.dtype(x.dtype).name)
        rows_in = pad_rows(rows, 0, minimum)
    else:
        rows_in = rows
    out = _dot(rows_in, w)
    return out[:rows.shape[0]].reshape(*lead, out.shape[-1]).astype(out_dtype or x.dtype)
