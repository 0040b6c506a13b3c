"""Versions through training: train_step, lr at version, staleness, checkpoints, weight sync,
the attribution audit, and a threaded rollout/train loop."""
import dataclasses
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxrl_cache.rl.audit import audit_attribution
from jaxrl_cache.rl.checkpoint import CheckpointError, restore_checkpoint, save_checkpoint
from jaxrl_cache.rollout import CacheConfig, RolloutEngine
from jaxrl_cache.errors import StalenessError, VersionError
from jaxrl_cache.rollout.sampling import SamplingParams
from jaxrl_cache.rl.logprobs import next_token_log_probs
from jaxrl_cache.rl.batch import group_advantages, make_batch
from jaxrl_cache.rl.train import TrainState, optimizer_counts, train_step
from tests.helpers import CONFIG, varied_params

SCHEDULE = optax.linear_schedule(1e-2, 1e-3, 10)
PROMPTS = [list(range(1, 20)), list(range(5, 14))]
SP = SamplingParams(n=4, max_new_tokens=5, temperature=1.0)


def reward(sample):
    return float(sum(t % 2 == 0 for t in sample.output_ids))


def rollout_batch(engine, state, key=0):
    b = engine.rollout(state.params, state.version, PROMPTS, SP, rng=jax.random.key(key))
    return b, make_batch(b, [reward(s) for s in b.samples])


@pytest.fixture
def engine():
    return RolloutEngine(CONFIG, CacheConfig(num_pages=128, page_size=8))


@pytest.fixture
def state():
    return TrainState.create(varied_params(0), config=CONFIG, lr_schedule=SCHEDULE)


def test_version_and_lr_at_version(engine, state):
    _, batch = rollout_batch(engine, state)
    for k in range(3):
        state, m = train_step(state, batch)
        assert int(m["version"]) == int(state.version) == k + 1
        assert optimizer_counts(state.opt_state) == [k + 1]
        np.testing.assert_allclose(float(m["lr"]), float(SCHEDULE(k)), rtol=1e-6)
        assert int(m["staleness_max"]) == k  # the batch is reused: its version stays 0
    assert int(batch.behavior_version.max()) == 0


def test_donating_the_optimizer_state_keeps_the_params_readable(engine, state):
    """donate="optimizer" (asynchronous RL: the engine decodes with the params while the
    trainer updates): the same new state, bit for bit, as no donation; the input params stay
    readable, the input optimizer state is consumed. donate=True consumes both; any other
    string is refused."""
    _, batch = rollout_batch(engine, state)
    copy = lambda s: jax.tree.map(jnp.copy, s)  # noqa: E731
    plain, _ = train_step(copy(state), batch)
    given = copy(state)
    lent, _ = train_step(given, batch, donate="optimizer")
    for a, b in zip(jax.tree.leaves(plain), jax.tree.leaves(lent)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert not any(x.is_deleted() for x in jax.tree.leaves(given.params))
    assert all(x.is_deleted() for x in jax.tree.leaves(given.opt_state)
               if isinstance(x, jax.Array) and x.ndim)
    given = copy(state)
    train_step(given, batch, donate=True)
    assert all(x.is_deleted() for x in jax.tree.leaves(given.params))
    with pytest.raises(TypeError, match="donate must be a bool or 'optimizer'"):
        train_step(state, batch, donate="params")


def test_create_at_a_given_version(state):
    s = TrainState.create(state.params, config=CONFIG, lr_schedule=SCHEDULE, version=5)
    assert int(s.version) == 5 and optimizer_counts(s.opt_state) == [5]


def test_first_step_ratio_is_one_and_batch_alignment(engine, state):
    rollouts, batch = rollout_batch(engine, state)
    assert sum(len(b) for b in batch.behavior_logprobs) == rollouts.generated_tokens
    for seq, p, behavior in zip(batch.sequences, batch.prompt_lengths, batch.behavior_logprobs):
        logp = np.asarray(next_token_log_probs(state.params, CONFIG, seq[None], SP))[0]
        np.testing.assert_allclose(logp[p - 1:], behavior, atol=1e-4)
    _, m = train_step(state, batch)
    assert abs(float(m["ratio_mean"]) - 1) < 1e-3 and float(m["clip_fraction"]) == 0.0


def test_group_advantages():
    adv = group_advantages(np.array([1.0, 3.0, 5.0, 5.0]), np.array([0, 0, 1, 1]))
    np.testing.assert_allclose(adv, [-1, 1, 0, 0], atol=1e-5)


def test_staleness(engine, state):
    _, batch = rollout_batch(engine, state)
    for _ in range(2):
        state, _ = train_step(state, batch, max_policy_lag=2)
    state, _ = train_step(state, batch, max_policy_lag=2)  # lag 2 at input: allowed
    with pytest.raises(StalenessError, match="3 updates behind"):
        train_step(state, batch, max_policy_lag=2)
    assert int(state.version) == 3


def test_checkpoint_roundtrip_keeps_version_and_lr(tmp_path, engine, state):
    _, batch = rollout_batch(engine, state)
    for _ in range(3):
        state, _ = train_step(state, batch)
    save_checkpoint(tmp_path / "ckpt", state)
    template = TrainState.create(varied_params(9), config=CONFIG, lr_schedule=SCHEDULE)
    restored = restore_checkpoint(tmp_path / "ckpt", template)
    assert int(restored.version) == 3 and optimizer_counts(restored.opt_state) == [3]
    for a, b in zip(jax.tree.leaves(restored.params), jax.tree.leaves(state.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    _, m = train_step(restored, batch)
    np.testing.assert_allclose(float(m["lr"]), float(SCHEDULE(3)), rtol=1e-6)
    resumed = RolloutEngine(CONFIG, CacheConfig(num_pages=64, page_size=8),
                            version=int(restored.version))
    b = resumed.rollout(restored.params, restored.version, PROMPTS, SP, rng=jax.random.key(0))
    assert {s.behavior_version for s in b.samples} == {3}


def test_checkpoint_with_inconsistent_version_is_refused(tmp_path, state):
    save_checkpoint(tmp_path / "bad", state.replace(version=jnp.int32(7)))
    with pytest.raises(CheckpointError, match="version 7 but optimizer update counts"):
        restore_checkpoint(tmp_path / "bad", state)
    with pytest.raises(CheckpointError, match="no checkpoint"):
        restore_checkpoint(tmp_path / "missing", state)


class TestSyncWeights:
    def test_ack_invalidates_older_entries(self, engine, state):
        engine.rollout(state.params, 0, PROMPTS, SP, rng=jax.random.key(0))
        cached = engine.cache_stats().cached_pages_by_version[0]
        assert cached > 0
        new = varied_params(1)
        ack = engine.sync_weights(new, 1)
        assert (ack.version, ack.previous_version, ack.invalidated_pages) == (1, 0, cached)
        assert ack.cached_versions == () and engine.cache_stats().free_pages == 127
        again = engine.sync_weights(new, 1)  # idempotent
        assert again.invalidated_pages == 0 and engine.version == 1

    def test_failure_inside_sync_commits_nothing(self, engine, state, monkeypatch):
        engine.rollout(state.params, 0, PROMPTS, SP, rng=jax.random.key(0))
        before = engine.cache_stats()

        def fail(version, **kwargs):
            raise RuntimeError("injected failure during invalidation")

        monkeypatch.setattr(engine.cache, "invalidate_before", fail)
        with pytest.raises(RuntimeError, match="injected"):
            engine.sync_weights(varied_params(1), 1)
        monkeypatch.undo()
        assert engine.version == 0 and engine.cache_stats() == before
        assert all(a is b for a, b in zip(engine._weights.source, jax.tree.leaves(state.params)))
        b = engine.rollout(state.params, 0, PROMPTS, SP, rng=jax.random.key(1))
        assert b.cached_tokens > 0  # the old cache is intact and still serves version 0

    def test_bad_params_rejected(self, engine):
        with pytest.raises(ValueError, match=r"embed.*float32\[3, 3\]"):
            engine.sync_weights(varied_params(0) | {"embed": jnp.zeros((3, 3))}, 1)
        bf16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), varied_params(0))
        with pytest.raises(ValueError, match="bfloat16"):  # would recompile: refused
            engine.sync_weights(bf16, 1)
        assert engine.version == 0


class TestAudit:
    def test_honest_samples_pass(self, engine, state):
        b1 = engine.rollout(state.params, 0, PROMPTS, SP, rng=jax.random.key(0))
        b2 = engine.rollout(state.params, 0, PROMPTS, SP, rng=jax.random.key(1))  # cache hits
        assert b2.cached_tokens > 0
        for b in (b1, b2):
            report = audit_attribution(b, {0: state.params}, CONFIG)
            assert report.ok and report.max_abs_diff == 0.0 and report.exact, report

    def test_catches_an_engine_that_reuses_stale_kv(self, state):
        class VersionBlindEngine(RolloutEngine):  # one namespace for all versions: the bug
            def _cache_key(self, version):
                return 0

        broken = VersionBlindEngine(CONFIG, CacheConfig(num_pages=128, page_size=8))
        old, new = state.params, varied_params(1)
        broken.rollout(old, 0, PROMPTS, SP, rng=jax.random.key(0))
        b = broken.rollout(new, 1, PROMPTS, SP, rng=jax.random.key(1))
        assert b.cached_tokens > 0  # the bug: version-0 KV served a version-1 request
        report = audit_attribution(b, {0: old, 1: new}, CONFIG)
        assert not report.ok
        assert report.flagged == tuple(range(len(b.samples)))
        assert report.max_abs_diff > 1e-2

    def test_missing_version_is_flagged(self, engine, state):
        b = engine.rollout(state.params, 0, PROMPTS, SP, rng=jax.random.key(0))
        report = audit_attribution(b, {}, CONFIG)
        assert not report.ok and report.missing_versions == (0,)


def test_end_to_end_iterations(engine, state):
    """rollout -> train_step -> sync_weights, three times: the first rollout after each sync
    reuses nothing, a second one at the same version reuses prefixes; the audit passes."""
    params_by_version = {0: state.params}
    for it in range(3):
        first, batch = rollout_batch(engine, state, key=2 * it)
        second = engine.rollout(state.params, state.version, PROMPTS, SP,
                                rng=jax.random.key(2 * it + 1))
        assert first.cached_tokens == 0 and second.cached_tokens > 0
        assert {s.behavior_version for s in first.samples + second.samples} == {it}
        for b in (first, second):
            assert audit_attribution(b, params_by_version, CONFIG).ok
        state, metrics = train_step(state, batch, max_policy_lag=0)
        ack = engine.sync_weights(state.params, state.version)
        assert ack.version == it + 1 and ack.invalidated_pages > 0
        params_by_version[it + 1] = state.params


def test_threads_rollout_while_training(engine, state):
    """One thread rolls out in a loop while another trains and syncs. No rollout overlaps a
    sync, every sample carries the version it was generated at, and all pass the audit."""
    intervals, lock = [], threading.Lock()

    def traced(name, fn):
        def wrapper(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                with lock:
                    intervals.append((name, t0, time.perf_counter(), threading.get_ident()))
        return wrapper

    engine._rollout = traced("rollout", engine._rollout)
    engine._commit = traced("sync", engine._commit)
    params_by_version = {0: state.params}
    published = {"params": state.params, "version": 0}
    batches, stop, errors = [], threading.Event(), []

    def roller():
        key = 0
        while not stop.is_set():
            snap = dict(published)
            try:
                batches.append(engine.rollout(snap["params"], snap["version"], PROMPTS, SP,
                                              rng=jax.random.key(key)))
            except VersionError:
                continue  # the trainer synced past the snapshot: take the new one
            except Exception as e:  # noqa: BLE001
                errors.append(e)
                return
            key += 1

    thread = threading.Thread(target=roller)
    thread.start()
    try:
        for _ in range(3):
            while not batches or batches[-1].version != int(state.version):
                assert not errors, errors
                time.sleep(0.01)
            b = batches[-1]
            batch = make_batch(b, [reward(s) for s in b.samples])
            state, _ = train_step(state, batch, max_policy_lag=1)
            params_by_version[int(state.version)] = state.params
            engine.sync_weights(state.params, state.version)
            published.update(params=state.params, version=int(state.version))
    finally:
        stop.set()
        thread.join()
    assert not errors, errors
    rollouts = sorted(i for i in intervals if i[0] == "rollout")
    syncs = [i for i in intervals if i[0] == "sync"]
    for _, s0, s1, sync_thread in syncs:  # (a rollout's own sync to a newer version nests)
        for _, r0, r1, rollout_thread in rollouts:
            assert r1 <= s0 or s1 <= r0 or sync_thread == rollout_thread, \
                "a rollout overlapped a weight sync"
    for b in batches:
        assert len({s.behavior_version for s in b.samples}) == 1
        assert audit_attribution(b, params_by_version, CONFIG).ok


def test_train_and_audit_compile_once_per_shape(engine):
    """Batches of one packed shape (8 samples of 24 tokens each, other draws), a
    re-created TrainState with equal hyperparameters and a new (equal) schedule object, new
    lr values: one train-step and one audit compilation. The decoupled correction compiles
    once more; new is_cap values, clip values, versions and per-token version patterns
    (audited per version) compile nothing."""
    from jaxrl_cache.rl import logprobs, train
    from jaxrl_cache.rl.batch import pack_batch
    from jaxrl_cache.rl.train_config import TrainConfig
    state = TrainState.create(varied_params(0), config=CONFIG, lr_schedule=SCHEDULE)
    rollouts = [engine.rollout(state.params, 0, PROMPTS[:1], SamplingParams(
        n=n, max_new_tokens=5, temperature=1.0), rng=jax.random.key(k)) for k, n in enumerate((8, 8, 8))]
    batches = [make_batch(b, [reward(s) for s in b.samples]) for b in rollouts]
    assert len({pack_batch(b, TrainConfig(token_budget=256)).tokens.shape
                for b in batches}) == 1
    state, _ = train_step(state, batches[0], token_budget=256)
    train_before = train._train_jit._cache_size()
    audit_before = logprobs._next_token_log_probs._cache_size()
    for b in rollouts:
        assert audit_attribution(b, {0: varied_params(0)}, CONFIG).ok
    for k, batch in enumerate(batches[1:]):
        fresh = TrainState.create(state.params, config=CONFIG, version=int(state.version),
                                  lr_schedule=optax.linear_schedule(1e-2, 1e-3, 10 + k))
        state, m = train_step(fresh, batch, token_budget=256)
        assert int(m["tokens"]) == sum(len(s.output_ids) for s in rollouts[k + 1].samples)
    assert train._train_jit._cache_size() == train_before
    assert logprobs._next_token_log_probs._cache_size() - audit_before <= 1
    for k, batch in enumerate(batches):  # tokens after the first: version k + 1
        b = rollouts[k]
        split = [dataclasses.replace(s, token_versions=np.minimum(np.arange(
            len(s.output_ids)), 1) + k) for s in b.samples]
        batch = make_batch(dataclasses.replace(b, samples=split), [reward(s) for s in split])
        state, m = train_step(state, batch, correction="decoupled", is_cap=2.0 + k,
                              clip_eps=0.1 + 0.1 * k, token_budget=256)
        assert int(m["staleness_max"]) == int(state.version) - 1 - k
        report = audit_attribution(dataclasses.replace(b, samples=split),
                                   {k: varied_params(0), k + 1: varied_params(0)}, CONFIG)
        assert report.ok and report.num_checked_tokens == b.generated_tokens
    assert train._train_jit._cache_size() == train_before + 1
    assert logprobs._next_token_log_probs._cache_size() - audit_before <= 1


def test_a_rollout_that_moves_the_version_reports_the_syncs_own_time(engine, state):
    """sync_ack.seconds of a rollout at a newer version is the staging and commit of the
    weights, not the generation (it used to be the whole call)."""
    engine.rollout(state.params, 0, PROMPTS, SP, rng=jax.random.key(0))
    long = SamplingParams(n=4, max_new_tokens=24, temperature=1.0)
    b = engine.rollout(varied_params(3), 1, PROMPTS, long, rng=jax.random.key(1))
    assert b.sync_ack is not None and b.sync_ack.version == 1
    assert b.decode_steps >= 23 and b.sync_ack.seconds < 0.5 * b.seconds


def test_sync_loop_trains_while_the_engine_holds_no_weights(engine, state, monkeypatch):
    """SyncRollouts releases the engine's copy after its calls: the trainer's update runs
    with the only copy of the params (peak memory), and the publish brings them back."""
    from jaxrl_cache.rl import loop
    from jaxrl_cache.rl.train_config import TrainConfig

    seen = []

    def spy(*args, **kwargs):
        seen.append(engine._weights.params is None)
        return train_step(*args, **kwargs)

    monkeypatch.setattr(loop, "train_step", spy)
    rollouts = loop.SyncRollouts(engine, lambda call: (PROMPTS, None), SP, calls=1,
                                 key=jax.random.key(0))
    history = loop.PolicyHistory(0)
    history.add(0, state.params)
    result = loop.grpo_step(0, state, rollouts, lambda meta, sample, text: float(
        sample.output_ids[0] % 3), decode=str, history=history, train=TrainConfig())
    assert seen == [True]
    assert engine.version == 1 and engine._weights.params is not None
    assert result.record["audit_failed"] == 0
