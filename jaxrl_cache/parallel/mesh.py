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

from jaxrl_cache.models.sharding import Rules
from jaxrl_cache.spmd import BATCH_AXES, TENSOR_AXIS

DATA, FSDP = BATCH_AXES  # the axes models/ and rollout/ keep a batch split over
TENSOR = TENSOR_AXIS
AXES = (DATA, FSDP, TENSOR)

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
