"""The xla (CPU) paths of the paged kernels at the demo's GRPO shape, for regressions."""
import jax
import jax.numpy as jnp
import numpy as np

from kernels_pallas import paged_decode_attention, paged_prefill_attention

ROWS, HQ, HKV, D, PAGE, CONTEXT = 64, 4, 2, 16, 16, 288  # 8 prompts x 8 samples, 256 + 32
WIDTH = 32  # pages per row (power-of-two bucket of 18)


def _pool(rng, pages):
    shape = (pages, HKV, PAGE, D)
    return (jnp.asarray(rng.standard_normal(shape), jnp.float32),
            jnp.asarray(rng.standard_normal(shape), jnp.float32))


def test_decode_xla(benchmark):
    rng = np.random.default_rng(0)
    k, v = _pool(rng, ROWS * WIDTH + 1)
    table = jnp.asarray(1 + rng.permutation(ROWS * WIDTH).reshape(ROWS, WIDTH), jnp.int32)
    lens = jnp.full((ROWS,), CONTEXT, jnp.int32)
    q = jnp.asarray(rng.standard_normal((ROWS, HQ, D)), jnp.float32)
    fn = lambda: jax.block_until_ready(  # noqa: E731
        paged_decode_attention(q, k, v, table, lens, backend="xla"))
    fn()
    benchmark(fn)
    moved = 2 * ROWS * CONTEXT * HKV * D * 4  # K and V bytes read
    benchmark.extra_info["GB_per_s"] = moved / benchmark.stats.stats.mean / 1e9


def test_prefill_xla(benchmark):
    rng = np.random.default_rng(1)
    seqs, q_len = 8, 256
    k, v = _pool(rng, seqs * WIDTH + 1)
    table = jnp.asarray(1 + rng.permutation(seqs * WIDTH).reshape(seqs, WIDTH), jnp.int32)
    cu = jnp.asarray(np.arange(seqs + 1) * q_len, jnp.int32)
    kv_lens = jnp.full((seqs,), q_len, jnp.int32)
    q = jnp.asarray(rng.standard_normal((seqs * q_len, HQ, D)), jnp.float32)
    fn = lambda: jax.block_until_ready(  # noqa: E731
        paged_prefill_attention(q, k, v, table, cu, kv_lens, backend="xla"))
    fn()
    benchmark(fn)
    flops = 4 * seqs * HQ * D * q_len * (q_len + 1) / 2  # causal QK^T + PV
    benchmark.extra_info["GFLOP_per_s"] = flops / benchmark.stats.stats.mean / 1e9
