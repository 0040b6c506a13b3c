"""LoRA: adapters against a dense reference (the merged-weights model), gradients only on
the adapters, the base shared (never copied) between trainer and engine, syncs that move only
the adapters, and exact attribution with adapters."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxrl_cache.app.demo import builtin_model_config
from jaxrl_cache.models import forward, init_params, lora
from jaxrl_cache.rl.audit import audit_attribution
from jaxrl_cache.rl.batch import make_batch
from jaxrl_cache.rl.train import TrainState, train_step
from jaxrl_cache.rollout.engine import RolloutEngine
from jaxrl_cache.rollout.sampling import SamplingParams
from jaxrl_cache.rollout.types import CacheConfig

CONFIG = builtin_model_config(vocab_size=40)
SYSTEM = [int(t) for t in np.random.default_rng(0).integers(3, 40, 24)]
PROMPTS = [SYSTEM + [5 + i, 9, 11 + i] for i in range(3)]
SP = SamplingParams(n=3, max_new_tokens=10, temperature=1.0)
ALL = lora.LoraConfig(rank=4, alpha=16, targets="all-linear")


@pytest.fixture(scope="module")
def base():
    return init_params(CONFIG, jax.random.key(0))


def _noisy(adapters, seed=3, size=0.05):
    """Adapters with B moved off zero (a trained adapter, without training)."""
    keys = iter(jax.random.split(jax.random.key(seed), 2 * len(adapters)))
    return {n: {p: x + size * jax.random.normal(next(keys), x.shape, x.dtype)
                for p, x in ab.items()} for n, ab in adapters.items()}


def _tokens(seed=0, shape=(2, 20)):
    return jax.random.randint(jax.random.key(seed), shape, 0, CONFIG.vocab_size)


def test_config_follows_peft_and_refuses_what_breaks_exactness():
    cfg = lora.LoraConfig()
    assert (cfg.rank, cfg.alpha, cfg.targets, cfg.scale) == (8, 8.0, ("q_proj", "v_proj"), 1.0)
    assert lora.LoraConfig(targets=["v_proj", "q_proj"]).targets == ("q_proj", "v_proj")
    assert lora.LoraConfig(targets="all-linear").targets == lora.ALL_LINEAR
    with pytest.raises(ValueError, match="dropout must be 0"):
        lora.LoraConfig(dropout=0.05)
    with pytest.raises(ValueError, match="targets must be among"):
        lora.LoraConfig(targets=["qkv"])
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="rank"):
            lora.LoraConfig(rank=bad)
    with pytest.raises(ValueError, match="alpha"):
        lora.LoraConfig(alpha=float("nan"))


def test_zero_initialised_b_gives_the_base_outputs_exactly(base):
    adapters = lora.init_adapters(CONFIG, ALL, jax.random.key(1))
    assert all(float(jnp.abs(ab["a"]).max()) > 0 and not jnp.any(ab["b"])
               for ab in adapters.values())
    model = lora.attach(lora.frozen_part(base, ALL), adapters)
    tokens = _tokens()
    assert np.array_equal(np.asarray(forward(model, CONFIG, tokens)),
                          np.asarray(forward(base, CONFIG, tokens)))


@pytest.mark.parametrize("targets", [("q_proj", "v_proj"), lora.ALL_LINEAR, ("down_proj",)])
def test_adapter_forward_equals_the_merged_weights_forward(base, targets):
    cfg = lora.LoraConfig(rank=4, alpha=8, targets=targets)
    model = lora.attach(lora.frozen_part(base, cfg),
                        _noisy(lora.init_adapters(CONFIG, cfg, jax.random.key(1))))
    # the dense reference: W + scale * A B, merged in numpy (float64)
    merged = jax.tree.map(np.asarray, base)
    for name, ab in model["layers"]["lora"].items():
        delta = np.einsum("lir,lro->lio", np.asarray(ab["a"], np.float64),
                          np.asarray(ab["b"], np.float64)) * cfg.scale
        merged["layers"][name] = (merged["layers"][name] + delta).astype(np.float32)
    tokens = _tokens(1)
    got, want = forward(model, CONFIG, tokens), forward(merged, CONFIG, tokens)
    assert float(jnp.abs(got - forward(base, CONFIG, tokens)).max()) > 1e-2  # adapters matter
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=2e-5)
    np.testing.assert_allclose(np.asarray(forward(lora.merged(model), CONFIG, tokens)),
                               np.asarray(want), atol=2e-5, rtol=2e-5)


def _rollout_batch(engine, state, version, rng=1):
    return engine.rollout(state.model_params, version, PROMPTS, SP, rng=jax.random.key(rng))


def test_train_step_updates_only_the_adapters_with_exact_attribution(base):
    state = TrainState.create(base, optax.adamw(1.0, weight_decay=0.0), config=CONFIG,
                              lr_schedule=1e-3, lora=ALL, rng=jax.random.key(1))
    assert state.frozen["embed"] is base["embed"]  # the base itself, not a copy
    assert set(state.params) == {lora.HF_NAMES[t] for t in ALL.targets}
    assert jax.tree.structure(state.opt_state[0].mu) == jax.tree.structure(state.params)
    engine = RolloutEngine(CONFIG, CacheConfig(num_pages=128, page_size=8))
    batch = _rollout_batch(engine, state, 0)
    rewards = [float(i % 2) for i in range(len(batch.samples))]
    new, metrics = train_step(state, make_batch(batch, rewards), audit_tolerance=0.0)
    assert float(metrics["logprob_mismatch_max"]) == 0.0 and float(metrics["ratio_max"]) == 1.0
    assert int(new.version) == 1 and new.frozen["embed"] is base["embed"]
    moved = [float(jnp.abs(new.params[n]["b"] - state.params[n]["b"]).max())
             for n in state.params]
    assert all(m > 0 for m in moved)  # B left zero: the adapters learn
    # the gradient of the loss w.r.t. the base is never formed: only adapters are outputs
    assert jax.tree.structure(new.params) == jax.tree.structure(state.params)
    # exact attribution on the updated adapters: a fresh rollout audits at tolerance 0 ...
    engine.sync_weights(new.model_params, 1)
    fresh = _rollout_batch(engine, new, 1, rng=2)
    assert audit_attribution(fresh, {1: new.model_params}, CONFIG).ok
    _, again = train_step(new, make_batch(fresh, rewards), audit_tolerance=0.0)
    assert float(again["logprob_mismatch_max"]) == 0.0
    # ... and the old adapters' samples are flagged under the new ones
    report = audit_attribution(batch, {0: new.model_params}, CONFIG)
    assert not report.ok and len(report.flagged) == len(batch.samples)


def test_gradients_flow_to_the_adapters_only(base):
    """The dense reference: the gradient w.r.t. the adapters equals the gradient of the
    merged model's loss through W = W0 + s A B (chain rule), and the base gets none."""
    cfg = lora.LoraConfig(rank=2, alpha=4, targets=("q_proj",))
    adapters = _noisy(lora.init_adapters(CONFIG, cfg, jax.random.key(1)))
    frozen = lora.frozen_part(base, cfg)
    tokens = _tokens(2)

    def loss(ad):
        return jnp.mean(jax.nn.log_softmax(forward(lora.attach(frozen, ad), CONFIG, tokens))
                        [..., 0])

    grads = jax.grad(loss)(adapters)

    def merged_loss(wq):
        return jnp.mean(jax.nn.log_softmax(forward({**base, "layers": {
            **base["layers"], "wq": wq}}, CONFIG, tokens))[..., 0])

    a, b = adapters["wq"]["a"], adapters["wq"]["b"]
    g_w = jax.grad(merged_loss)(base["layers"]["wq"] + cfg.scale * jnp.einsum("lir,lro->lio",
                                                                                a, b))
    np.testing.assert_allclose(grads["wq"]["a"], cfg.scale * jnp.einsum("lio,lro->lir", g_w, b),
                               rtol=1e-3, atol=1e-6)
    np.testing.assert_allclose(grads["wq"]["b"], cfg.scale * jnp.einsum("lir,lio->lro", a, g_w),
                               rtol=1e-3, atol=1e-6)


def _same_buffer(a, b):
    return a.unsafe_buffer_pointer() == b.unsafe_buffer_pointer()


def test_sync_moves_only_the_adapters_and_refuses_another_base(base):
    state = TrainState.create(base, config=CONFIG, lr_schedule=1e-3, lora=ALL)
    engine = RolloutEngine(CONFIG, CacheConfig(num_pages=128, page_size=8))
    adapter_bytes = lora.adapter_bytes(state.params) + 4  # + the scale
    base_bytes = sum(x.nbytes for x in jax.tree.leaves(base))
    ack = engine.sync_weights(state.model_params, 0)
    assert (ack.copied_bytes, ack.lent_bytes) == (adapter_bytes, base_bytes)
    resident = engine._weights.params
    assert _same_buffer(resident["embed"], base["embed"])  # one base: trainer and engine
    assert not _same_buffer(resident["layers"]["lora"]["wq"]["a"], state.params["wq"]["a"])
    moved = state.replace(params=_noisy(state.params), version=jnp.int32(1))
    ack = engine.sync_weights(moved.model_params, 1)
    assert (ack.copied_bytes, ack.lent_bytes) == (adapter_bytes, base_bytes)
    assert _same_buffer(engine._weights.params["embed"], base["embed"])
    # equal base weights in other arrays: accepted, the held base kept
    copy = jax.tree.map(jnp.copy, base)
    again = TrainState.create(copy, config=CONFIG, lr_schedule=1e-3, lora=ALL)
    engine.sync_weights(again.replace(params=_noisy(state.params, 4)).model_params, 2)
    assert _same_buffer(engine._weights.params["embed"], base["embed"])
    other = init_params(CONFIG, jax.random.key(9))
    foreign = TrainState.create(other, config=CONFIG, lr_schedule=1e-3, lora=ALL)
    with pytest.raises(ValueError, match="different base model"):
        engine.sync_weights(foreign.model_params, 3)
    assert engine.version == 2  # nothing changed
    bad = dict(state.params, wq={"a": state.params["wq"]["a"][..., :2],
                                 "b": state.params["wq"]["b"]})
    with pytest.raises(ValueError, match="share one rank|needs"):
        engine.sync_weights(state.replace(params=bad).model_params, 3)


def test_a_numpy_base_edited_in_place_after_a_sync_is_refused(base):
    """Version immutability holds for the frozen base: numpy arrays the caller edits in
    place after a sync are fingerprinted again (only jax arrays, immutable, are taken as
    unchanged by identity), so an adapters-only sync over the edited base is refused instead
    of serving the old base under the new version."""
    host = jax.tree.map(np.array, base)  # writable host copies
    state = TrainState.create(host, config=CONFIG, lr_schedule=1e-3, lora=ALL)
    engine = RolloutEngine(CONFIG, CacheConfig(num_pages=128, page_size=8))
    engine.sync_weights(state.model_params, 0)
    engine.sync_weights(state.replace(params=_noisy(state.params)).model_params, 1)  # same
    host["layers"]["wq"][0, 0, 0] += 1.0  # the base edited in place, the same objects
    with pytest.raises(ValueError, match="different base model"):
        engine.sync_weights(state.replace(params=_noisy(state.params, 2)).model_params, 2)
    assert engine.version == 1


def test_checkpoint_free_dropout_refusal_reaches_train_state(base):
    with pytest.raises(ValueError, match="dropout"):
        TrainState.create(base, config=CONFIG, lora=dataclasses.replace(ALL, dropout=0.1))
    with pytest.raises(ValueError, match="already carry LoRA"):
        TrainState.create(lora.attach(lora.frozen_part(base, ALL),
                                      lora.init_adapters(CONFIG, ALL, jax.random.key(0))),
                          config=CONFIG, lora=ALL)


def test_adapters_that_cannot_fit_are_refused_before_any_allocation(base, monkeypatch):
    """rank 10**9 raised XLA's RESOURCE_EXHAUSTED; now one line with the numbers. The
    estimate is the bytes init_adapters makes x 4 (params, Adam's moments, a gradient)."""
    from jaxrl_cache.rl import train
    made = lora.init_adapters(CONFIG, ALL, jax.random.key(0))
    need = 4 * sum(x.nbytes for x in jax.tree.leaves(made))
    with pytest.raises(train.TrainMemoryError, match=r"LoRA rank 1000000000: .* GiB"):
        TrainState.create(base, config=CONFIG, lora=dataclasses.replace(ALL, rank=10**9))
    monkeypatch.setattr(train, "available_bytes", lambda: need - 1)
    with pytest.raises(train.TrainMemoryError, match="a smaller rank or fewer targets"):
        TrainState.create(base, config=CONFIG, lora=ALL)
    monkeypatch.setattr(train, "available_bytes", lambda: need)
    TrainState.create(base, config=CONFIG, lora=ALL)  # exactly fits


def test_kl_to_the_base_is_exactly_zero_at_version_0_and_grows_after(base):
    """The base is the natural KL reference: zero-initialised B makes version 0 the base
    bit for bit, so the k3 KL is exactly 0 before the first update and positive after."""
    state = TrainState.create(base, optax.adamw(1.0, weight_decay=0.0), config=CONFIG,
                              lr_schedule=1e-2, lora=ALL, rng=jax.random.key(1))
    engine = RolloutEngine(CONFIG, CacheConfig(num_pages=128, page_size=8))
    batch = make_batch(_rollout_batch(engine, state, 0),
                       [float(i % 2) for i in range(len(PROMPTS) * SP.n)])
    new, metrics = train_step(state, batch, kl_beta=0.1, ref_params=base, audit_tolerance=0.0)
    assert float(metrics["kl"]) == 0.0
    engine.sync_weights(new.model_params, 1)
    batch1 = make_batch(_rollout_batch(engine, new, 1, rng=5),
                        [float(i % 3 == 0) for i in range(len(PROMPTS) * SP.n)])
    _, metrics = train_step(new, batch1, kl_beta=0.1, ref_params=base, audit_tolerance=0.0)
    assert float(metrics["kl"]) > 0.0


def test_one_lora_update_at_a_real_learning_rate_is_caught_on_stale_kv(base):
    """Exact attribution holds with adapters: after ONE update at lr 1e-6, an engine whose
    cache ignores versions serves version-0 prefix KV to the version-1 rollout, and the
    audit flags every sample that reused it; the honest engine's samples pass."""
    class VersionBlind(RolloutEngine):
        def _cache_key(self, version):
            return 0

    state = TrainState.create(base, optax.adamw(1.0, weight_decay=0.0), config=CONFIG,
                              lr_schedule=1e-6, lora=ALL, rng=jax.random.key(1))
    blind, honest = (cls(CONFIG, CacheConfig(num_pages=128, page_size=8))
                     for cls in (VersionBlind, RolloutEngine))
    first = _rollout_batch(blind, state, 0)
    new, _ = train_step(state, make_batch(first, [float(i % 3 == 0) for i in range(9)]),
                        audit_tolerance=0.0)
    for engine in (blind, honest):
        engine.sync_weights(new.model_params, 1)
    stale = _rollout_batch(blind, new, 1, rng=2)
    reused = tuple(i for i, s in enumerate(stale.samples) if s.cached_tokens > 0)
    assert len(reused) == len(stale.samples)
    assert audit_attribution(stale, {1: new.model_params}, CONFIG).flagged == reused
    assert audit_attribution(_rollout_batch(honest, new, 1, rng=2), {1: new.model_params},
                             CONFIG).ok
