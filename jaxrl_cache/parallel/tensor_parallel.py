"""The model's paged forwards run per tensor-parallel shard under `shard_map`.

Each shard holds its query heads, their kv heads (its slice of the KV pool), and its slice
of the FFN (see mesh.rollout_rules). It runs the model's own `prefill_forward` /
`decode_forward` with a per-shard config (n_heads / tensor heads), so the attention kernels
(Pallas or xla) see only local heads and pages. The two row-parallel matmuls (wo, w_down)
end in a psum over the tensor axis: the weight shard is wrapped in `RowParallel`, which
`models.llama.dense` turns into Megatron's row-parallel linear, so the model code runs
unchanged per shard.
Tokens, positions, page tables and logits are replicated; so is everything the engine does
around the forward (sampling, the decode loop's bookkeeping).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P

from jaxrl_cache.models import ModelConfig, init_kv_cache
from jaxrl_cache.parallel.mesh import (TENSOR, axis_size, kv_cache_shardings, kv_layout,
                                       leaf_name, rollout_rules, tree_shardings)

_ROW_PARALLEL = ("wo", "w_down")
_KV_COLUMNS = ("wk", "wv", "bk", "bv")


@jax.tree_util.register_pytree_node_class
class RowParallel:
    """A row-parallel weight shard w [..., in / tensor, out]: models.llama.dense(x, shard)
    = reduce(the local partial product) = its psum over the tensor axis (x holds the
    matching input slice)."""

    def __init__(self, w):
        self.w = w

    def reduce(self, partial):
        return jax.lax.psum(partial, TENSOR)

    def tree_flatten(self):
        return (self.w,), None

    @classmethod
    def tree_unflatten(cls, _, children):
        return cls(*children)


def engine_kv_cache(config: ModelConfig, num_pages: int, page_size: int, mesh: Mesh):
    """A zero KV pool laid out for `mesh`: kv-head dim (-3) has max(Hkv, tensor) slots (see
    mesh.kv_layout), sharded over the tensor axis. Same pytree as `init_kv_cache`."""
    tensor = axis_size(mesh, TENSOR)
    local, copies = kv_layout(config, tensor)
    wide = dataclasses.replace(config, n_kv_heads=config.n_kv_heads * copies)
    shapes = jax.eval_shape(lambda: init_kv_cache(wide, num_pages, page_size))
    shardings = kv_cache_shardings(shapes, rollout_rules(config, tensor), mesh)
    return jax.tree.map(lambda s, sh: jnp.zeros(s.shape, s.dtype, device=sh), shapes, shardings)


def rollout_shardings(params, config: ModelConfig, mesh: Mesh):
    """NamedShardings of `params` (arrays or shapes) in the engine's tensor-parallel layout."""
    return tree_shardings(params, rollout_rules(config, axis_size(mesh, TENSOR)), mesh)


def _local_params(params, config: ModelConfig, copies: int):
    """Inside shard_map: wrap row-parallel weights; with copied kv heads, slice this shard's
    head out of the replicated wk/wv/bk/bv."""
    head = jax.lax.axis_index(TENSOR) // copies
    d = config.head_dim

    def local(path, x):
        name = leaf_name(path)
        if name in _ROW_PARALLEL:
            return RowParallel(x)
        if name in _KV_COLUMNS and copies > 1:
            return jax.lax.dynamic_slice_in_dim(x, head * d, d, axis=x.ndim - 1)
        return x

    return jax.tree_util.tree_map_with_path(local, params)


def shard_forward(forward: Callable, mesh: Mesh) -> Callable:
    """`forward` (models.prefill_forward or decode_forward) run tensor-parallel on `mesh`.

    The result has forward's signature, (params, config, kv_cache, *arrays, backend=...), and
    returns (logits [..., V] replicated, kv_cache' sharded). params must be laid out by
    `rollout_shardings` and the pool by `engine_kv_cache`; every other array is replicated.
    Call it inside jit (the engine's prefill / decode loop); the mesh is a static property of
    the returned function.
    """
    tensor = axis_size(mesh, TENSOR)

    @functools.wraps(forward)
    def sharded(params, config: ModelConfig, kv_cache, *arrays, **static):
        local_heads, copies = kv_layout(config, tensor)
        local_config = dataclasses.replace(config, n_heads=config.n_heads // tensor,
                                           n_kv_heads=local_heads, d_ff=config.d_ff // tensor)
        rules = rollout_rules(config, tensor)
        param_specs = jax.tree.map(lambda s: s.spec, tree_shardings(params, rules, mesh))
        kv_specs = jax.tree.map(lambda s: s.spec, kv_cache_shardings(kv_cache, rules, mesh))

        def body(params, kv_cache, *arrays):
            return forward(_local_params(params, config, copies), local_config, kv_cache,
                           *arrays, **static)

        # check_vma=False: pallas_call has no replication rule; the logits are replicated by
        # construction (replicated embed/head, psum'd residual stream).
        return jax.shard_map(body, mesh=mesh, in_specs=(param_specs, kv_specs) +
                             (P(),) * len(arrays), out_specs=(P(), kv_specs),
                             check_vma=False)(params, kv_cache, *arrays)

    return sharded
