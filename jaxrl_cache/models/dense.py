"""Batch-invariant projections: a token row's x @ w gives the same bits however many rows
share the call, so the sampler (a few decode rows) and the trainer (thousands of packed
rows) agree bit for bit.

XLA:CPU picks its dot kernel by shape and by CPU, and for few rows it picks one that reduces
in another order: at [rows, 576] x [576, 1536] on one AVX-512 Xeon every row count up to 32
gives a row other bits than the same row among 256, from 33 on they agree (64 on an AVX2
EPYC). So the bound is measured, once per (K, N, dtype, layout) on the machine and backend
in use (`invariant_rows`), and smaller calls are zero-padded up to it.
tests/test_numerics.py checks each measured bound right and tight on the CPU it runs on.

The sampler's few rows need not pay that padding where the CPU allows: on the AVX-512 Xeon
a dot over the weight stored [out, in] gives every row, from 2 rows on, the very bits the
[in, out] dot gives it among 256 (`rows_out_rows` measures that cross-layout bound). So the
rollout engine holds a projection both ways (`Transposed`, `models.llama.sampler_layout`)
where that bound is below the [in, out] one (`transpose_pays`, measured), and a call of
fewer rows than the [in, out] bound runs on the transpose, padded only to the next probed
row count (16 decode rows stay 16 where [in, out] pads them to 33); larger calls (prefill,
wide decodes) and the trainer keep [in, out], which is faster there.

XLA:GPU's dots have no such bound (their kernel, tiling and split-K change with the row
count), so there the projections can run on `kernels_pallas.matmul.tiled_matmul`, one fixed
tile program for every row count, the trainer's attention on the sampler's own prefill
kernel (`models.llama`) and the log-softmax normaliser on `kernels_pallas.log_sum_exp`:
JAXRL_CACHE_KERNELS=pallas (`kernels_pallas.invariant_kernels`).
Not the default yet: no GPU has confirmed the bits (benchmarks/gpu_check.py measures them).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_cache.spmd import batch_axes, per_batch_shard
from kernels_pallas import invariant_kernels
from kernels_pallas.blocked import pad_rows
from kernels_pallas.matmul import tiled_matmul

PROBE_ROWS = (1, 2, 4, 8, 16, 24, 32, 33, 36, 40, 48, 56, 64, 80, 96, 128)  # counts tried
REFERENCE_ROWS = 256
FALLBACK_ROWS = 128  # when no probed count agrees (a backend without the property)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Transposed:
    """A projection weight held both ways: `dense` runs a call of fewer rows than the
    [in, out] bound on `t` (padded only to the next probed row count, same bits:
    `rows_out_rows`), any other on `w`."""
    w: jax.Array  # [..., K, N] (the weight itself)
    t: jax.Array  # [..., N, K] its transpose, a separate buffer


def _dot(x, w, w_rows_out: bool):
    if x.dtype == w.dtype == jnp.bfloat16 and not batch_axes():
        return _bf16_dot(x, w, w_rows_out)
    return _plain_dot(x, w, w_rows_out)


def _plain_dot(x, w, w_rows_out: bool):
    return jax.lax.dot_general(x, w, (((1,), (1 if w_rows_out else 0,)), ((), ())),
                               preferred_element_type=jnp.float32)


def _row_major_t(a):  # a [R, C] -> a.T [C, R], written out row-major
    return jax.lax.optimization_barrier(a.T.reshape(-1)).reshape(a.shape[1], a.shape[0])


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _bf16_dot(x, w, w_rows_out: bool):
    """_plain_dot of bf16 operands (same forward bits), whose backward runs its two dots
    in bf16 on operands written out row-major: XLA:CPU's fast bf16 dot (YNNPACK, AMX where
    the CPU has it) takes only [M, K] x [K, N]; a dot with a transposed operand (autodiff's
    form) is upcast to fp32 and runs at a third to a quarter of the speed. Single device
    only (`dense` falls back under a batch mesh, where the flattening would gather)."""
    return _plain_dot(x, w, w_rows_out)


def _bf16_fwd(x, w, w_rows_out):
    return _plain_dot(x, w, w_rows_out), (x, w)


def _bf16_bwd(w_rows_out, residuals, g):  # g f32 [M, N]
    x, w = residuals
    g = g.astype(jnp.bfloat16)
    if w_rows_out:  # out = x @ w.T, w [N, K]
        dx, dw = _plain_dot(g, w, False), _plain_dot(_row_major_t(g), x, False)
    else:
        dx, dw = _plain_dot(g, _row_major_t(w), False), _plain_dot(_row_major_t(x), g, False)
    return dx.astype(x.dtype), dw.astype(w.dtype)


_bf16_dot.defvjp(_bf16_fwd, _bf16_bwd)


def _row_bound(k: int, n: int, dtype: str, w_rows_out: bool, transposed: bool) -> int | None:
    """Smallest probed row count r such that every probed count >= r gives each row the
    bits it gets among REFERENCE_ROWS rows of a [rows, k] x [k, n] dot (w [n, k] when
    w_rows_out) in `dtype` on the default backend; FALLBACK_ROWS when the largest probe
    disagrees. transposed: the probes run on w's transpose, in the other layout; None when
    that disagrees even at REFERENCE_ROWS. Measured eagerly."""
    rng = np.random.default_rng(0)
    with jax.ensure_compile_time_eval(), jax.transfer_guard("allow"):  # a one-off probe
        x = jnp.asarray(rng.standard_normal((REFERENCE_ROWS, k)), dtype)
        w = jnp.asarray(rng.standard_normal((n, k) if w_rows_out else (k, n)), dtype)
        dot = jax.jit(_dot, static_argnums=2)
        ref = np.asarray(dot(x, w, w_rows_out))
        probe, probe_rows_out = w, w_rows_out
        if transposed:  # a separate row-major buffer, as the engine holds it
            probe = jnp.asarray(np.ascontiguousarray(np.asarray(w).T))
            probe_rows_out = not w_rows_out
        agrees = [np.array_equal(np.asarray(dot(x[:r], probe, probe_rows_out)), ref[:r])
                  for r in PROBE_ROWS + (REFERENCE_ROWS,)]
    if not agrees[-1]:
        return None
    bound = FALLBACK_ROWS
    for r, ok in zip(reversed(PROBE_ROWS), reversed(agrees[:-1])):
        if not ok:
            break
        bound = r
    return bound


@functools.lru_cache(maxsize=None)
def invariant_rows(k: int, n: int, dtype: str, w_rows_out: bool) -> int:
    """`_row_bound` of the dot as laid out (once per process): calls of fewer rows are
    padded to it."""
    return _row_bound(k, n, dtype, w_rows_out, transposed=False)


@functools.lru_cache(maxsize=None)
def rows_out_rows(k: int, n: int, dtype: str) -> int | None:
    """`_row_bound` of a [k, n] weight's dot run on its [n, k] transpose against the [k, n]
    dot's bits (once per process); None when the layouts never agree."""
    return _row_bound(k, n, dtype, False, transposed=True)


def transpose_pays(k: int, n: int, dtype: str) -> bool:
    """Whether a [k, n] weight is worth a `Transposed` copy: XLA's dots (not
    `invariant_kernels`) with a cross-layout bound below the [in, out] one."""
    if invariant_kernels() is not None:
        return False
    bound = rows_out_rows(k, n, dtype)
    return bound is not None and bound < min(invariant_rows(k, n, dtype, False), FALLBACK_ROWS)


def dense(x, w, out_dtype=None, *, w_rows_out: bool = False, columns: int | None = None):
    """x [..., K] @ w [K, N] -> [..., N], batch-invariant (see the module doc).

    w [N, K] when w_rows_out: a tied LM head contracts the embedding's last axis in the dot
    itself (a transposed copy was laid out one way in one program and another way in the
    next, and gave other bits). Accumulates in fp32; out_dtype: the result's dtype
    (default x's). w may be a tensor-parallel shard (`parallel.tensor_parallel.ColumnShard`:
    it runs its own product through this function, with `columns` the full weight's N so
    the kernels tile the slice as they tile the whole weight; XLA's dots ignore it).
    """
    if hasattr(w, "shard_product"):
        return w.shard_product(x, functools.partial(dense, out_dtype=out_dtype,
                                                    w_rows_out=w_rows_out))
    lead = x.shape[:-1]
    rows = x.reshape(-1, x.shape[-1])
    if isinstance(w, Transposed):
        k, n = w.w.shape
        dtype = jnp.dtype(x.dtype).name
        if not transpose_pays(k, n, dtype) or \
                rows.shape[0] >= min(invariant_rows(k, n, dtype, False), FALLBACK_ROWS):
            w = w.w
        else:  # padded to a probed count: those are the ones measured
            least = max(rows.shape[0], rows_out_rows(k, n, dtype))
            out = _dot(pad_rows(rows, 0, min(r for r in PROBE_ROWS if r >= least)), w.t, True)
            return out[:rows.shape[0]].reshape(*lead, n).astype(out_dtype or x.dtype)
    kernels = invariant_kernels()
    if kernels is not None:  # per batch shard under a training mesh (a custom call)
        out = per_batch_shard(lambda r: tiled_matmul(r, w, w_rows_out=w_rows_out,
                                                     backend=kernels, columns=columns), rows)
        return out.reshape(*lead, out.shape[-1]).astype(out_dtype or x.dtype)
    if rows.shape[0] < FALLBACK_ROWS:
        n = w.shape[0] if w_rows_out else w.shape[1]
        minimum = invariant_rows(rows.shape[1], n, jnp.dtype(x.dtype).name, w_rows_out)
        rows_in = pad_rows(rows, 0, minimum)
    else:
        rows_in = rows
    out = _dot(rows_in, w, w_rows_out)
    return out[:rows.shape[0]].reshape(*lead, out.shape[-1]).astype(out_dtype or x.dtype)
