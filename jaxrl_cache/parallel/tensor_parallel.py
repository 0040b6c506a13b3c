"""The model's paged forwards run per tensor-parallel shard under `shard_map`.

Each shard holds its query heads, their kv heads (its slice of the KV pool), and its slice
of the FFN (its family's `rollout_rules`, `models.sharding`). It runs the family decoder's
own `prefill_forward` / `decode_forward` with a per-shard config (n_heads / tensor heads), so
the attention kernels (Pallas or xla) see only local heads and pages.

Every weight matrix is split by its output columns, and each shard computes whole output
columns (no partial sums): wq/wk/wv/w_gate/w_up as Megatron's column-parallel linears; wo
and w_down first all-gather their input (the heads' outputs, the FFN's hidden), compute
their own columns of d_model, and all-gather those. Megatron instead splits wo / w_down by
input rows and psums the partial products, which adds each element's K terms in another
order than one device's dot. Here every element is one full-length dot, and under the
batch-invariant kernels (JAXRL_CACHE_KERNELS) each shard tiles its slice as the full weight
is tiled, so a mesh engine computes the trainer's bits. The weight shards are wrapped in
`ColumnShard`, whose product `models.dense` runs, so the model code runs unchanged per shard.
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

from jaxrl_cache.models import ModelConfig
from jaxrl_cache.models.families import family_of
from jaxrl_cache.models.sharding import kv_layout
from jaxrl_cache.parallel.mesh import (TENSOR, axis_size, kv_cache_shardings, leaf_name,
                                       tree_shardings)

_COLUMN_PARALLEL = ("wq", "wk", "wv", "w_gate", "w_up")
_GATHERED = ("wo", "w_down")  # input and output all-gathered around the local columns
_KV_COLUMNS = ("wk", "wv", "bk", "bv")


@jax.tree_util.register_pytree_node_class
class ColumnShard:
    """A slice w [..., K, n] of the output columns of a weight [..., K, columns].

    `models.dense(x, shard)` = x @ w, computed with the tiles of the whole [K, columns]
    product (`columns`), so each column has the bits one device's product gives it. When
    `gathered` (wo, w_down), x [..., K / tensor] is this shard's slice of the input: it is
    all-gathered over the tensor axis first, and the [..., n] result after (-> [..., columns]).
    """

    def __init__(self, w, columns: int, gathered: bool = False):
        self.w, self.columns, self.gathered = w, columns, gathered

    def shard_product(self, x, dense: Callable):
        if self.gathered:
            x = jax.lax.all_gather(x, TENSOR, axis=x.ndim - 1, tiled=True)
        y = dense(x, self.w, columns=self.columns)
        if self.gathered:
            y = jax.lax.all_gather(y, TENSOR, axis=y.ndim - 1, tiled=True)
        return y

    def tree_flatten(self):
        return (self.w,), (self.columns, self.gathered)

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(*children, *aux)


def engine_kv_cache(config: ModelConfig, num_pages: int, page_size: int, mesh: Mesh):
    """A zero KV pool laid out for `mesh`: kv-head dim (-3) has max(Hkv, tensor) slots (see
    `models.sharding.kv_layout`), sharded over the tensor axis. Same pytree as the family
    decoder's `init_kv_cache`."""
    tensor = axis_size(mesh, TENSOR)
    local, copies = kv_layout(config, tensor)
    wide = dataclasses.replace(config, n_kv_heads=config.n_kv_heads * copies)
    family = family_of(config)
    shapes = jax.eval_shape(lambda: family.decoder.init_kv_cache(wide, num_pages, page_size))
    shardings = kv_cache_shardings(shapes, family.rollout_rules(config, tensor), mesh)
    return jax.tree.map(lambda s, sh: jnp.zeros(s.shape, s.dtype, device=sh), shapes, shardings)


def rollout_shardings(params, config: ModelConfig, mesh: Mesh):
    """NamedShardings of `params` (arrays or shapes) in the engine's tensor-parallel layout."""
    rules = family_of(config).rollout_rules(config, axis_size(mesh, TENSOR))
    return tree_shardings(params, rules, mesh)


def _local_params(params, config: ModelConfig, tensor: int, copies: int):
    """Inside shard_map: wrap every weight matrix in `ColumnShard`; with copied kv heads,
    slice this shard's head out of the replicated wk/wv/bk/bv (a slice of their columns)."""
    head = jax.lax.axis_index(TENSOR) // copies
    d = config.head_dim

    def local(path, x):
        name = leaf_name(path)
        if name in _KV_COLUMNS and copies > 1:
            part = jax.lax.dynamic_slice_in_dim(x, head * d, d, axis=x.ndim - 1)
            return ColumnShard(part, x.shape[-1]) if name in _COLUMN_PARALLEL else part
        if name in _COLUMN_PARALLEL or name in _GATHERED:
            return ColumnShard(x, x.shape[-1] * tensor, gathered=name in _GATHERED)
        return x

    return jax.tree_util.tree_map_with_path(local, params)


def shard_forward(forward: Callable, mesh: Mesh) -> Callable:
    """`forward` (a decoder's prefill_forward or decode_forward) run tensor-parallel on
    `mesh`.

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
        rules = family_of(config).rollout_rules(config, tensor)
        param_specs = jax.tree.map(lambda s: s.spec, tree_shardings(params, rules, mesh))
        kv_specs = jax.tree.map(lambda s: s.spec, kv_cache_shardings(kv_cache, rules, mesh))

        def body(params, kv_cache, *arrays):
            return forward(_local_params(params, config, tensor, copies), local_config, kv_cache,
                           *arrays, **static)

        # check_vma=False: pallas_call has no replication rule; the logits are replicated by
        # construction (replicated embed/head, all-gathered residual stream updates).
        return jax.shard_map(body, mesh=mesh, in_specs=(param_specs, kv_specs) +
                             (P(),) * len(arrays), out_specs=(P(), kv_specs),
                             check_vma=False)(params, kv_cache, *arrays)

    return sharded
