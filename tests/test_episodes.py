"""Multi-turn episodes (RolloutEngine.rollout_episodes): each turn against a dense greedy
reference over the whole history, prefix reuse across turns, records, limits, environment
faults, slow environments, and versions across turns in the asynchronous modes."""
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_cache import CacheConfig, RolloutEngine, SamplingParams, SchedulerConfig
from jaxrl_cache.errors import CacheFullError
from jaxrl_cache.rollout.env import EnvStep
from tests.helpers import CONFIG, dense_greedy, dense_logits, own_version_logprobs, varied_params

PARAMS = [varied_params(s) for s in range(3)]
PS = 4
SCHED = SchedulerConfig(max_num_seqs=4, chunk_steps=4, max_prefill_tokens=256)
GREEDY = SamplingParams(n=2, max_new_tokens=5, temperature=0.0)
TASKS = [(1, 2, 3, 4, 5, 6, 7, 8, 9), (1, 2, 3, 4, 5, 6, 7, 8, 20, 21, 22)]


def observation(action) -> list[int]:
    """The reference environment's answer to a turn (token ids): depends on the turn."""
    return [1 + sum(action) % 40, 3, 1 + len(action)]


class TokenEnv:
    """Token-id environment: answers `turns - 1` turns, then ends; reward = tokens of the
    turn. `delay` seconds per step; `fail_on` = the step index that raises."""

    def __init__(self, task, turns=3, delay=0.0, fail_on=None):
        self.task, self.turns, self.delay, self.fail_on = task, turns, delay, fail_on
        self.steps = 0

    def reset(self):
        return list(self.task)

    def step(self, action):
        time.sleep(self.delay)
        self.steps += 1
        if self.steps == self.fail_on:
            raise RuntimeError("tool crashed")
        done = self.steps >= self.turns
        return EnvStep(None if done else observation(action), float(len(action)), done)


def make_engine(policy="wait", pages=128, sched=SCHED, **kw):
    engine = RolloutEngine(CONFIG, CacheConfig(num_pages=pages, page_size=PS),
                           scheduler_config=sched, backend="xla", kv_policy=policy, **kw)
    engine.sync_weights(PARAMS[0], 0)
    return engine


def assert_clean(engine):
    engine.cache.check_invariants()
    s = engine.cache_stats()
    assert s.in_use_pages == 0 and engine._active is None


def reference_episode(params, task, turns, max_new):
    """Dense greedy over the whole history, turn by turn: (tokens after the prompt, mask)."""
    history, tokens, mask = list(task), [], []
    for t in range(turns):
        out, _ = dense_greedy(params, CONFIG, history, max_new)
        history += out
        tokens += out
        mask += [True] * len(out)
        if t < turns - 1:
            obs = observation(out)
            history += obs
            tokens += obs
            mask += [False] * len(obs)
    return tokens, mask


def test_greedy_episodes_match_dense_reference_and_reuse_the_history():
    engine = make_engine()
    batch = engine.rollout_episodes(PARAMS[0], 0, TASKS, TokenEnv, GREEDY,
                                    rng=jax.random.key(0))
    assert [e.index for e in batch.episodes] == [0, 1, 2, 3]
    assert [e.group for e in batch.episodes] == [0, 0, 1, 1]
    for e in batch.episodes:
        tokens, mask = reference_episode(PARAMS[0], TASKS[e.group], 3, 5)
        assert e.prompt_ids == TASKS[e.group]
        assert list(e.token_ids) == tokens and e.loss_mask.tolist() == mask
        assert e.finish_reason == "done" and e.rewards == (5.0, 5.0, 5.0) and e.reward == 15
        assert e.turns == ((0, 5), (8, 13), (16, 21)) and e.error is None
        assert (e.token_versions == 0).all() and e.kv_versions == (0,)
        assert (e.logprobs[~e.loss_mask] == 0).all()
        # recorded log-probs are the sampler's at every sampled token, teacher-forced
        sample = e.as_sample()
        want = own_version_logprobs(sample, {0: PARAMS[0]}, GREEDY)
        np.testing.assert_allclose(e.logprobs[e.loss_mask], want[e.loss_mask], atol=2e-3)
        assert sample.loss_mask is e.loss_mask and sample.output_ids == e.token_ids
    # every later turn's context up to the new observation was seen by the previous turn;
    # all but its last partial page came from the cache
    # (turn 1: prompt + turn 0; turn 2: + observation + turn 1; task 1's prompt is 2 longer)
    assert batch.history_tokens == 2 * (14 + 22) + 2 * (16 + 24)
    # at most the last partial page and the last output token of each are recomputed
    assert batch.history_cached >= batch.history_tokens - 4 * 2 * PS
    assert batch.env_steps == 12 and batch.generated_tokens == 4 * 15
    assert_clean(engine)


def test_history_reuse_counts_exactly():
    """One episode, page-aligned turns: the next turn's context reuses every full page the
    previous row wrote (prompt + turn output but its last token)."""
    engine = make_engine()
    sampling = SamplingParams(n=1, max_new_tokens=5, temperature=0.0)
    batch = engine.rollout_episodes(PARAMS[0], 0, [TASKS[0]], TokenEnv, sampling,
                                    rng=jax.random.key(0))
    (e,) = batch.episodes
    # turn 1 context: 9 + 5 + 3 = 17 tokens; the previous row wrote KV of 9 + 4 = 13
    # tokens: 3 full pages (12 tokens) cached. turn 2: 17 + 5 + 3 = 25; written 17 + 4 = 21:
    # 5 full pages (20 tokens).
    assert batch.history_tokens == 14 + 22 and batch.history_cached == 12 + 20
    assert e.cached_tokens == 0 + 12 + 20
    assert_clean(engine)


def test_limits_end_episodes():
    engine = make_engine()
    turns = engine.rollout_episodes(PARAMS[0], 0, TASKS, lambda t: TokenEnv(t, turns=9),
                                    GREEDY, rng=jax.random.key(0), max_turns=2)
    assert {e.finish_reason for e in turns.episodes} == {"max_turns"}
    assert all(len(e.turns) == 2 and len(e.rewards) == 2 for e in turns.episodes)
    budget = engine.rollout_episodes(PARAMS[0], 0, [TASKS[0]], lambda t: TokenEnv(t, turns=9),
                                     GREEDY, rng=jax.random.key(0), max_episode_tokens=24)
    for e in budget.episodes:
        assert e.finish_reason == "token_budget"
        assert len(e.prompt_ids) + len(e.token_ids) <= 24
        assert e.loss_mask[-1]  # the sequence ends with sampled tokens, never an observation
    # 9 + 5 + 3 + 5 = 22 tokens; the next observation (3) leaves no room for a token
    assert [len(e.token_ids) for e in budget.episodes] == [13, 13]
    assert [len(e.turns) for e in budget.episodes] == [2, 2]
    assert_clean(engine)


def test_an_environment_fault_ends_only_its_episode():
    def factory(task):
        return TokenEnv(task, fail_on=2 if task == TASKS[1] else None)

    engine = make_engine()
    batch = engine.rollout_episodes(PARAMS[0], 0, TASKS, factory, GREEDY,
                                    rng=jax.random.key(0))
    ok, bad = batch.episodes[:2], batch.episodes[2:]
    assert all(e.finish_reason == "done" and len(e.turns) == 3 for e in ok)
    for e in bad:
        assert e.finish_reason == "error" and "tool crashed" in e.error
        assert len(e.turns) == 2 and e.rewards == (5.0,)

    class BadReset:
        def __init__(self, task):
            raise ValueError("no such task")

    failed = engine.rollout_episodes(PARAMS[0], 0, TASKS[:1], BadReset, GREEDY,
                                     rng=jax.random.key(0))
    assert [e.finish_reason for e in failed.episodes] == ["error", "error"]
    assert all("no such task" in e.error and not e.token_ids for e in failed.episodes)
    assert_clean(engine)


def test_a_stuck_environment_times_out_alone():
    """env_timeout: a step that hangs ends only its episode ("error", TimeoutError) and its
    late answer is dropped; a reset that hangs likewise; the other episodes run to the end,
    and the engine's next call is clean."""
    release = threading.Event()

    class Stuck(TokenEnv):
        def step(self, action):
            if self.task == TASKS[1] and self.steps == 1:
                release.wait(30)  # the second step of task 1 hangs until released
            return super().step(action)

    engine = make_engine()
    batch = engine.rollout_episodes(PARAMS[0], 0, TASKS, Stuck, GREEDY, rng=jax.random.key(0),
                                    env_timeout=0.5)
    release.set()
    ok, stuck = batch.episodes[:2], batch.episodes[2:]
    assert all(e.finish_reason == "done" and len(e.turns) == 3 for e in ok)
    for e in stuck:
        assert e.finish_reason == "error" and "TimeoutError" in e.error
        assert "step after turn 2" in e.error and "env_timeout" in e.error
        assert len(e.turns) == 2 and e.rewards == (5.0,)  # the late third answer dropped
    assert_clean(engine)

    class SlowReset(TokenEnv):
        def reset(self):
            time.sleep(2.0)
            return super().reset()

    late = engine.rollout_episodes(PARAMS[0], 0, TASKS[:1], SlowReset, GREEDY,
                                   rng=jax.random.key(0), env_timeout=0.2)
    assert all(e.finish_reason == "error" and "reset" in e.error and not e.token_ids
               for e in late.episodes)
    again = engine.rollout_episodes(PARAMS[0], 0, TASKS, TokenEnv, GREEDY,
                                    rng=jax.random.key(0))
    assert [e.finish_reason for e in again.episodes] == ["done"] * 4
    for bad, error in ((0, ValueError), (-1.0, ValueError), (float("nan"), ValueError),
                       ("1", TypeError)):
        with pytest.raises(error, match="env_timeout"):
            engine.rollout_episodes(PARAMS[0], 0, TASKS, TokenEnv, GREEDY,
                                    rng=jax.random.key(0), env_timeout=bad)
    assert_clean(engine)


def test_an_answer_in_time_is_not_timed_out_by_a_busy_engine(monkeypatch):
    """env_timeout judges when the environment answered, not when the engine got to the
    answer: task 1's environment answers in 0.05 s of its 0.3 s, while the engine is inside
    a 0.6 s decode chunk of task 0's next turn (a compile, a loaded machine), and its
    episodes still finish. Before, the deadline was checked ahead of the answers waiting
    in the queue and ended them (a flaky CI failure of test_episodes_stateful)."""
    from jaxrl_cache.rollout import runner
    decode = runner.Runner.decode

    def slow_decode(self, *args, **kwargs):
        time.sleep(0.6)
        return decode(self, *args, **kwargs)

    class Late(TokenEnv):
        def step(self, action):
            if self.task == TASKS[1]:
                time.sleep(0.05)
            return super().step(action)

    monkeypatch.setattr(runner.Runner, "decode", slow_decode)
    engine = make_engine()
    batch = engine.rollout_episodes(PARAMS[0], 0, TASKS, Late, GREEDY,
                                    rng=jax.random.key(0), env_timeout=0.3)
    assert [e.finish_reason for e in batch.episodes] == ["done"] * 4, \
        [e.error for e in batch.episodes]
    assert_clean(engine)


@pytest.mark.parametrize("observation_value, message", [
    ([99], "token ids"), ("text", "tokenizer"), (3.5, "text or token ids")])
def test_invalid_observations_are_episode_errors(observation_value, message):
    class Env(TokenEnv):
        def step(self, action):
            return EnvStep(observation_value, 0.0, False)

    batch = make_engine().rollout_episodes(PARAMS[0], 0, TASKS[:1], Env, GREEDY,
                                           rng=jax.random.key(0))
    assert all(e.finish_reason == "error" and message in e.error for e in batch.episodes)


def test_bad_arguments_raise_before_any_work():
    engine = make_engine()
    calls = []

    def factory(task):
        calls.append(task)
        return TokenEnv(task)

    for kwargs, error in [(dict(tasks=[]), TypeError), (dict(env_factory=3), TypeError),
                          (dict(max_turns=0), ValueError),
                          (dict(max_episode_tokens=CONFIG.max_seq_len + 1), ValueError),
                          (dict(sampling="greedy"), TypeError)]:
        args = dict(tasks=TASKS, env_factory=factory, sampling=GREEDY, max_turns=3)
        args.update(kwargs)
        with pytest.raises(error):
            engine.rollout_episodes(PARAMS[0], 0, args.pop("tasks"), args.pop("env_factory"),
                                    args.pop("sampling"), rng=jax.random.key(0), **args)
    small = make_engine(pages=8)
    with pytest.raises(CacheFullError, match="max_episode_tokens"):
        small.rollout_episodes(PARAMS[0], 0, TASKS, factory, GREEDY, rng=jax.random.key(0))
    assert calls == []


def test_slow_environments_do_not_change_episodes_and_overlap_decoding():
    engine = make_engine()
    sampling = SamplingParams(n=4, max_new_tokens=5, temperature=1.0)
    fast = engine.rollout_episodes(PARAMS[0], 0, TASKS, TokenEnv, sampling,
                                   rng=jax.random.key(3))
    slow = engine.rollout_episodes(PARAMS[0], 0, TASKS, lambda t: TokenEnv(t, delay=0.05),
                                   sampling, rng=jax.random.key(3))
    for a, b in zip(fast.episodes, slow.episodes):
        assert a.token_ids == b.token_ids  # each turn's PRNG stream is its own
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-4)
    assert slow.env_seconds >= 0.05 * slow.env_steps
    assert_clean(engine)


class ForcedUpdates(RolloutEngine):
    """Syncs PARAMS[v] as version v at the step boundaries in `updates` {step: version}."""

    def __init__(self, *args, updates=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.updates, self.step_index = dict(updates or {}), 0

    def _between_steps(self, run):
        version = self.updates.pop(self.step_index, None)
        self.step_index += 1
        if version is not None:
            self.sync_weights(PARAMS[version], version)


@pytest.mark.parametrize("delay", [0.0, 0.03])
def test_recompute_each_sampled_token_follows_its_own_version(delay):
    """Updates land inside turns and between them (slow environments): every sampled token's
    logits and all the KV it saw come from its own version."""
    engine = ForcedUpdates(CONFIG, CacheConfig(num_pages=128, page_size=PS),
                           scheduler_config=SCHED, backend="xla", kv_policy="recompute",
                           updates={2: 1, 5: 2})
    engine.sync_weights(PARAMS[0], 0)
    sampling = SamplingParams(n=2, max_new_tokens=6, temperature=0.0)
    batch = engine.rollout_episodes(PARAMS[0], 0, TASKS, lambda t: TokenEnv(t, delay=delay),
                                    sampling, rng=jax.random.key(0))
    assert batch.weight_updates == 2 and engine.version == 2
    assert batch.recomputed_tokens > 0
    by_version = dict(enumerate(PARAMS))
    for e in batch.episodes:
        versions = e.token_versions[e.loss_mask].tolist()
        assert versions == sorted(versions) and e.mixed_tokens is None
        seq = list(e.prompt_ids)
        for tok, sampled, v in zip(e.token_ids, e.loss_mask, e.token_versions):
            if sampled:
                assert tok == int(jnp.argmax(dense_logits(PARAMS[v], CONFIG, seq)[-1]))
            seq.append(tok)
        want = own_version_logprobs(e.as_sample(), by_version, sampling)
        np.testing.assert_allclose(e.logprobs[e.loss_mask], want[e.loss_mask], atol=2e-3)
    assert_clean(engine)


def test_keep_flags_tokens_over_old_kv_within_a_turn():
    engine = ForcedUpdates(CONFIG, CacheConfig(num_pages=128, page_size=PS),
                           scheduler_config=SchedulerConfig(max_num_seqs=4, chunk_steps=2),
                           backend="xla", kv_policy="keep", updates={2: 1})
    engine.sync_weights(PARAMS[0], 0)
    sampling = SamplingParams(n=2, max_new_tokens=6, temperature=0.0)
    batch = engine.rollout_episodes(PARAMS[0], 0, TASKS, TokenEnv, sampling,
                                    rng=jax.random.key(0))
    flagged = [e for e in batch.episodes if e.mixed_tokens is not None]
    assert flagged, "an update inside a turn must flag the tokens that saw old KV"
    for e in flagged:
        assert not e.mixed_tokens[~e.loss_mask].any()  # observations are never flagged
        assert (e.token_versions[e.mixed_tokens] == 1).all()
    assert_clean(engine)


def test_text_environment_with_a_tokenizer():
    """The engine decodes each turn for the environment and encodes its text answers."""
    from jaxrl_cache.app.tasks import char_tokenizer
    tok = char_tokenizer()
    config = CONFIG.__class__.tiny(vocab_size=tok.vocab_size, max_seq_len=96)
    params = varied_params(0, config)
    seen = []

    class Echo:
        def __init__(self, task):
            self.task, self.n = task, 0

        def reset(self):
            return self.task

        def step(self, action):
            seen.append(action)
            self.n += 1
            return EnvStep(f"<{len(action)}>", 1.0, self.n >= 2)

    engine = RolloutEngine(config, CacheConfig(num_pages=64, page_size=PS),
                           scheduler_config=SCHED, backend="xla", tokenizer=tok)
    sampling = SamplingParams(n=1, max_new_tokens=4, temperature=0.0)
    batch = engine.rollout_episodes(params, 0, ["q:12*34="], Echo, sampling,
                                    rng=jax.random.key(0))
    (e,) = batch.episodes
    assert e.prompt_ids == tuple(tok.encode("q:12*34="))
    assert list(e.turn_texts) == seen and len(seen) == 2
    start, end = e.turns[0]
    assert tok.decode(e.token_ids[start:end]) == seen[0]
    assert tok.decode(e.token_ids[end:e.turns[1][0]]) == f"<{len(seen[0])}>"
    assert e.reward == 2.0


@pytest.mark.parametrize("mode", [pytest.param("sync", marks=pytest.mark.slow), "async"])
def test_grpo_steps_on_episodes(mode):
    """The library loop trains on episode calls (rewards from the environments), audits
    every sampled token, and advances one version per update, in both modes."""
    from jaxrl_cache import TrainState
    from jaxrl_cache.rl.loop import AsyncRollouts, PolicyHistory, SyncRollouts, grpo_step
    from jaxrl_cache.rl.train_config import TrainConfig

    class Varied(TokenEnv):
        def step(self, action):  # a reward that differs within a group
            out = super().step(action)
            return EnvStep(out.observation, float(action[0] % 3), out.done)

    engine = make_engine("wait" if mode == "sync" else "recompute")
    state = TrainState.create(PARAMS[0], config=CONFIG, lr_schedule=1e-2)
    sampling = SamplingParams(n=2, max_new_tokens=4, temperature=1.0)
    episodes = dict(env_factory=Varied, max_turns=2)
    source = lambda call: (TASKS, None)  # noqa: E731
    if mode == "sync":
        rollouts = SyncRollouts(engine, source, sampling, calls=1, key=jax.random.key(0),
                                episodes=episodes)
    else:
        rollouts = AsyncRollouts(engine, source, sampling, calls=1, max_policy_lag=1,
                                 key=jax.random.key(0), state=state, episodes=episodes)
    history = PolicyHistory(0 if mode == "sync" else 1)
    history.add(0, state.params)
    try:
        for step in range(2):
            result = grpo_step(step, state, rollouts, None, decode=str, history=history,
                               train=TrainConfig(mini_batches=2))
            state = result.state
            rec = result.record
            assert rec["episodes"] == 4 and rec["audit_failed"] == 0
            assert rec["audited_samples"] == 4 and rec["updates"] == 2
            assert rec["audit_checked_tokens"] == rec["generated_tokens"] > 0
            episodes = result.texts  # health fields count each episode's sampled tokens
            assert rec["groups"] == len(TASKS) and rec["entropy"] > 0
            assert rec["completion_length_max"] == max(e.sampled_tokens for _, e, _ in episodes)
            assert rec["truncated_fraction"] == np.mean([e.finish_reason == "token_budget"
                                                         for _, e, _ in episodes])
    finally:
        rollouts.close()
    assert int(state.version) == 4 and engine.version == 4
    assert_clean(engine)


@pytest.mark.parametrize("lag", [0, 1])
def test_keep_between_turns_continues_over_old_kv_inside_the_lag_window(lag):
    """kv_policy "keep", an update while every environment thinks (after turn 0): with the
    old version still cached (lag 1) turn 1 continues over turn 0's KV and all its tokens
    are flagged; with lag 0 that KV is gone and turn 1 re-prefills under the new version
    (nothing flagged, each token reproduces under its own version)."""
    class AfterFirstTurns(RolloutEngine):
        """Syncs version 1 at the first step boundary where every episode has finished turn
        0 and nothing decodes (all environments thinking): never inside a turn."""

        def _between_steps(self, run):
            if self.version == 0 and run.idle and all(
                    len(st.turns) == 1 for st in run.episodes.states):
                self.sync_weights(PARAMS[1], 1)

    engine = AfterFirstTurns(CONFIG, CacheConfig(num_pages=128, page_size=PS),
                             scheduler_config=SchedulerConfig(max_num_seqs=4, chunk_steps=4),
                             backend="xla", kv_policy="keep", max_policy_lag=lag)
    engine.sync_weights(PARAMS[0], 0)
    sampling = SamplingParams(n=2, max_new_tokens=4, temperature=0.0)
    batch = engine.rollout_episodes(PARAMS[0], 0, TASKS,
                                    lambda t: TokenEnv(t, turns=2, delay=0.5), sampling,
                                    rng=jax.random.key(0))
    assert batch.weight_updates == 1
    for e in batch.episodes:
        (a0, b0), (a1, b1) = e.turns
        assert (e.token_versions[a0:b0] == 0).all() and (e.token_versions[a1:b1] == 1).all()
        if lag:
            assert e.mixed_tokens is not None and e.mixed_tokens[a1:b1].all()
            assert not e.mixed_tokens[:a1].any() and e.kv_versions == (0, 1)
        else:
            assert e.mixed_tokens is None
            want = own_version_logprobs(e.as_sample(), dict(enumerate(PARAMS)), sampling)
            np.testing.assert_allclose(e.logprobs[e.loss_mask], want[e.loss_mask], atol=2e-3)
    assert (batch.recomputed_tokens > 0) == (lag == 0)
    assert_clean(engine)


@pytest.mark.parametrize("raised", [SystemExit, KeyboardInterrupt, GeneratorExit, "no step"])
def test_a_base_exception_or_a_missing_method_ends_only_its_episode(raised):
    """Environment code that raises SystemExit (a tool calling exit()), KeyboardInterrupt or
    another BaseException, or an environment without step(): only its episode ends, with the
    reason; the call returns and the other episodes finish (issue 32, defects 4-5)."""
    class Faulty(TokenEnv):
        def step(self, action):
            if self.task == TASKS[1]:
                raise raised("tool said goodbye")
            return super().step(action)

    class NoStep:
        def __init__(self, task):
            self.task = task

        def reset(self):
            return list(self.task)

    def factory(task):
        if raised == "no step":
            return NoStep(task) if task == TASKS[1] else TokenEnv(task)
        return Faulty(task)

    engine = make_engine()
    batch = engine.rollout_episodes(PARAMS[0], 0, TASKS, factory, GREEDY,
                                    rng=jax.random.key(0))
    ok, bad = batch.episodes[:2], batch.episodes[2:]
    assert all(e.finish_reason == "done" and len(e.turns) == 3 for e in ok)
    name = "AttributeError" if raised == "no step" else raised.__name__
    for e in bad:
        assert e.finish_reason == "error" and e.error.startswith(name), e.error
        assert len(e.turns) == 1
    assert_clean(engine)


HUNG_SCRIPT = """
import threading, jax
from jaxrl_cache import CacheConfig, RolloutEngine, SamplingParams
from tests.helpers import CONFIG, varied_params

class Hung:
    def __init__(self, task):
        self.task = task
    def reset(self):
        if self.task == (4, 5):
            threading.Event().wait()  # never returns
        return list(self.task)
    def step(self, action):
        threading.Event().wait()  # never returns

engine = RolloutEngine(CONFIG, CacheConfig(num_pages=64, page_size=4))
batch = engine.rollout_episodes(varied_params(0), 0, [(1, 2, 3), (4, 5)], Hung,
                                SamplingParams(n=2, max_new_tokens=3, temperature=0.0),
                                rng=jax.random.key(0), env_timeout=0.3)
print("returned", [e.finish_reason for e in batch.episodes], flush=True)
"""


def test_a_hung_environment_never_holds_the_process():
    """env_timeout ends the episodes whose reset or step never returns and the call
    returns; the threads parked in the environment are daemons, so the script then exits at
    once (it used to hang at interpreter exit joining the environment pool: issue 32,
    defect 1)."""
    import os
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get(
        "PYTHONPATH")])))
    proc = subprocess.Popen([sys.executable, "-c", HUNG_SCRIPT], cwd=root, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    watchdog = threading.Timer(240, proc.kill)  # a call that never returns fails, too
    watchdog.start()
    try:
        line = proc.stdout.readline()  # the call returned (after import and compile)
        assert line.strip() == "returned ['error', 'error', 'error', 'error']", \
            line + proc.stderr.read()[-2000:]
        assert proc.wait(timeout=30) == 0  # then the interpreter exits: nothing joins
    finally:
        watchdog.cancel()
        proc.kill()
        proc.wait()


def test_a_real_ctrl_c_stops_the_call_while_environments_think():
    """A real SIGINT (to the process) while every environment is busy stops the call with
    KeyboardInterrupt, even without env_timeout; the engine is clean and runs again."""
    import os
    import signal
    release, started = threading.Event(), threading.Event()

    class Slow(TokenEnv):
        def step(self, action):
            started.set()
            release.wait(30)
            return super().step(action)

    engine = make_engine()
    timer = threading.Thread(target=lambda: started.wait(30) and (
        time.sleep(0.1), os.kill(os.getpid(), signal.SIGINT)))
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            engine.rollout_episodes(PARAMS[0], 0, TASKS, Slow, GREEDY, rng=jax.random.key(0))
    finally:
        release.set()
        timer.join()
    assert_clean(engine)
    again = engine.rollout_episodes(PARAMS[0], 0, TASKS, TokenEnv, GREEDY,
                                    rng=jax.random.key(0))
    assert [e.finish_reason for e in again.episodes] == ["done"] * 4


class _Raising:
    """An object whose every use raises `error` (environment code on whatever thread
    touches it)."""

    def __init__(self, error):
        self.error = error

    def __len__(self):
        raise self.error("from the observation")

    def __iter__(self):
        raise self.error("from the observation")

    def __bool__(self):
        raise self.error("from the observation")


@pytest.mark.parametrize("where", ["observation", "done", "reward"])
@pytest.mark.parametrize("raised", [KeyboardInterrupt, SystemExit])
def test_what_an_environment_returns_is_its_code_too(where, raised):
    """An EnvStep whose observation, done flag or reward runs code that raises a
    BaseException (a lazy sequence, an object's __bool__): only that episode ends, with the
    reason; the engine's thread never runs environment code, so it never mistakes this for
    a real Ctrl-C (issue 32, defect 5)."""
    class Sneaky(TokenEnv):
        def step(self, action):
            if self.task != TASKS[1]:
                return super().step(action)
            bad = _Raising(raised)
            return {"observation": EnvStep(bad, 1.0, False), "done": EnvStep([3], 1.0, bad),
                    "reward": EnvStep([3], _Real(raised), False)}[where]

    batch = make_engine().rollout_episodes(PARAMS[0], 0, TASKS, Sneaky, GREEDY,
                                           rng=jax.random.key(0))
    ok, bad = batch.episodes[:2], batch.episodes[2:]
    assert all(e.finish_reason == "done" and len(e.turns) == 3 for e in ok)
    assert all(e.finish_reason == "error" and e.error.startswith(raised.__name__) and
               len(e.turns) == 1 for e in bad), [e.error for e in bad]


class _Real(float):
    """A numbers.Real whose conversion to float raises."""

    def __new__(cls, error):
        self = super().__new__(cls, 1.0)
        self.error = error
        return self

    def __float__(self):
        raise self.error("from the reward")


def test_a_huge_integer_reward_ends_only_its_episode():
    """reward=10**400 (past the float range) is an invalid answer: its episode ends with a
    ValueError naming the reward (issue 32, defect 7)."""
    class Huge(TokenEnv):
        def step(self, action):
            return EnvStep(None, 10**400 if self.task == TASKS[1] else 1.0, True)

    batch = make_engine().rollout_episodes(PARAMS[0], 0, TASKS, Huge, GREEDY,
                                           rng=jax.random.key(0))
    assert [e.finish_reason for e in batch.episodes] == ["done", "done", "error", "error"]
    assert all("reward must be finite" in e.error and "1329 bits" in e.error
               for e in batch.episodes[2:])
