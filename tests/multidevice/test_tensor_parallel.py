"""Tensor-parallel paged forwards equal the single-device model: greedy tokens identical,
logits within 1e-5 (fp32) on XLA's dots and bit for bit under the batch-invariant kernels,
the KV pool holding the same K/V per (copied) kv head."""
import dataclasses
import functools

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jaxrl_cache.models import (ModelConfig, decode_forward, init_kv_cache, init_params,
                                prefill_forward)
from jaxrl_cache.models.sharding import kv_layout
from jaxrl_cache.parallel import (engine_kv_cache, make_mesh, rollout_shardings,
                                  shard_forward)
from jaxrl_cache.models.llama import dense
from jaxrl_cache.parallel.tensor_parallel import ColumnShard
from kernels_pallas import KERNELS_ENV
from tests.multidevice import common

CONFIG = common.CONFIG


@functools.cache
def forwards(mesh, backend):
    """Jitted (prefill, decode) over (params, kv_cache, *arrays); single-device when mesh is
    None (cached: the reference compiles once per backend)."""
    wrap = (lambda f: f) if mesh is None else (lambda f: shard_forward(f, mesh))
    return tuple(jax.jit(lambda p, kv, *a, f=f: wrap(f)(p, CONFIG, kv, *a, backend=backend))
                 for f in (prefill_forward, decode_forward))


@pytest.mark.parametrize("tensor", [2, 8])
def test_sharded_greedy_matches_single_device(tensor):
    """On XLA's dots (the kernels' path, bit for bit, is tested below)."""
    backend, steps = "xla", 4
    params = common.params()
    ref_tokens, ref_logits, ref_kv = common.greedy(
        *forwards(None, backend), params,
        init_kv_cache(CONFIG, common.NUM_PAGES, common.PAGE_SIZE), steps)

    mesh = make_mesh({"tensor": tensor}, jax.devices()[:tensor])
    sharded = jax.device_put(params, rollout_shardings(params, CONFIG, mesh))
    kv = engine_kv_cache(CONFIG, common.NUM_PAGES, common.PAGE_SIZE, mesh)
    tokens, logits, kv = common.greedy(*forwards(mesh, backend), sharded, kv, steps)

    np.testing.assert_array_equal(tokens, ref_tokens)
    np.testing.assert_allclose(logits, ref_logits, atol=1e-5, rtol=0)
    _, copies = kv_layout(CONFIG, tensor)
    for got, want in zip(jax.tree.leaves(kv), jax.tree.leaves(ref_kv)):
        assert got.shape[-3] == CONFIG.n_kv_heads * copies
        assert got.sharding.shard_shape(got.shape)[-3] == got.shape[-3] // tensor
        np.testing.assert_allclose(np.asarray(got), np.repeat(np.asarray(want), copies, axis=-3),
                                   atol=1e-5, rtol=0)


def test_gathered_columns_through_scan_over_stacked_layers():
    """Stacked layers ([L, ...] leaves, lax.scan over them) keep the wrapper: each layer's
    dense(x, w) on a gathered column shard is the full product, as with per-layer dicts."""
    mesh = make_mesh({"tensor": 4}, jax.devices()[:4])
    w = jax.random.normal(jax.random.key(0), (3, 16, 16))  # [L, in, out]
    x = jax.random.normal(jax.random.key(1), (2, 16))

    def body(w, x):  # w [L, in, out/4]: this shard's columns, x [2, in/4]: its input slice
        def layer(h, w_l):
            return h, dense(x, w_l)
        return jax.lax.scan(layer, 0.0, ColumnShard(w, 16, gathered=True))[1]

    got = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(None, None, "tensor"),
                                                            P(None, "tensor")),
                                out_specs=P(), check_vma=False))(w, x)
    np.testing.assert_allclose(got, np.einsum("bi,lio->lbo", x, w), atol=1e-5, rtol=1e-5)


# head_dim 16: the kernels' smallest (CONFIG's 8 is below it); 2 kv heads, so tensor 4 and 8
# copy them (each shard slices its head out of the replicated wk / wv).
KERNEL_CONFIG = ModelConfig.tiny(vocab_size=32, n_layers=2, d_model=64, n_heads=8,
                                 n_kv_heads=2, head_dim=16, d_ff=128)


# bf16 with every bias, q/k norms and an untied head; d_model 192 and d_ff 384 cut the
# matmul's 64- and 128-wide tiles mid-tile at tensor 4
BF16_CONFIG = dataclasses.replace(
    KERNEL_CONFIG, d_model=192, d_ff=384, dtype="bfloat16", qkv_bias=True, out_bias=True,
    qk_norm=True, tie_embeddings=False)


@pytest.mark.parametrize("config,tensors", [(KERNEL_CONFIG, (2, 4, 8)), (BF16_CONFIG, (4,))],
                         ids=["fp32", "bf16-biases-untied"])
def test_sharded_forwards_are_bit_exact_under_the_invariant_kernels(config, tensors,
                                                                    monkeypatch):
    """Under JAXRL_CACHE_KERNELS every shard's columns are tiled as the whole weight's and
    no partial sums are reduced, so the tensor-parallel prefill and decode give the single
    device's logits and K/V bit for bit, at every tensor size (copied kv heads included).
    On XLA's dots the same layout differs in the last bits (the calibrated case)."""
    monkeypatch.setenv(KERNELS_ENV, "interpret")
    params = jax.tree.map(  # random biases and norms too: none of them may be dropped
        lambda x: x * 8.0 if x.ndim >= 2 else x + 0.1 * jax.random.normal(
            jax.random.key(x.size), x.shape, x.dtype),
        init_params(config, jax.random.key(0)))

    def run(mesh):
        wrap = (lambda f: f) if mesh is None else (lambda f: shard_forward(f, mesh))
        fs = [jax.jit(lambda p, kv, *a, f=f: wrap(f)(p, config, kv, *a, backend="interpret"))
              for f in (prefill_forward, decode_forward)]
        if mesh is None:
            p, kv = params, init_kv_cache(config, common.NUM_PAGES, common.PAGE_SIZE)
        else:
            p = jax.device_put(params, rollout_shardings(params, config, mesh))
            kv = engine_kv_cache(config, common.NUM_PAGES, common.PAGE_SIZE, mesh)
        return common.greedy(*fs, p, kv, 2)

    ref_tokens, ref_logits, ref_kv = run(None)
    for tensor in tensors:
        tokens, logits, kv = run(make_mesh({"tensor": tensor}, jax.devices()[:tensor]))
        np.testing.assert_array_equal(tokens, ref_tokens)
        np.testing.assert_array_equal(logits, ref_logits)
        _, copies = kv_layout(config, tensor)
        for got, want in zip(jax.tree.leaves(kv), jax.tree.leaves(ref_kv)):
            np.testing.assert_array_equal(np.asarray(got),
                                          np.repeat(np.asarray(want), copies, axis=-3))
