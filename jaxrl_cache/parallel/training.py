"""Training on a mesh: the TrainState and batches laid out by the FSDP rules.

Computation follows data: `rl.train.train_step` (host checks and jitted core unchanged) runs
sharded when its state and batch are placed here; XLA SPMD partitions the step from those
input shardings (params gathered per use, gradients reduced back to their shards, optimizer
state sharded like its params). `sharded_train_step` puts the new state back in the input's
layout, so every step reuses one executable. Checkpoints of a placed state are written
sharded by orbax; `restore_checkpoint` onto a template placed on another mesh reads them
into that mesh's layout.
"""
from __future__ import annotations

import math

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxrl_cache.parallel.mesh import DATA, FSDP, TRAIN_RULES, Rules, tree_shardings
from jaxrl_cache.rl.train import TrainBatch, TrainState, train_step


def train_state_shardings(state: TrainState, mesh: Mesh, rules: Rules = TRAIN_RULES):
    """NamedShardings for every leaf of `state`: params and optimizer moments by `rules`,
    counts and the version replicated."""
    return tree_shardings(state, rules, mesh)


def batch_shardings(batch: TrainBatch, mesh: Mesh) -> TrainBatch:
    """Per-sample arrays split over the mesh's data and fsdp axes (N must divide evenly);
    behavior_version (read on the host by train_step) and scalars replicated."""
    axes = tuple(a for a in (DATA, FSDP) if a in mesh.shape)
    split = NamedSharding(mesh, P(axes or None))
    whole = NamedSharding(mesh, P())
    n = batch.tokens.shape[0]
    ways = math.prod(mesh.shape[a] for a in axes)
    if axes and n % ways:
        raise ValueError(f"batch of {n} samples does not split over mesh axes {axes} "
                         f"({ways} ways)")
    return jax.tree_util.tree_map_with_path(
        lambda path, x: whole if x.ndim == 0 or path[-1].name == "behavior_version" else split,
        batch)


def sharded_train_step(state: TrainState, batch: TrainBatch, **kwargs):
    """`rl.train.train_step` (same checks, same arguments) traced under the batch's mesh
    (`jax.set_mesh`: jaxrl_cache.spmd keeps activations split over data x fsdp, so only
    params are gathered), with the new state placed back in `state`'s layout. XLA's
    propagation may choose another layout for some outputs (it shards stacked [L, d] norm
    vectors like their neighbours); the next step would then compile a second executable.
    Leaves already in place are not copied."""
    layout = jax.tree.map(lambda x: x.sharding, state)
    mesh = getattr(batch.tokens.sharding, "mesh", None)
    if not isinstance(mesh, Mesh):
        raise ValueError("sharded_train_step: place the batch with batch_shardings first "
                         f"(batch.tokens has {batch.tokens.sharding})")
    with jax.set_mesh(mesh):
        new_state, metrics = train_step(state, batch, **kwargs)
    return jax.device_put(new_state, layout), metrics
