"""Property test of GRPO steps under hostile rewards and a caller that edits its LoRA base
(issue 61): random sequences of honest steps; steps whose reward raises a BaseException
subclass, hangs past its timeout or holds the GIL (on the calling thread, on reward threads
or in worker processes); and in-place edits of the numpy base of a LoRA run after a sync.

After every rule: a failed step changed nothing (the state, the engine's version, the
policy history; nothing published), an honest step trains exactly one version, and the
engine never serves another base under a synced version (a step over an edited base is
refused before any sample is scored).
"""
import threading

import jax
import numpy as np
import pytest
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from jaxrl_cache import CacheConfig, RolloutEngine, TrainState
from jaxrl_cache.errors import RewardError, VersionError
from jaxrl_cache.models import LoraConfig, init_params
from jaxrl_cache.rl.loop import PolicyHistory, SyncRollouts, grpo_step
from jaxrl_cache.rl.rewards import RewardFn
from jaxrl_cache.rollout.sampling import SamplingParams
from tests import process_rewards as pr
from tests.helpers import CONFIG
from tests.test_rewards import _hold_gil_for

PROMPTS = [list(range(1, 12)), list(range(5, 14))]
SP = SamplingParams(n=2, max_new_tokens=4, temperature=1.0)
BASE = jax.tree.map(np.array, init_params(CONFIG, jax.random.key(0)))  # writable numpy
RAISING = {"SystemExit": pr.raise_system_exit, "CancelledError": pr.raise_cancelled,
           "GeneratorExit": pr.raise_generator_exit, "Custom": pr.raise_custom,
           "KeyboardInterrupt": pr.raise_keyboard_interrupt}


def honest(meta, sample, text):
    return float(sample.output_ids[0] % 3)


def hold_the_gil(meta, sample, text):
    _hold_gil_for(0.6)
    return 0.0


def _hostile(where: str, kind: str, release: threading.Event):
    """(the reward, the error the step must raise); `release` ends a thread-mode hang."""
    if kind in RAISING:
        fn = RAISING[kind]
        error = KeyboardInterrupt if (kind, where) == ("KeyboardInterrupt", "main") else \
            RewardError
        return RewardFn(fn, concurrent=where == "thread", process=where == "process"), error
    def hang_on_a_thread(meta, sample, text):
        release.wait(3600)
        return 0.0

    fn = {("hang", "thread"): hang_on_a_thread, ("hang", "process"): pr.hangs,
          ("gil", "thread"): hold_the_gil, ("gil", "process"): pr.catastrophic_always}[
        (kind, where)]
    return RewardFn(fn, concurrent=True, process=where == "process", timeout=0.2), RewardError


class GrpoMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.base = jax.tree.map(np.copy, BASE)  # this run's base: the caller may edit it
        self.state = TrainState.create(self.base, config=CONFIG, lr_schedule=1e-2,
                                       lora=LoraConfig(rank=2, alpha=4, targets="all-linear"))
        self.engine = RolloutEngine(CONFIG, CacheConfig(num_pages=64, page_size=8))
        self.engine.sync_weights(self.state.model_params, 0)
        self.rollouts = SyncRollouts(self.engine, lambda call: (PROMPTS, None), SP, calls=1,
                                     key=jax.random.key(0))
        self.history = PolicyHistory(0)
        self.steps = 0
        self.release = threading.Event()  # frees the threads a thread-mode hang parked

    def _step(self, reward):
        return grpo_step(self.steps, self.state, self.rollouts, reward, decode=str,
                         history=self.history)

    def _unchanged_by(self, error, reward=None, match=None):
        version, leaves = int(self.state.version), jax.tree.leaves(self.state.params)
        known = set(self.history.params)
        with pytest.raises(error, match=match):
            self._step(reward if reward is not None else honest)
        assert int(self.state.version) == version == self.engine.version
        assert all(a is b for a, b in zip(jax.tree.leaves(self.state.params), leaves))
        assert set(self.history.params) == known | {version}

    @rule()
    def honest_step(self):
        result = self._step(honest)
        assert int(result.state.version) == int(self.state.version) + 1 == self.engine.version
        assert result.record["audit_failed"] == 0
        self.state, self.steps = result.state, self.steps + 1

    @rule(where=st.sampled_from(["main", "thread", "process"]),
          kind=st.sampled_from([*RAISING, "hang", "gil"]))
    def hostile_reward_step(self, where, kind):
        if kind in ("hang", "gil") and where == "main":
            return  # no timeout on the calling thread (refused at definition: test_rewards)
        reward, error = _hostile(where, kind, self.release)
        self._unchanged_by(error, reward)

    @rule(layer=st.integers(0, CONFIG.n_layers - 1), delta=st.sampled_from([1.0, -0.5]))
    def edit_the_base_in_place(self, layer, delta):
        """The caller edits the frozen base it lent (numpy, the same objects): the next
        step is refused before a sample is scored; restoring the exact bits lets it run."""
        wq = self.base["layers"]["wq"]
        value = wq[layer, 0, 0].copy()
        wq[layer, 0, 0] += delta
        try:
            self._unchanged_by((VersionError, ValueError), match="different")
        finally:
            wq[layer, 0, 0] = value

    @invariant()
    def versions_agree(self):
        assert self.engine.version == int(self.state.version) == self.steps

    def teardown(self):
        self.release.set()


GrpoMachine.TestCase.settings = settings(max_examples=5, stateful_step_count=6,
                                         deadline=None)
TestGrpoMachine = GrpoMachine.TestCase
