"""Moving a pytree between layouts (trainer mesh -> engine mesh) with `jax.device_put`.

The trainer and the engine may share devices or sit on disjoint device sets of one process;
in a multi-process program both meshes span every process's devices. `reshard` copies into
the target shardings (never aliasing the source, so a trainer that donates or overwrites its
buffers cannot change the engine's weights) and returns only once every shard is resident.
"""
from __future__ import annotations

import dataclasses
import time

import jax
import numpy as np


@dataclasses.dataclass(frozen=True)
class ReshardStats:
    bytes_moved: int  # bytes that crossed devices to land on this process's target shards
    bytes_resident: int  # bytes of this process's target shards (copies included)
    seconds: float  # wall time until every shard was resident


def _overlap(a: tuple, b: tuple, shape: tuple) -> int:
    """Elements in the intersection of two index tuples (of slices) into `shape`."""
    n = 1
    for sa, sb, dim in zip(a, b, shape):
        lo_a, hi_a, _ = sa.indices(dim)
        lo_b, hi_b, _ = sb.indices(dim)
        n *= max(0, min(hi_a, hi_b) - max(lo_a, lo_b))
    return n


def _bytes_moved(x: jax.Array, target: jax.sharding.Sharding) -> tuple[int, int]:
    """(bytes of target shards not already on their device in x's layout, resident bytes),
    over this process's target devices."""
    shape, itemsize = x.shape, x.dtype.itemsize
    source = x.sharding.devices_indices_map(shape)
    moved = resident = 0
    for device, index in target.addressable_devices_indices_map(shape).items():
        size = _overlap(index, index, shape)
        local = _overlap(index, source[device], shape) if device in source else 0
        moved += (size - local) * itemsize
        resident += size * itemsize
    return moved, resident


def transfer_bytes(tree, shardings) -> tuple[int, int]:
    """(bytes moved, bytes resident) of copying `tree` (jax Arrays) into `shardings` (a
    matching pytree of Shardings), over this process's target devices; nothing is copied."""
    moved = resident = 0
    for x, s in zip(jax.tree.leaves(tree), jax.tree.leaves(shardings), strict=True):
        m, r = _bytes_moved(x, s)
        moved, resident = moved + m, resident + r
    return moved, resident


def reshard(tree, shardings) -> tuple[object, ReshardStats]:
    """Copies `tree` (jax Arrays) into `shardings` (a matching pytree of Shardings).

    Returns (the resharded tree, fully resident, and ReshardStats).
    """
    moved, resident = transfer_bytes(tree, shardings)
    start = time.perf_counter()
    out = jax.block_until_ready(jax.device_put(tree, shardings, may_alias=False))
    return out, ReshardStats(moved, resident, time.perf_counter() - start)


def place(tree, shardings):
    """Host values (numpy or fully addressable arrays, equal on every process) -> global arrays
    laid out by `shardings`. Works in multi-process programs, where each process fills only
    its own shards."""
    def one(x, s):
        host = np.asarray(x)
        return jax.make_array_from_callback(host.shape, s, lambda index: host[index])
    return jax.tree.map(one, tree, shardings)
