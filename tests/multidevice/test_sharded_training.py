"""The train step on an FSDP x data mesh equals the single-device step, keeps its layout and
compiles only the expected collectives; checkpoints written sharded restore onto other
meshes."""
import collections
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_cache.parallel import (batch_shardings, make_mesh, sharded_train_step,
                                  train_state_shardings)
from jaxrl_cache.rl import train
from jaxrl_cache.rl.checkpoint import restore_checkpoint, save_checkpoint
from jaxrl_cache.rl.train import optimizer_counts, train_step
from tests.multidevice import common


def host(tree):
    return jax.tree.map(np.asarray, tree)


@pytest.fixture(scope="module")
def run():
    """The single-device step and the same step on a data 2 x fsdp 4 mesh."""
    state, batch = common.train_state(), common.train_batch()
    mesh = make_mesh({"data": 2, "fsdp": 4})
    shardings = train_state_shardings(state, mesh)
    placed = (jax.device_put(state, shardings),
              jax.device_put(batch, batch_shardings(batch, mesh)))
    return dict(ref=train_step(state, batch), got=sharded_train_step(*placed), placed=placed,
                shardings=shardings)


def test_sharded_step_equals_single_device(run):
    (ref, ref_m), (got, got_m) = run["ref"], run["got"]
    assert int(got.version) == int(ref.version) == 1 and optimizer_counts(got.opt_state) == [1]
    np.testing.assert_allclose(float(got_m["loss"]), float(ref_m["loss"]), rtol=1e-5)
    np.testing.assert_allclose(float(got_m["grad_norm"]), float(ref_m["grad_norm"]), rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6, rtol=1e-5),
                 host(got.opt_state), host(ref.opt_state))  # Adam moments: the gradients
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6, rtol=1e-5),
                 host(got.params), host(ref.params))


def test_step_keeps_the_layout_and_one_executable(run):
    got, _ = run["got"]
    same = jax.tree.map(lambda x, s: x.sharding.is_equivalent_to(s, x.ndim), got,
                        run["shardings"])
    assert all(jax.tree.leaves(same))
    wq = got.params["layers"]["wq"]
    assert wq.addressable_shards[0].data.shape == (1, 8, 64)  # d_model 32 over fsdp 4
    compiled = train._train_core._cache_size()
    again, metrics = sharded_train_step(got, run["placed"][1])
    assert int(metrics["version"]) == 2 and train._train_core._cache_size() == compiled


def test_step_collectives(run):
    """FSDP x data: only whole params are all-gathered (for use; never activations), and only
    gradient blocks (a param's shape, in any dim order, each dim divided), vectors and
    scalars are all-reduced; no all-to-all or permutes. XLA CPU reduces a gradient over fsdp
    as all-reduce + dynamic-slice (the GPU pipeline rewrites that pair into a
    reduce-scatter). Traced as sharded_train_step traces it: under the batch's mesh."""
    state, batch = run["placed"]
    with jax.set_mesh(batch.tokens.sharding.mesh):
        text = train._train_core.lower(
            state.params, state.opt_state, state.version, batch, jnp.float32(1e-3),
            jnp.float32(0.2), None, jnp.float32(2.0), tx=state.tx, config=state.config,
            correction="none").compile().as_text()
    found = common.collectives(text)
    ops = collections.Counter(op for op, _ in found)
    dims = lambda t: tuple(int(d) for d in t[t.index("[") + 1:-1].split(",") if d)
    whole = {x.shape[1:] for x in jax.tree.leaves(state.params["layers"]) if x.ndim >= 3} \
        | {state.params["embed"].shape}
    gathered = {dims(t) for op, types in found if op == "all-gather" for t in types}
    reduced = {dims(t) for op, types in found if op != "all-gather" for t in types}
    block = lambda s: any(len(s) == len(w) and all(a % b == 0 for a, b in zip(p, s))
                          for w in whole for p in itertools.permutations(w))
    print(f"\ntrain step collectives {dict(ops)}: {sorted(found)}")
    assert set(ops) <= {"all-gather", "all-reduce", "reduce-scatter"}, ops
    assert gathered and gathered <= whole, (gathered, whole)
    assert reduced and all(len(s) < 2 or block(s) for s in reduced), reduced


def test_batch_must_split_over_data_and_fsdp(run):
    _, batch = run["placed"]
    mesh = make_mesh({"data": 2, "fsdp": 4})
    with pytest.raises(ValueError, match="6 samples does not split"):
        batch_shardings(batch.replace(tokens=batch.tokens[:6]), mesh)


def test_checkpoint_saved_on_8_restores_on_4_and_1(run, tmp_path):
    got, _ = run["got"]
    save_checkpoint(tmp_path / "ckpt", got)
    fresh = common.train_state(seed=3)
    mesh4 = make_mesh({"fsdp": 4}, jax.devices()[4:])
    for template in (jax.device_put(fresh, train_state_shardings(fresh, mesh4)), fresh):
        restored = restore_checkpoint(tmp_path / "ckpt", template)
        assert int(restored.version) == 1
        jax.tree.map(np.testing.assert_array_equal, host(restored.params), host(got.params))
        jax.tree.map(np.testing.assert_array_equal, host(restored.opt_state),
                     host(got.opt_state))
        for x, t in zip(jax.tree.leaves(restored), jax.tree.leaves(template)):
            assert x.sharding.is_equivalent_to(t.sharding, x.ndim), (x.sharding, t.sharding)
