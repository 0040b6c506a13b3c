"""Batch-split hints for code traced under a mesh (`jax.set_mesh`); no-ops everywhere else.

`rl.train.train_step(mesh=...)` traces the train step under its data x fsdp mesh. There XLA's
SPMD partitioner, left alone, moves activations instead of gathering params inside the
stacked-layer scan, and replicates `lax.top_k` (gathering whole-batch logits). These two
helpers keep the leading (batch) dim split. Without a mesh, on one device, and inside
shard_map bodies (the engine's tensor-parallel forwards: their axes are manual) they return
their input unchanged, so single-device programs are the same programs.
"""
from __future__ import annotations

from typing import Callable

import jax
from jax.sharding import PartitionSpec as P

BATCH_AXES = ("data", "fsdp")  # mesh axes that split a batch (parallel.mesh DATA, FSDP)


def batch_axes() -> tuple[str, ...]:
    """The current mesh's batch axes the partitioner still owns; () without a mesh."""
    mesh = jax.sharding.get_abstract_mesh()
    manual = set(getattr(mesh, "manual_axes", ()))
    return tuple(a for a in BATCH_AXES if a in mesh.axis_names and a not in manual)


def split_batch(x: jax.Array) -> jax.Array:
    """x [B, ...] constrained to split B over `batch_axes()`; x itself when there are none."""
    axes = batch_axes()
    return jax.lax.with_sharding_constraint(x, P(axes)) if axes else x


def per_batch_shard(f: Callable, x: jax.Array) -> jax.Array:
    """f(x) for a row-wise f ([B, ...] -> [B, ...], rows independent), run per batch shard
    under shard_map when the mesh splits B; f(x) otherwise. B must divide by the batch axes'
    size (packed rows do: train_step pads them to a multiple)."""
    axes = batch_axes()
    if not axes:
        return f(x)
    return jax.shard_map(f, in_specs=P(axes), out_specs=P(axes))(x)
