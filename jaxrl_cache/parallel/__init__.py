"""Meshes, partition rules, sharded rollout forwards, sharded training, resharding.

XLA SPMD within a process (Mesh, NamedSharding, shard_map) and JAX's multi-controller
runtime (`jax.distributed.initialize`) across processes; no communication layer of our own.
"""
from jaxrl_cache.parallel.distributed import initialize_from_env
from jaxrl_cache.parallel.mesh import AXES, DATA, FSDP, TENSOR, format_rules, make_mesh, \
    tree_shardings
from jaxrl_cache.parallel.reshard import ReshardStats, place, reshard, transfer_bytes
from jaxrl_cache.parallel.tensor_parallel import (engine_kv_cache, rollout_shardings,
                                                  shard_forward)
from jaxrl_cache.parallel.training import train_state_shardings

__all__ = [
    "initialize_from_env", "AXES", "DATA", "FSDP", "TENSOR", "format_rules", "make_mesh",
    "tree_shardings", "ReshardStats", "place", "reshard", "transfer_bytes", "engine_kv_cache",
    "rollout_shardings", "shard_forward", "train_state_shardings",
]
