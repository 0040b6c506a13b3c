"""Property test of the asynchronous mode: random interleavings of decode chunks, train steps
and weight syncs (forced at chosen chunk boundaries, single-threaded and deterministic).

Syncs go through a RolloutWorker's `publish`, some with a Ctrl-C at a drawn traced line
(tests/test_engine_interrupts.py's mechanism), and rollout calls are the worker's (its call
loop driven one call at a time, in this thread): a call after an interrupted publish runs at
the engine's version. Injected faults (outside the engine lock between steps, or in a decode
chunk) hit calls at the current version and at a newer one: a failed call commits nothing of
its own (only the syncs that landed during it).

After every step: every token's logprob equals, bit for bit, a dense recomputation under its
own version ("recompute": all of them; "keep": all but the flagged mixed ones), staleness at training
never exceeds the lag, no page leaks, versions never go backwards.
"""
import threading

import jax
import numpy as np
import pytest
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from jaxrl_cache import (CacheConfig, RolloutEngine, RolloutWorker, SampleBuffer,
                         SamplingParams, SchedulerConfig, TrainState, audit_attribution,
                         make_batch, train_step)
from jaxrl_cache.rollout import core
from tests.helpers import CONFIG, own_version_logprobs, scale_matrices, varied_params
from tests.test_engine_interrupts import _run_with_interrupt_at

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


def fault():
    raise RuntimeError("injected")


class FaultyDecode:
    """`with FaultyDecode(k):` core.decode_chunk raises on its k-th call (inside the lock)."""

    def __init__(self, at):
        self.at, self.real = at, core.decode_chunk

    def __enter__(self):
        calls = []

        def decode(*args, **kwargs):
            calls.append(1)
            if len(calls) == self.at:
                fault()
            return self.real(*args, **kwargs)

        core.decode_chunk = decode

    def __exit__(self, *exc):
        core.decode_chunk = self.real


class AsyncMachine(RuleBasedStateMachine):
    @initialize(policy=st.sampled_from(["recompute", "keep"]))
    def setup(self, policy):
        self.policy = policy
        self.engine = Scripted(CONFIG, CacheConfig(num_pages=48, page_size=4),
                               scheduler_config=SchedulerConfig(max_num_seqs=4, chunk_steps=3),
                               backend="xla", kv_policy=policy, max_policy_lag=LAG)
        self.state = TrainState.create(varied_params(0), config=CONFIG, lr_schedule=1e-2)
        self.params_by_version = {0: self.state.params}
        self.worker = RolloutWorker(self.engine, None, SP, SampleBuffer(1, LAG),
                                    rng=jax.random.key(0))  # driven by hand, never started
        self.worker.publish(self.state.params, 0)
        self.acked = [0]
        self.pending = []  # finished rollout batches not trained on yet
        self.key = 0

    def _train(self):
        """One train step on the pending batches (or an untrained version bump)."""
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
        self.params_by_version[int(self.state.version)] = self.state.params

    def _train_and_sync(self):
        self._train()
        version = int(self.state.version)
        ack = self.worker.publish(self.state.params, version)
        assert ack.version == version > ack.previous_version
        assert all(v >= version - LAG for v in ack.cached_versions)
        self.acked.append(version)

    def _worker_call(self, picks):
        """The worker's next call (its loop, one call, in this thread); a watchdog stops it
        rather than let a wedged worker hang the test."""
        self.key += 1
        watchdog = threading.Timer(120, self.worker.stop)
        watchdog.start()
        try:
            return self.worker._rollout([PROMPTS[i] for i in picks], jax.random.key(self.key))
        finally:
            watchdog.cancel()

    @rule(picks=st.lists(st.sampled_from(range(len(PROMPTS))), min_size=1, max_size=3),
          updates=st.lists(st.booleans(), max_size=6))
    def rollout(self, picks, updates):
        self.engine.script = [self._train_and_sync if u else None for u in updates]
        start = self.engine.version
        batch = self._worker_call(picks)
        assert batch is not None and batch.version == start  # the engine's version, adopted
        for s in batch.samples:
            versions = s.token_versions.tolist()
            assert versions == sorted(versions) and start <= versions[0]
            assert versions[-1] <= self.engine.version
            expected = own_version_logprobs(s, self.params_by_version, SP)
            check = np.ones(len(versions), bool) if s.mixed_tokens is None else ~s.mixed_tokens
            if self.policy == "recompute":
                assert s.mixed_tokens is None
            # exact numerics: bits, not a tolerance (recomputed prefixes included)
            np.testing.assert_array_equal(s.output_logprobs[check], expected[check])
        report = audit_attribution(batch, self.params_by_version, CONFIG)
        assert report.ok, report
        if self.policy == "recompute":
            assert report.num_mixed_tokens == 0
            assert report.num_checked_tokens == batch.generated_tokens
        self.pending.append(batch)

    @rule()
    def train_between_calls(self):
        self._train_and_sync()

    @rule(at=st.integers(1, 160))
    def publish_interrupted(self, at):
        """Train, then publish with a Ctrl-C at traced line `at` (beyond the last: none)."""
        self._train()
        version, before = int(self.state.version), self.engine.version
        try:
            _run_with_interrupt_at(lambda: self.worker.publish(self.state.params, version), at)
        except KeyboardInterrupt:
            pass
        assert self.engine.version in (before, version)
        assert not self.engine._lock.locked() and not self.worker._cond._is_owned()
        if self.engine.version == version:
            self.acked.append(version)

    @rule(newer=st.booleans(), in_decode=st.booleans(), fault_at=st.integers(0, 3),
          updates=st.lists(st.booleans(), max_size=3))
    def failing_call(self, newer, in_decode, fault_at, updates):
        """A call that fails (fault_at-th step boundary, or decode chunk) after `updates`:
        at the current version (the worker's) or at a newer one (never committed)."""
        script = [self._train_and_sync if u else None for u in updates]
        if not in_decode:
            script = (script + [None] * fault_at)[:fault_at] + [fault]
        self.engine.script = script
        with FaultyDecode(fault_at + 1 if in_decode else 0), \
                pytest.raises(RuntimeError, match="injected"):
            if newer:
                version = self.engine.version + 50  # far ahead: a wrong commit shows at once
                candidate = scale_matrices(self.params_by_version[self.engine.version], 1.1)
                self.key += 1
                self.engine.rollout(candidate, version, [PROMPTS[0]], SP,
                                    rng=jax.random.key(self.key))
            else:
                self._worker_call([0, 1])
        self.engine.script = []
        assert self.engine.version == self.acked[-1]  # only syncs that landed mid-call

    @invariant()
    def no_leak_and_versions_forward(self):
        if not hasattr(self, "engine"):
            return
        cache = self.engine.cache
        cache.check_invariants()
        assert self.engine._active is None
        assert cache.pool.num_free + int(cache._in_trie.sum()) == cache.pool.num_pages - 1
        assert self.acked == sorted(self.acked) and self.engine.version == self.acked[-1]
        assert all(self.engine.version - LAG <= v <= self.engine.version
                   for v in cache.versions())


TestAsyncMachine = AsyncMachine.TestCase
TestAsyncMachine.settings = settings(max_examples=4, stateful_step_count=4, deadline=None)
