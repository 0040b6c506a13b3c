"""Training on a mesh: the TrainState laid out by the FSDP rules.

`rl.train.train_step(..., mesh=mesh)` runs the step sharded when its state is placed here
(by its family's `train_rules`): the packed micro-batch rows are split over the mesh's data
and fsdp axes and XLA SPMD partitions the step from the input shardings (params gathered
per use, gradients reduced back to their shards, optimizer state sharded like its params);
the new state is put back in the input's layout, so every step reuses one executable.
Checkpoints of a placed state are written sharded by orbax; `restore_checkpoint` onto a
template placed on another mesh reads them into that mesh's layout.
"""
from __future__ import annotations

from jax.sharding import Mesh

from jaxrl_cache.models.families import family_of
from jaxrl_cache.parallel.mesh import tree_shardings


def train_state_shardings(state, mesh: Mesh):
    """NamedShardings for every leaf of a TrainState: params and optimizer moments by its
    config's family's `train_rules`, counts and the version replicated."""
    return tree_shardings(state, family_of(state.config).train_rules, mesh)
