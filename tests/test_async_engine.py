"""Asynchronous mode: weight updates land between decode chunks of a rollout in flight.

The harness (`ForcedUpdates`) forces syncs at chosen step boundaries, deterministically, in
one thread. References are dense forwards of each token's own version (tests/helpers.py).
"""
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_cache import CacheConfig, RolloutEngine, SamplingParams, SchedulerConfig
from tests.helpers import CONFIG, dense_logits, own_version_logprobs, varied_params

PARAMS = [varied_params(s) for s in range(4)]
PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [1, 2, 3, 4, 5, 6, 7, 8, 11, 12, 13]]
SCHED = SchedulerConfig(max_num_seqs=4, chunk_steps=4, max_prefill_tokens=256)


class ForcedUpdates(RolloutEngine):
    """Syncs PARAMS[v] as version v at the step boundaries listed in `updates`
    ({step index: version}); records the acks."""

    def __init__(self, *args, updates=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.updates, self.acks, self.step_index = dict(updates or {}), [], 0

    def _between_steps(self, run):
        version = self.updates.pop(self.step_index, None)
        self.step_index += 1
        if version is not None:
            self.acks.append(self.sync_weights(PARAMS[version], version))


def make_engine(policy, updates=None, lag=0, pages=64, sched=SCHED):
    engine = ForcedUpdates(CONFIG, CacheConfig(num_pages=pages, page_size=4),
                           scheduler_config=sched, backend="xla", kv_policy=policy,
                           max_policy_lag=lag, updates=updates)
    engine.sync_weights(PARAMS[0], 0)
    return engine


def per_token_logprobs(sample, sampling):
    """What kv_policy "recompute" must reproduce: each token under its own version."""
    return own_version_logprobs(sample, dict(enumerate(PARAMS)), sampling)


def assert_clean(engine):
    engine.cache.check_invariants()
    trie = int(engine.cache._in_trie.sum())
    assert engine.cache.pool.num_free + trie == engine.cache.pool.num_pages - 1
    assert engine._active is None


def test_recompute_greedy_follows_each_tokens_own_version():
    greedy = SamplingParams(n=2, max_new_tokens=14, temperature=0.0)
    engine = make_engine("recompute", updates={2: 1, 3: 2})
    batch = engine.rollout(PARAMS[0], 0, PROMPTS, greedy, rng=jax.random.key(0))
    assert batch.weight_updates == 2 and engine.version == 2
    assert batch.recomputed_tokens > 0
    # each ack announces the running rows' contexts; the re-prefills compute at most that
    assert all(a.recomputed_tokens > 0 for a in engine.acks)
    assert sum(a.recomputed_tokens for a in engine.acks) >= batch.recomputed_tokens
    for s in batch.samples:
        versions = s.token_versions.tolist()
        assert versions == sorted(versions) and versions[0] == 0 and versions[-1] == 2
        assert s.behavior_version == 0 and s.kv_versions == (0, 1, 2)
        assert s.mixed_tokens is None
        # reference: greedy with the dense model, each token under its own version
        seq = list(s.prompt_ids)
        for tok, v in zip(s.output_ids, versions):
            logits = dense_logits(PARAMS[v], CONFIG, seq)[-1]
            assert tok == int(jnp.argmax(logits))
            seq.append(tok)
        np.testing.assert_allclose(s.output_logprobs, per_token_logprobs(s, greedy),
                                   atol=2e-3)
    assert_clean(engine)


@pytest.mark.parametrize("policy", ["recompute", "keep"])
def test_only_a_commit_replaces_a_running_calls_weights(policy, monkeypatch):
    """The call's weights value changes only when a sync commits (`Run.on_update`, between
    two steps), never inside a step; each step stamps the version of the value it read."""
    import inspect
    from jaxrl_cache.rollout import scheduler
    writers = []
    real = scheduler.Run.__setattr__

    def spy(self, name, value):
        if name == "weights":
            writers.append((inspect.stack()[1].function, value.version))
        real(self, name, value)

    monkeypatch.setattr(scheduler.Run, "__setattr__", spy)
    engine = make_engine(policy, updates={2: 1, 3: 2}, lag=2)
    batch = engine.rollout(PARAMS[0], 0, PROMPTS, SamplingParams(n=2, max_new_tokens=14),
                           rng=jax.random.key(0))
    assert writers == [("__init__", 0), ("on_update", 1), ("on_update", 2)]
    versions = sorted({v for s in batch.samples for v in s.token_versions.tolist()})
    assert versions == [0, 1, 2] and batch.weight_updates == 2

def test_recompute_sampled_logprobs_are_each_tokens_own_version():
    sampling = SamplingParams(n=3, max_new_tokens=12, temperature=1.0, top_k=20)
    engine = make_engine("recompute", updates={2: 1})
    batch = engine.rollout(PARAMS[0], 0, PROMPTS, sampling, rng=jax.random.key(3))
    assert {int(v) for s in batch.samples for v in s.token_versions} == {0, 1}
    for s in batch.samples:
        np.testing.assert_allclose(s.output_logprobs, per_token_logprobs(s, sampling),
                                   atol=2e-3)
    assert_clean(engine)


def test_keep_flags_tokens_sampled_over_old_kv():
    greedy = SamplingParams(n=2, max_new_tokens=14, temperature=0.0)
    engine = make_engine("keep", updates={2: 1})
    batch = engine.rollout(PARAMS[0], 0, PROMPTS, greedy, rng=jax.random.key(0))
    assert batch.recomputed_tokens == 0 and batch.weight_updates == 1
    for s in batch.samples:
        old = s.token_versions == 0
        assert old.any() and (~old).any()
        # tokens of version 1 attended KV written by version 0: every one is flagged
        np.testing.assert_array_equal(s.mixed_tokens, ~old)
        assert s.kv_versions == (0, 1)
        # tokens before the update are exact under version 0
        np.testing.assert_allclose(s.output_logprobs[old],
                                   per_token_logprobs(s, greedy)[old], atol=2e-3)
    assert_clean(engine)


def test_no_update_in_flight_equals_the_synchronous_engine():
    sampling = SamplingParams(n=2, max_new_tokens=10, temperature=1.0)
    sync = make_engine("wait").rollout(PARAMS[0], 0, PROMPTS, sampling, rng=jax.random.key(1))
    for policy in ("recompute", "keep"):
        batch = make_engine(policy).rollout(PARAMS[0], 0, PROMPTS, sampling,
                                            rng=jax.random.key(1))
        for a, b in zip(sync.samples, batch.samples):
            assert a.output_ids == b.output_ids and a.kv_versions == b.kv_versions == (0,)
            np.testing.assert_allclose(a.output_logprobs, b.output_logprobs, atol=1e-5)


def test_a_sync_from_another_thread_waits_for_one_chunk_only():
    """The trainer's sync lands inside the rollout call (between two of its chunks) and is
    acknowledged while the call is still running."""
    reached, synced = threading.Event(), threading.Event()

    class Pausing(RolloutEngine):
        steps = 0

        def _between_steps(self, run):
            self.steps += 1
            if self.steps == 3:
                reached.set()
                assert synced.wait(120)

    engine = Pausing(CONFIG, CacheConfig(num_pages=64, page_size=4), scheduler_config=SCHED,
                     backend="xla", kv_policy="recompute")
    engine.sync_weights(PARAMS[0], 0)
    result = {}
    worker = threading.Thread(target=lambda: result.update(batch=engine.rollout(
        PARAMS[0], 0, PROMPTS, SamplingParams(n=2, max_new_tokens=16, temperature=0.0),
        rng=jax.random.key(0))))
    worker.start()
    assert reached.wait(120)
    ack = engine.sync_weights(PARAMS[1], 1)
    assert worker.is_alive()  # acknowledged while the call is in flight
    with pytest.raises(RuntimeError, match="in flight"):
        engine.release_weights()  # the call's next chunks read the resident weights
    synced.set()
    worker.join(120)
    batch = result["batch"]
    assert ack.version == 1 and ack.recomputed_tokens > 0 and batch.weight_updates == 1
    assert all(s.token_versions[0] == 0 and s.token_versions[-1] == 1 for s in batch.samples)


def test_the_lag_window_keeps_older_tries_each_for_its_own_version():
    sampling = SamplingParams(n=2, max_new_tokens=6, temperature=0.0)
    engine = make_engine("recompute", lag=1)
    engine.rollout(PARAMS[0], 0, PROMPTS, sampling, rng=jax.random.key(0))
    ack = engine.sync_weights(PARAMS[1], 1)
    assert ack.cached_versions == (0,) and ack.dropped_versions == () and \
        ack.invalidated_pages == 0
    # version 1 never reads version 0's entries, even though they are cached
    batch = engine.rollout(PARAMS[1], 1, PROMPTS, sampling, rng=jax.random.key(0))
    fresh = make_engine("recompute", lag=1)
    fresh.sync_weights(PARAMS[1], 1)
    alone = fresh.rollout(PARAMS[1], 1, PROMPTS, sampling, rng=jax.random.key(0))
    assert batch.prefill_tokens == alone.prefill_tokens == sum(map(len, PROMPTS)) - 8
    assert [s.output_ids for s in batch.samples] == [s.output_ids for s in alone.samples]
    assert engine.cache.versions() == [0, 1]
    ack = engine.sync_weights(PARAMS[2], 2)
    assert ack.dropped_versions == (0,) and ack.invalidated_pages > 0
    assert ack.cached_versions == (1,)
    assert_clean(engine)


def test_the_oldest_version_is_evicted_first():
    sampling = SamplingParams(n=1, max_new_tokens=4, temperature=0.0)
    engine = make_engine("recompute", lag=2, pages=16)
    engine.rollout(PARAMS[0], 0, PROMPTS[:1], sampling, rng=jax.random.key(0))
    engine.sync_weights(PARAMS[1], 1)
    engine.rollout(PARAMS[1], 1, PROMPTS[:1], sampling, rng=jax.random.key(0))
    engine.sync_weights(PARAMS[2], 2)
    # 3 cached pages each for versions 0 and 1, 9 free; two version-2 rows of 6 pages each
    # need 3 evictions: version 0's pages go first
    assert engine.cache.stats().cached_pages_by_version == {0: 3, 1: 3}
    prompts = [list(range(20, 36)), list(range(30, 46))]
    engine.rollout(PARAMS[2], 2, prompts, SamplingParams(n=1, max_new_tokens=9),
                   rng=jax.random.key(0))
    by_version = engine.cache.stats().cached_pages_by_version
    assert by_version.get(0, 0) == 0 and by_version[1] == 3, by_version
    assert_clean(engine)


@pytest.mark.parametrize("policy", ["recompute", "keep"])
def test_failure_mid_call_releases_everything(policy, monkeypatch):
    from jaxrl_cache.rollout import core
    engine = make_engine(policy, updates={2: 1})
    real, calls = core.decode_chunk, []

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) == 4:
            raise RuntimeError("injected")
        return real(*args, **kwargs)

    monkeypatch.setattr(core, "decode_chunk", failing)
    with pytest.raises(RuntimeError, match="injected"):
        engine.rollout(PARAMS[0], 0, PROMPTS, SamplingParams(n=2, max_new_tokens=20),
                       rng=jax.random.key(0))
    assert engine.version == 1  # the sync inside the call was acknowledged: it stays
    assert_clean(engine)
    monkeypatch.setattr(core, "decode_chunk", real)
    batch = engine.rollout(PARAMS[1], 1, PROMPTS, SamplingParams(n=2, max_new_tokens=8),
                           rng=jax.random.key(0))
    assert all((s.token_versions == 1).all() for s in batch.samples)
    assert_clean(engine)


def test_kv_policy_is_validated():
    with pytest.raises(ValueError, match="kv_policy"):
        RolloutEngine(CONFIG, kv_policy="sometimes")
    with pytest.raises((TypeError, ValueError), match="max_policy_lag"):
        RolloutEngine(CONFIG, max_policy_lag=-1)


@pytest.mark.parametrize("policy", ["recompute", "keep"])
def test_ctrl_c_between_chunks_leaves_a_clean_engine(policy):
    """KeyboardInterrupt outside the lock, after an in-flight update: the call's pages are
    released, the acknowledged version stays, and the next call runs normally."""

    class Interrupted(ForcedUpdates):
        def _between_steps(self, run):
            super()._between_steps(run)
            if self.step_index == 4:
                raise KeyboardInterrupt

    engine = Interrupted(CONFIG, CacheConfig(num_pages=64, page_size=4), scheduler_config=SCHED,
                         backend="xla", kv_policy=policy, updates={2: 1})
    engine.sync_weights(PARAMS[0], 0)
    with pytest.raises(KeyboardInterrupt):
        engine.rollout(PARAMS[0], 0, PROMPTS, SamplingParams(n=2, max_new_tokens=20),
                       rng=jax.random.key(0))
    assert engine.version == 1
    assert_clean(engine)
    batch = engine.rollout(PARAMS[1], 1, PROMPTS, SamplingParams(n=2, max_new_tokens=6),
                           rng=jax.random.key(0))
    assert all((s.token_versions == 1).all() for s in batch.samples)
    assert_clean(engine)


def _failing_decode(monkeypatch, at):
    """core.decode_chunk raising on its `at`-th call."""
    from jaxrl_cache.rollout import core
    real, calls = core.decode_chunk, []

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) == at:
            raise RuntimeError("injected")
        return real(*args, **kwargs)

    monkeypatch.setattr(core, "decode_chunk", failing)
    return lambda: monkeypatch.setattr(core, "decode_chunk", real)


BAD_REQUESTS = {  # how a call at a newer version fails after it started
    "decode_fault": lambda mp: (_failing_decode(mp, 2),
                                SamplingParams(n=2, max_new_tokens=20)),
    "huge_top_k": lambda mp: (lambda: None,
                              lambda: SamplingParams(n=2, max_new_tokens=8, top_k=2**40)),
}


@pytest.mark.parametrize("policy", ["recompute", "keep"])
@pytest.mark.parametrize("failure", sorted(BAD_REQUESTS))
def test_a_failed_call_at_a_newer_version_commits_nothing(policy, failure, monkeypatch):
    """The old version, its params and its cache entries stay; the next call reuses them."""
    sampling = SamplingParams(n=2, max_new_tokens=6, temperature=0.0)
    engine = make_engine(policy)
    engine.rollout(PARAMS[0], 0, PROMPTS, sampling, rng=jax.random.key(0))
    cached = engine.cache.stats().cached_pages_by_version
    assert set(cached) == {0}
    restore, bad = BAD_REQUESTS[failure](monkeypatch)
    with pytest.raises((RuntimeError, OverflowError, ValueError)):
        engine.rollout(PARAMS[1], 1, PROMPTS, bad() if callable(bad) else bad,
                       rng=jax.random.key(1))
    restore()
    assert engine.version == 0  # old code: synced to 1 before generating, kept after
    assert engine.cache.stats().cached_pages_by_version == cached
    assert_clean(engine)
    again = engine.rollout(PARAMS[0], 0, PROMPTS, sampling, rng=jax.random.key(0))
    assert again.cached_tokens > 0
    ack = engine.sync_weights(PARAMS[1], 1)  # version 1 is still new to the engine
    assert ack.previous_version == 0 and ack.dropped_versions == (0,)


@pytest.mark.parametrize("policy", ["recompute", "keep"])
def test_a_call_at_a_newer_version_commits_it_once_it_succeeded(policy):
    sampling = SamplingParams(n=2, max_new_tokens=8, temperature=0.0)
    engine = make_engine(policy)
    batch = engine.rollout(PARAMS[1], 1, PROMPTS, sampling, rng=jax.random.key(0))
    assert engine.version == 1 and batch.sync_ack.version == 1
    assert batch.sync_ack.previous_version == 0
    assert all((s.token_versions == 1).all() for s in batch.samples)
    for s in batch.samples:
        np.testing.assert_allclose(s.output_logprobs, per_token_logprobs(s, sampling),
                                   atol=2e-3)
    assert engine.cache.versions() == [1]  # its own entries survive the commit
    again = engine.rollout(PARAMS[1], 1, PROMPTS, sampling, rng=jax.random.key(0))
    assert again.cached_tokens > 0
    assert_clean(engine)


def test_a_sync_during_a_newer_call_supersedes_its_version():
    """Staged at 1, a sync to 2 lands mid-call: committed at once, the call switches to it
    and does not commit 1 afterwards (versions never go backwards)."""
    sampling = SamplingParams(n=2, max_new_tokens=14, temperature=0.0)
    engine = make_engine("recompute", updates={2: 2})
    batch = engine.rollout(PARAMS[1], 1, PROMPTS, sampling, rng=jax.random.key(0))
    assert engine.version == 2 and batch.sync_ack is None and batch.weight_updates == 1
    for s in batch.samples:
        assert s.token_versions[0] == 1 and s.token_versions[-1] == 2
        np.testing.assert_allclose(s.output_logprobs, per_token_logprobs(s, sampling),
                                   atol=2e-3)
    assert_clean(engine)


def test_the_engine_policy_lag_is_bounded():
    from jaxrl_cache.versioning import MAX_POLICY_LAG
    with pytest.raises(ValueError, match="max_policy_lag"):
        RolloutEngine(CONFIG, max_policy_lag=MAX_POLICY_LAG + 1)
    small = CacheConfig(num_pages=8, page_size=4)
    assert RolloutEngine(CONFIG, small, max_policy_lag=MAX_POLICY_LAG).max_policy_lag == \
        MAX_POLICY_LAG
