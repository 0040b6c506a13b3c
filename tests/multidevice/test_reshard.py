"""Resharding trainer params into the engine layout: values, target layouts, owned buffers,
and bytes moved counted against a hand computation."""
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxrl_cache.models.sharding import TRAIN_RULES
from jaxrl_cache.parallel import make_mesh, reshard, rollout_shardings, tree_shardings
from tests.multidevice import common

CONFIG = common.CONFIG


def test_bytes_moved_by_hand():
    """8 f32 over devices 0,1 -> 2 each over devices 0..3: device 0 keeps [0:2] (already
    holds [0:4]); device 1 needs [2:4] (holds [4:8]); devices 2, 3 need 2 each: 6 moved."""
    src = make_mesh({"fsdp": 2}, jax.devices()[:2])
    dst = make_mesh({"fsdp": 4}, jax.devices()[:4])
    x = jax.device_put(jnp.arange(8.0), NamedSharding(src, P("fsdp")))
    y, stats = reshard(x, NamedSharding(dst, P("fsdp")))
    assert (stats.bytes_moved, stats.bytes_resident) == (6 * 4, 8 * 4)
    np.testing.assert_array_equal(np.asarray(y), np.arange(8.0))


def _trainer_params(devices):
    mesh = make_mesh({"fsdp": len(devices)}, devices)
    params = common.params()
    return jax.device_put(params, tree_shardings(params, TRAIN_RULES, mesh))


def _check(params, out, shardings):
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
                 out, params)
    for x, s in zip(jax.tree.leaves(out), jax.tree.leaves(shardings)):
        assert x.sharding == s and x.is_fully_addressable
        assert all(shard.data.is_ready() for shard in x.addressable_shards)


def test_disjoint_devices_move_everything():
    params = _trainer_params(jax.devices()[:4])
    engine = make_mesh({"tensor": 4}, jax.devices()[4:])
    shardings = rollout_shardings(params, CONFIG, engine)
    out, stats = reshard(params, shardings)
    _check(params, out, shardings)
    resident = 4 * sum(int(np.prod(s.shard_shape(x.shape))) * x.dtype.itemsize
                       for x, s in zip(jax.tree.leaves(params), jax.tree.leaves(shardings)))
    assert stats.bytes_moved == stats.bytes_resident == resident
    print(f"\n4+4 disjoint: {stats}")


def test_shared_devices():
    params = _trainer_params(jax.devices())
    same, stats = reshard(params, jax.tree.map(lambda x: x.sharding, params))
    assert stats.bytes_moved == 0
    for a, b in zip(jax.tree.leaves(same), jax.tree.leaves(params)):  # copies, not aliases
        assert a.addressable_shards[0].data.unsafe_buffer_pointer() != \
            b.addressable_shards[0].data.unsafe_buffer_pointer()
    engine = make_mesh({"tensor": 8})
    shardings = rollout_shardings(params, CONFIG, engine)
    out, stats = reshard(params, shardings)
    _check(params, out, shardings)
    assert 0 < stats.bytes_moved < stats.bytes_resident
    print(f"\n8 shared, fsdp -> tensor: {stats}")
