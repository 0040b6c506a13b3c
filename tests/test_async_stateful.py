"""Property test of the asynchronous mode: random interleavings of decode chunks, train steps
and weight syncs (forced at chosen chunk boundaries, single-threaded and deterministic).

After every step: every token's logprob equals a dense recomputation under its own version
("recompute": all of them; "keep": all but the flagged mixed ones), staleness at training
never exceeds the lag, no page leaks, versions never go backwards.
"""
import jax
import numpy as np
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from jaxrl_cache import (CacheConfig, RolloutEngine, SamplingParams, SchedulerConfig,
                         TrainState, audit_attribution, make_batch, train_step)
from tests.helpers import CONFIG, own_version_logprobs, varied_params

SYSTEM = list(range(10, 18))  # two shared pages
PROMPTS = [SYSTEM + [1, 2, 3], SYSTEM + [4, 5], [7, 8, 9, 20, 21]]
SP = SamplingParams(n=2, max_new_tokens=10, temperature=1.0)
LAG = 2


class Scripted(RolloutEngine):
    """Runs `self.script[i]` (a callable or None) at the i-th step boundary of a call."""
    script: list = []

    def _between_steps(self, run):
        action = self.script.pop(0) if self.script else None
        if action is not None:
            action()


class AsyncMachine(RuleBasedStateMachine):
    @initialize(policy=st.sampled_from(["recompute", "keep"]))
    def setup(self, policy):
        self.policy = policy
        self.engine = Scripted(CONFIG, CacheConfig(num_pages=48, page_size=4),
                               scheduler_config=SchedulerConfig(max_num_seqs=4, chunk_steps=3),
                               backend="xla", kv_policy=policy, max_policy_lag=LAG)
        self.state = TrainState.create(varied_params(0), config=CONFIG, lr_schedule=1e-2)
        self.params_by_version = {0: self.state.params}
        self.engine.sync_weights(self.state.params, 0)
        self.acked = [0]
        self.pending = []  # finished rollout batches not trained on yet
        self.key = 0

    def _train_and_sync(self):
        """One train step on the pending batches (or an untrained version bump), then sync."""
        batches = [b for b in self.pending
                   if int(self.state.version) - min(s.oldest_version for s in b.samples) <= LAG]
        self.pending = []
        if batches:
            rewards = np.array([len(set(s.output_ids)) for b in batches for s in b.samples],
                               np.float32)
            self.state, metrics = train_step(self.state, make_batch(batches, rewards),
                                             max_policy_lag=LAG, correction="decoupled")
            assert int(metrics["staleness_max"]) <= LAG
        else:
            self.state = self.state.replace(version=self.state.version + 1)
        version = int(self.state.version)
        self.params_by_version[version] = self.state.params
        ack = self.engine.sync_weights(self.state.params, version)
        assert ack.version == version > ack.previous_version
        assert all(v >= version - LAG for v in ack.cached_versions)
        self.acked.append(version)

    @rule(picks=st.lists(st.sampled_from(range(len(PROMPTS))), min_size=1, max_size=3),
          updates=st.lists(st.booleans(), max_size=6))
    def rollout(self, picks, updates):
        self.engine.script = [self._train_and_sync if u else None for u in updates]
        start = self.engine.version
        self.key += 1
        batch = self.engine.rollout(self.params_by_version[start], start,
                                    [PROMPTS[i] for i in picks], SP,
                                    rng=jax.random.key(self.key))
        for s in batch.samples:
            versions = s.token_versions.tolist()
            assert versions == sorted(versions) and start <= versions[0]
            assert versions[-1] <= self.engine.version
            expected = own_version_logprobs(s, self.params_by_version, SP)
            check = np.ones(len(versions), bool) if s.mixed_tokens is None else ~s.mixed_tokens
            if self.policy == "recompute":
                assert s.mixed_tokens is None
            np.testing.assert_allclose(s.output_logprobs[check], expected[check], atol=3e-3)
        report = audit_attribution(batch, self.params_by_version, CONFIG)
        assert report.ok, report
        if self.policy == "recompute":
            assert report.num_mixed_tokens == 0
            assert report.num_checked_tokens == batch.generated_tokens
        self.pending.append(batch)

    @rule()
    def train_between_calls(self):
        self._train_and_sync()

    @invariant()
    def no_leak_and_versions_forward(self):
        if not hasattr(self, "engine"):
            return
        cache = self.engine.cache
        cache.check_invariants()
        assert self.engine._active is None
        assert cache.pool.num_free + int(cache._in_trie.sum()) == cache.pool.num_pages - 1
        assert self.acked == sorted(self.acked) and self.engine.version == self.acked[-1]
        assert all(v >= self.engine.version - LAG for v in cache.versions())


TestAsyncMachine = AsyncMachine.TestCase
TestAsyncMachine.settings = settings(max_examples=6, stateful_step_count=4, deadline=None)
