"""`jaxrl-cache demo --mesh`: the trainer (data 2 x fsdp 2, devices 0-3) and the engine (tensor
4, devices 4-7) reproduce the single-device run of the same seed.

What is equal, and why: both runs start from the same HF policy (a short SFT on one device)
and draw every token from the same per-sample PRNG stream. On XLA's dots the mesh changes
only fp32 rounding (the engine's shards tile their weight slices unlike whole weights, the
trainer's reductions run per shard: engine logprobs within ~1e-6, trainer params within
~1e-7), far below the gap a sampled token would need to flip, so every step samples the
same tokens: rewards, exact match, generated token counts and the logged completion are
identical at every step, and the loss agrees to 1e-6 absolute + 1e-4 relative. (Over a long run a near-tie draw
can eventually flip one token; from there the curves are two samples of the same process.)
"""
import json
import math
import pathlib

import jax
import pytest

from jaxrl_cache.app.demo import DemoOptions, MeshLayout, run_demo
from jaxrl_cache.models import ModelConfig, from_pretrained, init_params
from jaxrl_cache.parallel import make_mesh, rollout_shardings
from jaxrl_cache.rl.train import TrainState, make_optimizer

TASK = pathlib.Path(__file__).resolve().parents[2] / "examples" / "tasks" / "add.jsonl"
# 4 steps: step 0 trains at lr 0 (warmup), steps 1-3 move the params, steps 2-3 sample them
TINY = dict(steps=4, eval_prompts=2, group_size=4, prompts_per_step=4, rollout_calls=2,
            checkpoint_every=100, seed=0, dataset=str(TASK), max_new_tokens=3)
MESH = "trainer=2x2,engine=4"


def rows(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("demo")
    one = run_demo(DemoOptions(**TINY, sft_steps=60, sft_lr=1e-2, sft_batch=16,
                               out=str(base / "one")))
    mesh = run_demo(DemoOptions(**TINY, model=one["policy"], mesh=MESH, out=str(base / "mesh")))
    return dict(one=one, mesh=mesh, one_rows=rows(base / "one"), mesh_rows=rows(base / "mesh"))


def test_mesh_run_gives_the_single_device_curve(runs):
    one, mesh = runs["one_rows"], runs["mesh_rows"]
    assert [r["step"] for r in one] == [r["step"] for r in mesh] == [0, 1, 2, 3]
    for a, b in zip(one, mesh):
        for key in ("reward", "exact_match", "generated_tokens", "sample", "next_version"):
            assert a[key] == b[key], (a["step"], key, a[key], b[key])
        assert abs(a["loss"] - b["loss"]) <= 1e-6 + 1e-4 * abs(a["loss"]), (a, b)
    # not a flat curve: some groups had mixed rewards, so the params moved
    assert any(abs(r["loss"]) > 1e-3 for r in one) and any(r["reward"] > 0 for r in one)
    assert runs["one"]["audit_failures"] == runs["mesh"]["audit_failures"] == 0
    assert runs["one"]["rl_exact_match"] == runs["mesh"]["rl_exact_match"]


def test_device_sets_and_sync_bytes(runs):
    """Disjoint sets: each sync moves every byte the engine holds (replicated leaves once per
    engine device), counted here from the engine layout's shards; on one device the
    synchronous loop's sync borrows the params (nothing copied)."""
    summary = runs["mesh"]
    assert summary["devices"] == ("trainer: data 2 x fsdp 2 on devices [0, 1, 2, 3]; "
                                  "engine: tensor 4 on devices [4, 5, 6, 7]")
    config, params = from_pretrained(summary["policy"])
    engine = make_mesh({"tensor": 4}, jax.devices()[4:])
    resident = 4 * sum(math.prod(s.shard_shape(x.shape)) * x.dtype.itemsize for x, s in zip(
        jax.tree.leaves(params), jax.tree.leaves(rollout_shardings(params, config, engine))))
    assert [r["sync_bytes"] for r in runs["mesh_rows"]] == [resident] * 4
    # one device, synchronous: the sync lends the trainer's params to the engine, no copy
    assert all(r["sync_bytes"] == 0 for r in runs["one_rows"])
    assert summary["syncs"] == 4 and summary["sync_seconds_median"] > 0
    print(f"\nmesh demo: {summary['devices']}; sync {resident} B, median "
          f"{summary['sync_seconds_median'] * 1e3:.1f} ms; rewards "
          f"{[r['reward'] for r in runs['mesh_rows']]}")


def test_layouts_the_model_cannot_take_are_refused_naming_mesh():
    config = ModelConfig.tiny(vocab_size=100)  # the demo's model: 4 heads, d_model 64
    state = TrainState.create(init_params(config, jax.random.key(0)), make_optimizer(),
                              config=config, lr_schedule=1e-3)
    with pytest.raises(ValueError, match=r"--mesh trainer=4,engine=3: tensor axis 3 must "
                                         r"divide n_heads=4"):
        MeshLayout(1, 4, 3).build(config, state, 16)
    with pytest.raises(ValueError, match=r"--mesh trainer=5,engine=2: param '\w+' .* not "
                                         r"divisible by mesh axis 'fsdp' of size 5"):
        MeshLayout(1, 5, 2).build(config, state, 20)
    with pytest.raises(ValueError, match=r"--mesh trainer=3,engine=4: a step's 16 samples"):
        MeshLayout(1, 3, 4).build(config, state, 16)
    with pytest.raises(ValueError, match=r"--mesh trainer=8,engine=4: needs 8 \+ 4 devices, "
                                         r"8 available"):
        MeshLayout(1, 8, 4).build(config, state, 16)


def test_mesh_run_is_exact_under_the_invariant_kernels(runs, tmp_path):
    """`demo --mesh ... --kernels interpret`: the tensor-parallel engine and the data x fsdp
    trainer both run the batch-invariant kernels, so the library vouches for the bits from
    the first step (tolerance 0, not calibrated) and every audited token reproduces."""
    run_demo(DemoOptions(**TINY, model=runs["one"]["policy"], mesh=MESH, kernels="interpret",
                         out=str(tmp_path / "mesh")))
    steps = rows(tmp_path / "mesh")
    assert [r["step"] for r in steps] == [0, 1, 2, 3]
    for r in steps:
        assert r["audit_tolerance"] == 0.0 and r["audit_checked_tokens"] > 0, r
        assert r["logprob_mismatch_max"] == 0.0 and r["audit_failed"] == 0, r
