"""Meshes and partition rules: shapes per device, stacked layers, optimizer state, errors."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jaxrl_cache.models.sharding import TRAIN_RULES, kv_layout, rollout_rules
from jaxrl_cache.parallel import (format_rules, make_mesh, train_state_shardings,
                                  tree_shardings)
from tests.multidevice import common

CONFIG = common.CONFIG  # d_model 32, 8 query heads, 2 kv heads, head_dim 8, d_ff 64


def test_make_mesh_axes_and_errors():
    mesh = make_mesh({"data": 2, "fsdp": 4})
    assert dict(mesh.shape) == {"data": 2, "fsdp": 4}
    assert list(mesh.devices.flat) == jax.devices()
    with pytest.raises(ValueError, match="need 6 devices"):
        make_mesh({"data": 2, "fsdp": 3})
    with pytest.raises(ValueError, match="unknown mesh axes"):
        make_mesh({"model": 8})


def test_kv_layout():
    assert kv_layout(CONFIG, 1) == (2, 1)
    assert kv_layout(CONFIG, 2) == (1, 1)
    assert kv_layout(CONFIG, 4) == (1, 2)  # each kv head on two shards
    assert kv_layout(CONFIG, 8) == (1, 4)
    with pytest.raises(ValueError, match="must divide n_heads"):
        kv_layout(CONFIG, 3)


def test_rollout_shard_shapes():
    params = common.params()
    for tensor, kv_cols in ((2, 8), (8, 16)):  # kv heads split (one per shard) or copied
        mesh = make_mesh({"tensor": tensor}, jax.devices()[:tensor])
        shardings = tree_shardings(params, rollout_rules(CONFIG, tensor), mesh)
        layer = shardings["layers"]  # stacked: [L=1, ...] leaves
        shape = lambda name: layer[name].shard_shape(params["layers"][name].shape)
        assert shape("wq") == (1, 32, 64 // tensor)
        assert shape("wk") == shape("wv") == (1, 32, kv_cols)
        assert shape("wo") == (1, 64, 32 // tensor)  # whole columns of d_model
        assert shape("w_gate") == shape("w_up") == (1, 32, 64 // tensor)
        assert shape("w_down") == (1, 64, 32 // tensor)
        assert shardings["embed"].shard_shape(params["embed"].shape) == (32, 32)


def test_rules_apply_to_trailing_dims_with_or_without_a_layer_axis():
    mesh = make_mesh({"tensor": 8})
    shapes = {"wq": (32, 64), "wo": (64, 32), "attn_norm": (32,), "kv_pages": (4, 8, 4, 8)}
    for lead in ((), (3,)):
        tree = {k: jax.ShapeDtypeStruct(lead + v, jnp.float32) for k, v in shapes.items()}
        specs = jax.tree.map(lambda s: s.spec,
                             tree_shardings(tree, rollout_rules(CONFIG, 8), mesh))
        pad = (None,) * len(lead)
        assert specs == {"wq": P(*pad, None, "tensor"), "wo": P(*pad, None, "tensor"),
                         "attn_norm": P(*pad, None),
                         "kv_pages": P(*pad, None, "tensor", None, None)}


def test_optimizer_state_sharded_like_params():
    mesh = make_mesh({"data": 2, "fsdp": 4})
    state = common.train_state()
    shardings = train_state_shardings(state, mesh)
    mu, nu = shardings.opt_state.mu, shardings.opt_state.nu
    assert jax.tree.map(lambda s: s.spec, mu) == jax.tree.map(lambda s: s.spec, shardings.params)
    assert jax.tree.map(lambda s: s.spec, nu) == jax.tree.map(lambda s: s.spec, shardings.params)
    assert shardings.opt_state.count.spec == P() and shardings.version.spec == P()
    wq = state.params["layers"]["wq"]
    assert shardings.params["layers"]["wq"].shard_shape(wq.shape) == (1, 8, 64)


def test_errors_name_the_param():
    mesh = make_mesh({"fsdp": 8})
    with pytest.raises(ValueError, match="'wq'.*not divisible by mesh axis 'fsdp'"):
        tree_shardings({"wq": np.zeros((12, 4))}, TRAIN_RULES, mesh)
    with pytest.raises(ValueError, match="no partition rule for param 'w_extra'"):
        tree_shardings({"w_extra": np.zeros((8, 8))}, TRAIN_RULES, mesh)


def test_format_rules_lists_rules_and_per_device_shapes():
    mesh = make_mesh({"tensor": 8})
    text = format_rules(rollout_rules(CONFIG, 8), mesh, common.params())
    for name, _ in rollout_rules(CONFIG, 8):
        assert name in text
    assert "['layers']['wq']" in text and "(1, 32, 64)" in text and "(1, 32, 8)" in text
