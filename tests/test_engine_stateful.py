"""Engine-level property test: random rollouts, syncs, stale calls and injected failures.

After every step: page accounting balances with nothing in use, only the current version has
prefix entries, and every sample carries the version it was generated at.
"""
import jax
import pytest
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from jaxrl_cache.rollout import core as rollout_core
from jaxrl_cache.rollout import CacheConfig, RolloutEngine
from jaxrl_cache.errors import VersionError
from jaxrl_cache.rollout.sampling import SamplingParams
from tests.helpers import CONFIG, varied_params

SYSTEM = list(range(10, 26))  # one shared page
PROMPTS = [SYSTEM + [1, 2, 3], SYSTEM + [4, 5], SYSTEM + list(range(30, 40)), [7, 8, 9]]
SP = SamplingParams(n=2, max_new_tokens=3, temperature=1.0)
PARAMS = [varied_params(s) for s in range(3)]


def _common_prefix(a, b) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class EngineMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.engine = RolloutEngine(CONFIG, CacheConfig(num_pages=40, page_size=8))
        self.params = PARAMS[0]
        self.engine.sync_weights(self.params, 0)
        self.fresh = True  # no rollout since the last sync
        self.key = 0

    def _rollout(self, prompts):
        self.key += 1
        return self.engine.rollout(self.params, self.engine.version, prompts, SP,
                                   rng=jax.random.key(self.key))

    @rule(picks=st.lists(st.sampled_from(range(len(PROMPTS))), min_size=1, max_size=2))
    def rollout(self, picks):
        batch = self._rollout([PROMPTS[i] for i in picks])
        assert {s.behavior_version for s in batch.samples} == {self.engine.version}
        if self.fresh:  # hits may only come from earlier prompts of this very call
            prompts = [PROMPTS[i] for i in picks]
            for s in batch.samples:
                earlier = [_common_prefix(s.prompt_ids[:-1], p) for p in prompts[:s.group]]
                assert s.cached_tokens <= max(earlier, default=0) // 8 * 8, (
                    "KV reused across a weight sync")
        self.fresh = False

    @rule(which=st.integers(0, 2))
    def sync(self, which):
        self.params = PARAMS[which]
        ack = self.engine.sync_weights(self.params, self.engine.version + 1)
        assert ack.cached_versions == ()
        self.fresh = True

    @rule()
    def stale_rollout_is_refused(self):
        if self.engine.version == 0:
            return
        before = self.engine.cache_stats()
        with pytest.raises(VersionError):
            self.engine.rollout(self.params, self.engine.version - 1, PROMPTS[:1], SP,
                                rng=jax.random.key(0))
        assert self.engine.cache_stats() == before

    @rule()
    def failing_rollout(self):
        real = rollout_core.decode_chunk

        def broken(*args, **kwargs):
            jax.block_until_ready(real(*args, **kwargs))
            raise RuntimeError("injected")

        rollout_core.decode_chunk = broken
        try:
            with pytest.raises(RuntimeError, match="injected"):
                self._rollout(PROMPTS[:2])
        finally:
            rollout_core.decode_chunk = real

    @invariant()
    def consistent(self):
        s = self.engine.cache_stats()
        self.engine.cache.check_invariants()
        assert s.in_use_pages == 0
        assert s.free_pages + s.cached_pages == s.total_pages
        assert set(self.engine.cache.versions()) <= {self.engine.version}


EngineMachine.TestCase.settings = settings(max_examples=8, stateful_step_count=10,
                                           deadline=None)
TestEngineMachine = EngineMachine.TestCase
