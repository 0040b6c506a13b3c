"""Training on a mesh: the TrainState and batches laid out by the FSDP rules.

Computation follows data: `rl.train.train_step` (host checks and jitted core unchanged) runs
sharded when its state and batch are placed here; XLA SPMD partitions the step from those
input shardings, and the new state keeps them (params gathered per use, gradients
reduce-scattered, optimizer state sharded like its params). Checkpoints of a placed state
are written sharded by orbax; `restore_checkpoint` onto a template placed on another mesh
reads them into that mesh's layout.
"""
from __future__ import annotations

import math

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxrl_cache.parallel.mesh import DATA, FSDP, TRAIN_RULES, Rules, tree_shardings
from jaxrl_cache.rl.train import TrainBatch, TrainState


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
