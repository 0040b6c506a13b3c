"""Tensor-parallel paged forwards equal the single-device model: greedy tokens identical,
logits within 1e-5 (fp32), the KV pool holding the same K/V per (copied) kv head."""
import functools

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jaxrl_cache.models import decode_forward, init_kv_cache, prefill_forward
from jaxrl_cache.parallel import (engine_kv_cache, kv_layout, make_mesh, rollout_shardings,
                                  shard_forward)
from jaxrl_cache.models.llama import dense
from jaxrl_cache.parallel.tensor_parallel import RowParallel
from tests.multidevice import common

CONFIG = common.CONFIG


@functools.cache
def forwards(mesh, backend):
    """Jitted (prefill, decode) over (params, kv_cache, *arrays); single-device when mesh is
    None (cached: the reference compiles once per backend)."""
    wrap = (lambda f: f) if mesh is None else (lambda f: shard_forward(f, mesh))
    return tuple(jax.jit(lambda p, kv, *a, f=f: wrap(f)(p, CONFIG, kv, *a, backend=backend))
                 for f in (prefill_forward, decode_forward))


@pytest.mark.parametrize("tensor,backend", [
    (2, "xla"), (8, "xla"), pytest.param(4, "interpret", marks=pytest.mark.slow)])
def test_sharded_greedy_matches_single_device(tensor, backend):
    steps = 4 if backend == "xla" else 1
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


def test_row_parallel_through_scan_over_stacked_layers():
    """Stacked layers ([L, ...] leaves, lax.scan over them) keep the wrapper: each layer's
    dense(x, w) is the full product, as with per-layer dicts."""
    mesh = make_mesh({"tensor": 4}, jax.devices()[:4])
    w = jax.random.normal(jax.random.key(0), (3, 16, 16))  # [L, in, out]
    x = jax.random.normal(jax.random.key(1), (2, 16))

    def body(w, x):  # w [L, in/4, out], x [2, in/4]: this shard's input slice
        def layer(h, w_l):
            return h, dense(x, w_l)
        return jax.lax.scan(layer, 0.0, RowParallel(w))[1]

    got = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(None, "tensor", None),
                                                            P(None, "tensor")),
                                out_specs=P(), check_vma=False))(w, x)
    np.testing.assert_allclose(got, np.einsum("bi,lio->lbo", x, w), atol=1e-5, rtol=1e-5)
