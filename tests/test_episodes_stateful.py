"""Property test of multi-turn episodes: random episode calls (turn counts, slow and failing
environments) with weight syncs landing between calls, between turns and inside turns
(forced at drawn step boundaries), and calls that fail midway.

Environments fail (in reset or a step) by raising, by SystemExit or KeyboardInterrupt from
their own code, or by hanging past env_timeout; released weights are re-synced or rolled out
with other params (refused) or replaced when nothing of their version is cached.

After every call: no page leak, no entry outside the lag window, versions never go
backwards (engine, and each episode's sampled tokens), an environment fault ends only its
episode, and every sampled token's log-prob equals, bit for bit, a dense recomputation
under its own version over the whole history ("recompute" and "wait": all of them; "keep": all but the
flagged ones). Observation tokens are never sampled, flagged or stamped with a version
that did not sample the token before them.
"""
import threading
import time

import jax
import pytest
import numpy as np
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from jaxrl_cache import CacheConfig, SamplingParams, SchedulerConfig
from jaxrl_cache.errors import VersionError
from jaxrl_cache.rollout import core
from jaxrl_cache.rollout.env import EnvStep
from tests.helpers import CONFIG, own_version_logprobs, varied_params
from tests.test_async_stateful import Scripted

SYSTEM = list(range(10, 18))  # two shared pages
TASKS = [tuple(SYSTEM + [1, 2, 3]), tuple(SYSTEM + [4, 5]), (7, 8, 9, 20, 21)]
SP = SamplingParams(n=2, max_new_tokens=4, temperature=1.0)
LAG = 1


FAULTS = {"raise": RuntimeError, "exit": SystemExit, "interrupt": KeyboardInterrupt}
ENV_TIMEOUT = 1.0  # a healthy step on a loaded 2-core machine stays well under it


class Env:
    """Answers with tokens derived from the turn; `turns`, `delay`, `fail_on` (the step
    that fails) and `mode` (how: raise RuntimeError, SystemExit or KeyboardInterrupt, or
    hang past env_timeout) come from the spec the test drew for its task."""

    def __init__(self, spec):
        self.task, self.turns, self.delay, self.fail_on, self.mode = spec
        self.steps = 0

    def reset(self):
        if self.fail_on == 0:
            self._fail()
        return list(self.task)

    def step(self, action):
        time.sleep(self.delay)
        self.steps += 1
        if self.steps == self.fail_on:
            self._fail()
        done = self.steps >= self.turns
        return EnvStep(None if done else [1 + sum(action) % 40, 2], 1.0, done)

    def _fail(self):
        if self.mode == "hang":
            threading.Event().wait(3 * ENV_TIMEOUT)  # long past the timeout
        else:
            raise FAULTS[self.mode]("env fault")


class EpisodeMachine(RuleBasedStateMachine):
    @initialize(policy=st.sampled_from(["wait", "recompute", "keep"]))
    def setup(self, policy):
        self.policy = policy
        self.engine = Scripted(CONFIG, CacheConfig(num_pages=64, page_size=4),
                               scheduler_config=SchedulerConfig(max_num_seqs=4, chunk_steps=2),
                               backend="xla", kv_policy=policy, max_policy_lag=LAG)
        self.params = {0: varied_params(0)}
        self.engine.sync_weights(self.params[0], 0)
        self.acked, self.key, self.others = [0], 0, 0

    def _sync(self):
        version = self.engine.version + 1
        self.params[version] = varied_params(version)
        ack = self.engine.sync_weights(self.params[version], version)
        assert ack.version == version
        self.acked.append(version)

    @rule(specs=st.lists(st.tuples(st.sampled_from(range(len(TASKS))), st.integers(1, 3),
                                   st.sampled_from([0.0, 0.02]), st.sampled_from([None, 0, 1, 2]),
                                   st.sampled_from(["raise", "exit", "interrupt", "hang"])),
                         min_size=1, max_size=2),
          updates=st.lists(st.booleans(), max_size=6))
    def episodes(self, specs, updates):
        if self.policy != "wait":  # "wait": a sync waits for the whole call
            self.engine.script = [self._sync if u else None for u in updates]
        start = self.engine.version
        self.key += 1
        tasks = [(TASKS[t], turns, delay, fail, mode) for t, turns, delay, fail, mode in specs]
        batch = self.engine.rollout_episodes(self.params[start], start, tasks, Env, SP,
                                             rng=jax.random.key(self.key), max_turns=3,
                                             env_timeout=ENV_TIMEOUT)
        self.engine.script = []
        for e in batch.episodes:
            task, turns, _, fail, mode = tasks[e.group]
            assert e.prompt_ids == (() if fail == 0 else task)  # reset returns the prompt
            if fail is not None and fail <= turns:
                reason = "TimeoutError" if mode == "hang" else FAULTS[mode].__name__
                assert e.finish_reason == "error" and e.error.startswith(reason), e.error
                assert len(e.turns) == fail
                if not fail:  # the reset failed: nothing sampled
                    continue
            else:
                assert e.finish_reason == "done" and len(e.turns) == turns
            sampled = e.token_versions[e.loss_mask].tolist()
            assert sampled == sorted(sampled) and start <= sampled[0]
            assert sampled[-1] <= self.engine.version
            assert len(e.token_versions) == len(e.token_ids) == len(e.loss_mask)
            for (lo, hi), (nxt, _) in zip(e.turns, e.turns[1:] + ((len(e.token_ids), 0),)):
                assert e.loss_mask[lo:hi].all() and not e.loss_mask[hi:nxt].any()
                assert (e.token_versions[hi:nxt] == e.token_versions[hi - 1]).all()
            want = own_version_logprobs(e.as_sample(), self.params, SP)
            check = e.loss_mask.copy()
            if e.mixed_tokens is not None:
                assert self.policy == "keep" and not e.mixed_tokens[~e.loss_mask].any()
                check &= ~e.mixed_tokens
            np.testing.assert_array_equal(e.logprobs[check], want[check])  # exact numerics

    @rule()
    def sync_between_calls(self):
        self._sync()

    @rule(drop_kv=st.booleans())
    def release_and_resync_other_params(self, drop_kv):
        """release_weights, then other params at the synced version: refused (the version's
        weights are fixed), also with replace=True while its KV is cached; the same weights
        come back; with nothing cached, replace=True installs the others."""
        version = self.engine.version
        self.engine.release_weights(drop_kv=drop_kv)
        self.others += 1  # params never synced before (a repeat could equal the installed)
        other = varied_params(1000 + self.others)
        with pytest.raises(VersionError, match="already synced with different params"):
            self.engine.sync_weights(other, version)
        with pytest.raises(VersionError, match="already synced with different params"):
            self.engine.rollout_episodes(other, version, [(TASKS[0], 1, 0.0, None, "raise")],
                                         Env, SP, rng=jax.random.key(0))
        cached = self.engine._cache_key(version) in self.engine.cache.versions()
        if cached:
            with pytest.raises(VersionError, match="holds KV"):
                self.engine.sync_weights(other, version, replace=True)
            self.engine.sync_weights(self.params[version], version)
        else:
            assert self.engine.sync_weights(other, version, replace=True).version == version
            self.params[version] = other

    @rule(at=st.integers(1, 4), updates=st.lists(st.booleans(), max_size=3))
    def failing_call(self, at, updates):
        """A call whose at-th decode chunk fails after `updates` syncs landed (asynchronous
        modes); it commits nothing of its own and leaks nothing."""
        if self.policy != "wait":
            self.engine.script = [self._sync if u else None for u in updates]
        self.key += 1
        version, real, calls = self.engine.version, core.decode_chunk, []

        def decode(*args, **kwargs):
            calls.append(1)
            if len(calls) == at:
                raise RuntimeError("injected")
            return real(*args, **kwargs)

        core.decode_chunk = decode
        try:
            self.engine.rollout_episodes(self.params[version], version,
                                         [(TASKS[0], 3, 0.0, None, "raise")], Env, SP,
                                         rng=jax.random.key(self.key))
        except RuntimeError as e:
            assert "injected" in str(e)
        finally:
            core.decode_chunk, self.engine.script = real, []
        assert self.engine.version == self.acked[-1]

    @invariant()
    def no_leak_and_versions_forward(self):
        if not hasattr(self, "engine"):
            return
        cache = self.engine.cache
        cache.check_invariants()
        assert self.engine._active is None and self.engine.cache_stats().in_use_pages == 0
        assert self.acked == sorted(self.acked) and self.engine.version == self.acked[-1]
        assert all(self.engine.version - LAG <= v <= self.engine.version
                   for v in cache.versions())


TestEpisodeMachine = EpisodeMachine.TestCase
TestEpisodeMachine.settings = settings(max_examples=5, stateful_step_count=4, deadline=None)
