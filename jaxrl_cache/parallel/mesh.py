"""Device meshes and partition rules.

A rule set is data: a tuple of (leaf name, spec), the spec naming the mesh axis of each of
the leaf's *trailing* dims (None = replicated). Any leading dims (the [L] axis of stacked
layers) are replicated, so one rule set serves per-layer and stacked params alike. A leaf is
matched by the last key of its path, so optimizer state (Adam's mu and nu mirror the params)
is sharded exactly like its params; 0-d leaves (counts, the version) are replicated.

Axes: "data" (batch only, params replicated), "fsdp" (batch and params sharded),
"tensor" (tensor parallelism over attention heads, the FFN and d_model: tensor_parallel).
"""
from __future__ import annotations

from typing import Mapping, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxrl_cache.models.config import ModelConfig
from jaxrl_cache.spmd import BATCH_AXES

DATA, FSDP = BATCH_AXES  # the axes models/ and rollout/ keep a batch split over
TENSOR = "tensor"
AXES = (DATA, FSDP, TENSOR)

Rules = tuple[tuple[str, tuple], ...]  # ((leaf name, spec of its trailing dims), ...)

# FSDP: every matrix sharded along d_model; vectors replicated. Training batches are split
# over data x fsdp; params are gathered per layer in the forward, gradients reduce-scattered.
TRAIN_RULES: Rules = (
    ("embed", (FSDP, None)),  # [V, d]
    ("lm_head", (FSDP, None)),  # [d, V]
    ("wq", (FSDP, None)), ("wk", (FSDP, None)), ("wv", (FSDP, None)),  # [d, H*D]
    ("wo", (None, FSDP)),  # [Hq*D, d]
    ("w_gate", (FSDP, None)), ("w_up", (FSDP, None)),  # [d, F]
    ("w_down", (None, FSDP)),  # [F, d]
    ("bq", (None,)), ("bk", (None,)), ("bv", (None,)), ("bo", (None,)),
    ("attn_norm", (None,)), ("mlp_norm", (None,)), ("final_norm", (None,)),
    ("q_norm", (None,)), ("k_norm", (None,)),
    ("a", (None, None)), ("b", (None, None)),  # LoRA adapters [L, in, r], [L, r, out]: small
)


def kv_layout(config: ModelConfig, tensor: int) -> tuple[int, int]:
    """(kv heads per shard, copies of each kv head) for a tensor axis of size `tensor`.

    tensor <= Hkv: each shard holds Hkv / tensor kv heads, no copies. tensor > Hkv: each
    shard holds one kv head, each kv head lives on tensor / Hkv shards (the shards whose
    query heads read it), so the pool has `tensor` head slots, slot j a copy of head
    j // (tensor / Hkv).
    """
    hq, hkv = config.n_heads, config.n_kv_heads
    if tensor < 1 or hq % tensor or config.d_ff % tensor or config.d_model % tensor:
        raise ValueError(f"tensor axis {tensor} must divide n_heads={hq}, d_ff={config.d_ff} "
                         f"and d_model={config.d_model}")
    if tensor <= hkv:
        if hkv % tensor:
            raise ValueError(f"tensor axis {tensor} must divide n_kv_heads={hkv}")
        return hkv // tensor, 1
    if tensor % hkv:
        raise ValueError(f"tensor axis {tensor} > n_kv_heads={hkv} must be a multiple of it")
    return 1, tensor // hkv


def rollout_rules(config: ModelConfig, tensor: int) -> Rules:
    """Tensor parallelism for the paged forwards (see `kv_layout`).

    Every matrix is split by its output columns (see tensor_parallel: no partial sums):
    wq/wk/wv (+ biases), w_gate/w_up over heads / FFN; wo and w_down over d_model (their
    input and output all-gathered around the product). When kv heads are copied
    (tensor > Hkv), wk/wv/bk/bv are replicated and each shard slices its own head. embed and
    lm_head are replicated: every shard then holds full-vocab logits for sampling, and no
    logits are gathered per decode step. "kv_pages" is the pool [..., P, Hkv, page_size, D].
    """
    _, copies = kv_layout(config, tensor)
    kv = TENSOR if copies == 1 else None
    return (
        ("embed", (None, None)), ("lm_head", (None, None)),
        ("wq", (None, TENSOR)), ("bq", (TENSOR,)),
        ("wk", (None, kv)), ("wv", (None, kv)), ("bk", (kv,)), ("bv", (kv,)),
        ("wo", (None, TENSOR)), ("bo", (None,)),  # bo added to the gathered output
        ("w_gate", (None, TENSOR)), ("w_up", (None, TENSOR)), ("w_down", (None, TENSOR)),
        ("attn_norm", (None,)), ("mlp_norm", (None,)), ("final_norm", (None,)),
        ("q_norm", (None,)), ("k_norm", (None,)),  # per head, [D]
        ("kv_pages", (None, TENSOR, None, None)),
    )


def make_mesh(axes: Mapping[str, int], devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A mesh with the named axes, in order, over `devices` (default: all devices).

    The product of the axis sizes must equal the number of devices.
    """
    devices = list(jax.devices() if devices is None else devices)
    unknown = set(axes) - set(AXES)
    if unknown:
        raise ValueError(f"unknown mesh axes {sorted(unknown)}; use {AXES}")
    sizes = tuple(int(s) for s in axes.values())
    if any(s < 1 for s in sizes) or int(np.prod(sizes)) != len(devices):
        raise ValueError(f"mesh axes {dict(axes)} need {int(np.prod(sizes))} devices, "
                         f"got {len(devices)}")
    return Mesh(np.array(devices, dtype=object).reshape(sizes), tuple(axes))


def axis_size(mesh: Mesh, axis: str) -> int:
    """Size of `axis` in `mesh`; 1 when the mesh lacks it (the rule then replicates)."""
    return mesh.shape.get(axis, 1)


def leaf_name(path) -> str:
    """The name a rule matches: the last key of a pytree path (dict key or attribute)."""
    key = path[-1] if path else None
    return str(getattr(key, "key", getattr(key, "name", key)))


def spec_for(name: str, shape: tuple, rules: Rules, mesh: Mesh) -> P:
    """The PartitionSpec of a leaf called `name` with `shape` under `rules` on `mesh`.

    Axes the mesh lacks are dropped (replicated). Raises ValueError when a sharded dim is not
    divisible by its axis size, or when a leaf of rank >= 1 has no rule.
    """
    table = dict(rules)
    if not shape:
        return P()
    if name not in table:
        raise ValueError(f"no partition rule for param {name!r} (shape {shape}); "
                         f"rules cover {sorted(table)}")
    trailing = table[name]
    if len(trailing) > len(shape):
        raise ValueError(f"rule for {name!r} names {len(trailing)} dims, the leaf has shape "
                         f"{shape}")
    spec = (None,) * (len(shape) - len(trailing)) + tuple(
        a if a in mesh.shape else None for a in trailing)
    for dim, axis in zip(shape, spec):
        if axis is not None and dim % mesh.shape[axis]:
            raise ValueError(f"param {name!r} of shape {shape}: dim {dim} is not divisible by "
                             f"mesh axis {axis!r} of size {mesh.shape[axis]}")
    return P(*spec)


def tree_shardings(tree, rules: Rules, mesh: Mesh):
    """NamedSharding for every leaf of `tree` (arrays or ShapeDtypeStructs), by leaf name."""
    return jax.tree_util.tree_map_with_path(
        lambda path, x: NamedSharding(mesh, spec_for(leaf_name(path), np.shape(x), rules, mesh)),
        tree)


def kv_cache_shardings(kv_cache, rules: Rules, mesh: Mesh):
    """Shardings of a KV pool pytree: every leaf is [..., P, Hkv, page_size, D]."""
    return jax.tree.map(
        lambda x: NamedSharding(mesh, spec_for("kv_pages", np.shape(x), rules, mesh)), kv_cache)


def format_rules(rules: Rules, mesh: Mesh | None = None, params=None) -> str:
    """The rule table as text; with `params` (and a mesh), each leaf's global and per-device
    shape."""
    lines = [f"{'leaf':<12} trailing spec"]
    lines += [f"{name:<12} ({', '.join(str(a) for a in spec)})" for name, spec in rules]
    if params is not None and mesh is not None:
        lines.append(f"\nmesh {dict(mesh.shape)}:")
        for path, x in jax.tree_util.tree_leaves_with_path(params):
            sharding = NamedSharding(mesh, spec_for(leaf_name(path), np.shape(x), rules, mesh))
            lines.append(f"{jax.tree_util.keystr(path):<32} {str(tuple(np.shape(x))):<16} -> "
                         f"{str(sharding.shard_shape(np.shape(x))):<16} {sharding.spec}")
    return "\n".join(lines)
