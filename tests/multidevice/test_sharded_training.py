"""The train step on an FSDP x data mesh (`train_step(..., mesh=mesh)`) equals the
single-device step, keeps its layout and one executable, and compiles only the expected
collectives; checkpoints written sharded restore onto other meshes."""
import collections
import itertools

import jax
import numpy as np
import pytest

from jaxrl_cache.parallel import make_mesh, train_state_shardings
from jaxrl_cache.rl import batch as batch_module, train
from jaxrl_cache.rl.train_config import TrainConfig
from jaxrl_cache.rl.checkpoint import restore_checkpoint, save_checkpoint
from jaxrl_cache.rl.train import optimizer_counts, train_step
from tests.multidevice import common


def host(tree):
    return jax.tree.map(np.asarray, tree)


def recorded_step(state, batch, mesh):
    """train_step(state, batch, mesh=mesh) and the (args, kwargs) it called the jitted core
    with (to lower exactly what it ran)."""
    calls, core = [], train._train_jit

    def record(*args, **kwargs):
        calls.append((args, kwargs))
        return core(*args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(train.TRAIN_JITS, False, record)
        out = train_step(state, batch, mesh=mesh)
    (call,) = calls
    return out, call


@pytest.fixture(scope="module")
def run():
    """The single-device step and the same step on a data 2 x fsdp 4 mesh."""
    state, batch = common.train_state(), common.train_batch()
    mesh = make_mesh({"data": 2, "fsdp": 4})
    shardings = train_state_shardings(state, mesh)
    placed = jax.device_put(state, shardings)
    got, call = recorded_step(placed, batch, mesh)
    return dict(ref=train_step(state, batch), got=got, call=call, batch=batch, mesh=mesh,
                shardings=shardings)


def close(got, want):
    """Equal up to fp32 reduction order: the embedding and attention gradients (large
    logits of the x8 weights) move by ~1e-5 of their leaf's largest entry when only the
    row grouping changes (as much as splitting one device's batch into micro-batches)."""
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6 + 2e-5 * np.abs(want).max())


def assert_same_step(got, ref):
    (got, got_m), (ref, ref_m) = got, ref
    assert int(got.version) == int(ref.version) == 1 and optimizer_counts(got.opt_state) == [1]
    np.testing.assert_allclose(float(got_m["loss"]), float(ref_m["loss"]), rtol=1e-5)
    np.testing.assert_allclose(float(got_m["grad_norm"]), float(ref_m["grad_norm"]), rtol=1e-5)
    assert int(got_m["tokens"]) == int(ref_m["tokens"])
    jax.tree.map(close, host(got.opt_state), host(ref.opt_state))  # Adam moments: gradients
    jax.tree.map(close, host(got.params), host(ref.params))


def test_sharded_step_equals_single_device(run):
    assert_same_step(run["got"], run["ref"])


def test_step_keeps_the_layout_and_one_executable(run):
    got, _ = run["got"]
    same = jax.tree.map(lambda x, s: x.sharding.is_equivalent_to(s, x.ndim), got,
                        run["shardings"])
    assert all(jax.tree.leaves(same))
    wq = got.params["layers"]["wq"]
    assert wq.addressable_shards[0].data.shape == (1, 8, 64)  # d_model 32 over fsdp 4
    packed = run["call"][0][4]  # [U, M, B, R]: rows split over data x fsdp
    width = packed.tokens.shape[-1]  # planned for prompt + max_new_tokens
    assert packed.tokens.shape == (1, 1, 8, width) and width % 16 == 0
    assert packed.tokens.sharding.shard_shape(packed.tokens.shape) == (1, 1, 1, width)
    compiled = train._train_jit._cache_size()
    again, metrics = train_step(got, run["batch"], mesh=run["mesh"])
    assert int(metrics["version"]) == 2 and train._train_jit._cache_size() == compiled
    assert all(jax.tree.leaves(jax.tree.map(
        lambda x, s: x.sharding.is_equivalent_to(s, x.ndim), again, run["shardings"])))


def test_step_collectives(run):
    """FSDP x data: only whole params are all-gathered (for use; never activations), and only
    gradient blocks (a param's shape, in any dim order, each dim divided), vectors and
    scalars are all-reduced; no all-to-all or permutes. XLA CPU reduces a gradient over fsdp
    as all-reduce + dynamic-slice (the GPU pipeline rewrites that pair into a
    reduce-scatter). Lowered from the very call train_step(mesh=...) made, under its mesh
    (as train_step traces it); the micro-batch scan of the packed step accumulates the
    gradient blocks in its carry, so the expectations are those of the padded-batch step."""
    args, kwargs = run["call"]
    with jax.set_mesh(run["mesh"]):
        text = train._train_jit.lower(*args, **kwargs).compile().as_text()
    params = args[0]
    found = common.collectives(text)
    ops = collections.Counter(op for op, _ in found)
    dims = lambda t: tuple(int(d) for d in t[t.index("[") + 1:-1].split(",") if d)
    whole = {x.shape[1:] for x in jax.tree.leaves(params["layers"]) if x.ndim >= 3} \
        | {params["embed"].shape}
    gathered = {dims(t) for op, types in found if op == "all-gather" for t in types}
    reduced = {dims(t) for op, types in found if op != "all-gather" for t in types}
    block = lambda s: any(len(s) == len(w) and all(a % b == 0 for a, b in zip(p, s))
                          for w in whole for p in itertools.permutations(w))
    print(f"\ntrain step collectives {dict(ops)}: {sorted(found)}")
    assert set(ops) <= {"all-gather", "all-reduce", "reduce-scatter"}, ops
    assert gathered and gathered <= whole, (gathered, whole)
    assert reduced and all(len(s) < 2 or block(s) for s in reduced), reduced


def test_rows_are_padded_to_the_mesh(run):
    """6 samples on 8 devices: the packed rows are padded to 8 (empty rows, zero weight), and
    the step still equals the single-device one (6 rows)."""
    state, batch = common.train_state(), common.train_batch(n=6)
    placed = jax.device_put(state, train_state_shardings(state, run["mesh"]))
    got, call = recorded_step(placed, batch, run["mesh"])
    assert call[0][4].tokens.shape[:3] == (1, 1, 8)
    batch_module._PACKED_SHAPES.clear()  # the tightest single-device shape, not one packed before
    assert batch_module.pack_batch(batch, TrainConfig()).tokens.shape[2] < 8  # no mesh padding
    assert_same_step(got, train_step(state, batch))


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


def test_lora_step_on_the_mesh_equals_single_device(run):
    """LoRA under data x fsdp: the frozen base sharded by the same rules, the adapters
    replicated; the update equals the single-device one and the base is untouched."""
    from jaxrl_cache.models.lora import LoraConfig
    base = common.train_state().params
    state = train.TrainState.create(base, config=common.train_state().config,
                                    lr_schedule=1e-2, lora=LoraConfig(rank=2, alpha=4,
                                                                      targets="all-linear"))
    batch = common.train_batch()
    placed = jax.device_put(state, train_state_shardings(state, run["mesh"]))
    got, metrics = train_step(placed, batch, mesh=run["mesh"])
    ref, ref_metrics = train_step(state, batch)
    np.testing.assert_allclose(float(metrics["loss"]), float(ref_metrics["loss"]), rtol=1e-5)
    jax.tree.map(close, host(got.params), host(ref.params))
    assert any(np.abs(np.asarray(ab["b"])).max() > 0 for ab in got.params.values())
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, b), host(got.frozen),
                 host(state.frozen))
