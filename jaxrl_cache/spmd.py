"""Batch-split hints for code traced under a mesh (`jax.set_mesh`); no-ops everywhere else.

`rl.train.train_step(mesh=...)` traces the train step under its data x fsdp mesh. There XLA's
SPMD partitioner, left alone, moves activations instead of gathering params inside the
stacked-layer scan, and replicates `lax.top_k` and every Pallas kernel (a custom call it
cannot split: whole-batch activations gathered onto every device). These two helpers keep
the leading (batch) dim split. Without a mesh, on one device, and inside
shard_map bodies (the engine's tensor-parallel forwards: their axes are manual) they return
their input unchanged, so single-device programs are the same programs.
"""
from __future__ import annotations

import math
import warnings
from typing import Callable

import jax
from jax.sharding import PartitionSpec as P

BATCH_AXES = ("data", "fsdp")  # mesh axes that split a batch (parallel.mesh DATA, FSDP)
TENSOR_AXIS = "tensor"  # the engine's tensor-parallel axis (parallel.mesh TENSOR)


def batch_axes() -> tuple[str, ...]:
    """The current mesh's batch axes the partitioner still owns; () without a mesh."""
    mesh = jax.sharding.get_abstract_mesh()
    manual = set(getattr(mesh, "manual_axes", ()))
    return tuple(a for a in BATCH_AXES if a in mesh.axis_names and a not in manual)


def split_batch(x: jax.Array) -> jax.Array:
    """x [B, ...] constrained to split B over `batch_axes()`; x itself when there are none."""
    axes = batch_axes()
    return jax.lax.with_sharding_constraint(x, P(axes)) if axes else x


def per_batch_shard(f: Callable, *xs: jax.Array):
    """f(*xs) for a row-wise f (each x [B, ...], outputs [B, ...], rows independent), run
    per batch shard under shard_map when the mesh splits B; f(*xs) otherwise, and also
    when B does not divide by the batch axes' size (train_step's packed rows do: it pads
    them to a multiple). Values f closes over are replicated into every shard."""
    axes = batch_axes()
    if not axes:
        return f(*xs)
    mesh = jax.sharding.get_abstract_mesh()
    size = math.prod(mesh.shape[a] for a in axes)
    if any(x.ndim == 0 or x.shape[0] % size for x in xs):
        warnings.warn(f"per_batch_shard: leading dims {[x.shape[:1] for x in xs]} do not "
                      f"divide by the batch axes' {size} devices: f runs on the whole batch "
                      f"(gathered onto every device)", stacklevel=2)
        return f(*xs)
    # check_vma off: a Pallas call's outputs carry no varying-axes type
    return jax.shard_map(f, in_specs=(P(axes),) * len(xs), out_specs=P(axes),
                         check_vma=False)(*xs)
