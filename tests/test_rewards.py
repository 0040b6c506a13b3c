"""Reward functions (rl/rewards.py): weights, None left out, batched (TRL's shape) = per
sample, concurrent calls that really overlap (barriers, not clocks), bounded threads,
timeouts, one-line errors naming the function and the sample, --reward specs, and
grpo_step training on the weighted sum / training nothing when a reward fails."""
import math
import os
import re
import sys
import threading
import time
from types import SimpleNamespace

import jax
import numpy as np
import pytest

from jaxrl_cache.errors import RewardError
from jaxrl_cache.rl.batch import make_batch
from jaxrl_cache.rl.loop import PolicyHistory, grpo_step
from jaxrl_cache.rl.rewards import RewardFn, Rewards, _outcome, batched, load_reward
from tests import process_rewards
from jaxrl_cache.rl.train import train_step

TEXTS = ["7", "12", "", "x 3", "boom", "41", "1,000", "9"]
META = ["call meta"]


def decode(ids) -> str:
    return "".join(chr(ord("a") + t) for t in ids)


def items(texts=TEXTS):
    """[(meta, sample, text)]: groups of 2, prompt ids (0, i), output ids (i,) * len."""
    return [(META, SimpleNamespace(group=i // 2, prompt_ids=(0, i), output_ids=(i,) * len(t)),
             t) for i, t in enumerate(texts)]


def length(meta, sample, text):
    return len(text)


def digits(meta, sample, text):  # None: not applicable to a text without a digit
    return sum(c.isdigit() for c in text) or None


def score(reward, texts=TEXTS):
    return Rewards.of(reward).score(3, items(texts), decode)


def test_a_plain_callable_is_one_reward_of_weight_one():
    """Today's API: the value itself, bit for bit (bools and numpy scalars too), logged by
    the function's name."""
    values = [True, np.float32(0.1), 3, -2.5, np.int64(7), 0.0, 1e30, False]
    s = score(lambda meta, sample, text: values[sample.prompt_ids[1]])
    assert s.totals == [float(v) for v in values]
    assert s.metrics["rewards/<lambda>/mean"] == pytest.approx(np.mean(values))
    assert score(length).metrics["rewards/length/std"] == pytest.approx(
        np.std([len(t) for t in TEXTS]))
    assert score(length).metrics["reward_unscored"] == 0


def test_weights_and_none():
    """Weighted sum over the functions that apply; a sample none applies to scores 0 and
    is counted; mean/std by name over the samples each applied to (NaN for none)."""
    never = RewardFn(lambda *_: None, name="never", weight=5.0)
    s = score([RewardFn(length, weight=2.0), RewardFn(digits, weight=-0.5), never])
    want = [2 * len(t) - 0.5 * (sum(c.isdigit() for c in t) or 0) for t in TEXTS]
    assert s.totals == pytest.approx(want)
    applied = [d for t in TEXTS if (d := sum(c.isdigit() for c in t))]
    assert s.metrics["rewards/digits/mean"] == pytest.approx(np.mean(applied))
    assert s.metrics["rewards/digits/std"] == pytest.approx(np.std(applied))
    assert math.isnan(s.metrics["rewards/never/mean"]) and math.isnan(
        s.metrics["rewards/never/std"])
    only = score([RewardFn(digits), never])
    assert only.totals[2] == 0.0 and only.totals[4] == 0.0
    assert only.metrics["reward_unscored"] == 2  # "" and "boom"


def test_batched_equals_per_sample_and_gets_trls_arguments():
    """The same function in both shapes gives the same rewards and metrics; a batched one
    gets TRL's keywords: prompts (a "prompt" column, else the decoded prompt ids),
    completions, completion_ids and the other columns, as lists in batch order."""
    seen = {}

    def length_batched(prompts, completions, **kwargs):  # a TRL reward, ported unchanged
        seen.update(kwargs, prompts=prompts)
        return [len(c) for c in completions]

    per_sample = score([RewardFn(length, weight=0.5), RewardFn(digits)])
    both = score([batched(length_batched, weight=0.5, name="length"),
                  batched(lambda completions, **_: [digits(None, None, c) for c in completions],
                          name="digits")])
    assert both == per_sample
    assert seen["prompts"] == [decode((0, i)) for i in range(8)]
    assert seen["completion_ids"] == [[i] * len(t) for i, t in enumerate(TEXTS)]
    assert set(seen) == {"prompts", "completion_ids", "trainer_state"}
    assert (seen["trainer_state"].global_step, seen["trainer_state"].max_steps) == (3, None)

    rows = Rewards((batched(length_batched),), columns=lambda meta, s: dict(
        prompt=f"p{s.group}", answer=s.group * 10, **({"extra": 1} if s.group == 3 else {})))
    rows.score(0, items(), decode)
    assert seen["prompts"] == [f"p{i // 2}" for i in range(8)]
    assert seen["answer"] == [i // 2 * 10 for i in range(8)]
    assert seen["extra"] == [None] * 6 + [1, 1]  # a column some rows lack: None there


def test_concurrent_calls_overlap_and_stay_within_the_workers():
    """Calls of concurrent functions run at the same time (each waits at a barrier only
    all of them together pass), at most `workers` at once; with one worker the barrier
    breaks (the calls are serial). Serial functions run on the calling thread meanwhile."""
    n = len(TEXTS)
    running, most, lock = [0], [0], threading.Lock()
    meet = threading.Barrier(4, timeout=30)

    def slow(meta, sample, text):
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        meet.wait()  # 4 calls at once, twice
        with lock:
            running[0] -= 1
        return len(text)

    s = Rewards((RewardFn(slow, concurrent=True),), workers=4).score(0, items(), decode)
    assert s.totals == [len(t) for t in TEXTS] and most[0] == 4

    pair = threading.Barrier(2, timeout=30)  # a batched and a per-sample function meet
    main = threading.current_thread()
    on_main = []

    def whole(completions, **_):
        pair.wait()
        return [1.0] * n

    def first(meta, sample, text):
        if sample.prompt_ids[1] == 0:
            pair.wait()
        return 0.0

    def serial(meta, sample, text):
        on_main.append(threading.current_thread() is main)
        return 0.0

    Rewards((batched(whole, concurrent=True), RewardFn(first, concurrent=True),
             RewardFn(serial))).score(0, items(), decode)
    assert on_main == [True] * n

    alone = threading.Barrier(2, timeout=0.5)
    with pytest.raises(RewardError, match=r"'lonely' on sample 0 \(group 0\): raised "
                                          r"BrokenBarrierError"):
        Rewards((RewardFn(lambda *_: alone.wait(), name="lonely", concurrent=True),),
                workers=1).score(0, items(), decode)


def test_a_timeout_counts_from_the_calls_start():
    """A call past its timeout fails the step naming the function and the sample (its
    thread is left to return on its own); time spent queued behind other calls does not
    count."""
    release = threading.Event()

    def stuck(meta, sample, text):
        if sample.prompt_ids[1] == 5:
            release.wait(60)
        return 0.0

    try:
        with pytest.raises(RewardError, match=r"step 3: reward function 'stuck' on sample 5 "
                                              r"\(group 2\): took more than 0.3 s"):
            score(RewardFn(stuck, concurrent=True, timeout=0.3))
    finally:
        release.set()

    def nap(meta, sample, text):
        time.sleep(0.1)
        return 1.0

    s = Rewards((RewardFn(nap, concurrent=True, timeout=0.6),), workers=1).score(
        0, items(), decode)  # 8 calls one after another: 0.8 s, each 0.1 s
    assert s.totals == [1.0] * len(TEXTS)

    def busy(meta, sample, text):  # the calling thread reads no answer meanwhile
        time.sleep(0.3 if sample.prompt_ids[1] == 0 else 0)
        return 0.0

    s = Rewards((RewardFn(lambda *_: 1.0, name="quick", concurrent=True, timeout=0.1),
                 RewardFn(busy))).score(0, items(), decode)  # finished in time: no timeout
    assert s.totals == [1.0] * len(TEXTS)



def _hold_gil_for(seconds: float) -> None:
    """Busy Python with a 1000 s switch interval: no other thread runs until it returns,
    as in a C call that holds the GIL (a regex), on any CPU."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(1000)
    try:
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            pass
    finally:
        sys.setswitchinterval(old)


def test_a_call_that_held_the_gil_past_its_timeout_still_fails_the_step():
    """The calling thread cannot look while a reward holds the GIL; the call's own thread
    measures it, so a late call is never accepted because its answer came first."""
    def greedy(meta, sample, text):
        if sample.prompt_ids[1] == 6:
            _hold_gil_for(0.6)
        return 0.0

    with pytest.raises(RewardError, match=r"'greedy' on sample 6 \(group 3\): took more "
                                          r"than 0.2 s"):
        score(RewardFn(greedy, concurrent=True, timeout=0.2))


def _finishes(fn, limit=120.0):
    """fn() on a thread; its outcome, or a failure if it has not returned in `limit` s (a
    liveness bound, not a timing: the call it guards would otherwise run for hours)."""
    out = {}
    t = threading.Thread(target=lambda: out.update(r=_outcome(fn)), daemon=True)
    t.start()
    t.join(limit)
    assert not t.is_alive(), "the step did not return: the timeout did not bound the call"
    return out["r"]


def test_process_rewards_are_killed_at_their_timeout():
    """process=True: each call in a worker process, killed at its deadline, so a regex
    that would hold the GIL for hours ends the step in one line; the next step runs on a
    fresh worker; values, errors and crashes come back as from threads."""
    ok, err = _finishes(lambda: score(RewardFn(process_rewards.catastrophic, process=True,
                                               timeout=0.5)))
    assert not ok and isinstance(err, RewardError)
    assert str(err) == ("step 3: reward function 'catastrophic' on sample 4 (group 2): took "
                        "more than 0.5 s (its timeout)")
    s = score(RewardFn(process_rewards.length, process=True, timeout=30))
    assert s.totals == [float(len(t)) for t in TEXTS]  # stdout noise did not corrupt it
    pids = score(RewardFn(process_rewards.pid, process=True)).totals
    assert os.getpid() not in pids and len(set(pids)) <= Rewards.__dataclass_fields__[
        "workers"].default
    for fn, match in [(process_rewards.raises, r"on sample 3 \(group 1\): raised KeyError: "
                                                r"'no such column'$"),
                      (process_rewards.exits, r"on sample \d .*raised SystemExit: 5$"),
                      (process_rewards.crashes, r"on sample 2 \(group 1\): raised ChildDied: "
                                                r"its worker process ended mid-call \(exit "
                                                r"code 7\)")]:
        with pytest.raises(RewardError, match=match):
            score(RewardFn(fn, process=True))
    ok, err = _finishes(lambda: score(RewardFn(process_rewards.hangs, process=True,
                                               timeout=0.3)))
    assert re.search(r"'hangs' on sample \d \(group \d\): took more than 0.3 s", str(err))
    with pytest.raises(ValueError, match=r"'<lambda>': process=True sends the function to a "
                                         r"worker process by name"):
        RewardFn(lambda *_: 1.0, process=True)
    assert RewardFn(process_rewards.pid, process=True).concurrent  # process implies it


def _boom(meta, sample, text):
    if text == "boom":
        raise ZeroDivisionError("division by zero\nsecond line")
    return 0.0


def _exits(meta, sample, text):
    raise SystemExit(3)


def _cancelled(meta, sample, text):
    import asyncio
    raise asyncio.CancelledError("cancelled")


class _Unprintable(Exception):
    def __str__(self):
        raise RuntimeError("no message")


def _unprintable(meta, sample, text):
    raise _Unprintable()


@pytest.mark.parametrize("reward,match", [
    (RewardFn(_boom), r"'_boom' on sample 4 \(group 2\): raised ZeroDivisionError: "
                      r"division by zero$"),
    (RewardFn(_boom, concurrent=True), r"'_boom' on sample 4 \(group 2\): raised "
                                       r"ZeroDivisionError"),
    (RewardFn(_exits, concurrent=True), r"'_exits' on sample \d .*raised SystemExit: 3"),
    (RewardFn(_cancelled), r"'_cancelled' on sample 0 .*raised CancelledError: cancelled"),
    (RewardFn(_cancelled, concurrent=True), r"'_cancelled' on sample \d .*CancelledError"),
    (RewardFn(_unprintable), r"'_unprintable' on sample 0 .*raised _Unprintable: \(its "
                             r"message could not be read\)"),
    (RewardFn(_unprintable, concurrent=True), r"raised _Unprintable: \(its message"),
    (RewardFn(lambda m, s, t: math.nan if t == "x 3" else 1.0, name="nan"),
     r"'nan' on sample 3 \(group 1\): its value must be finite, got nan"),
    (RewardFn(lambda *_: "1.0", name="text"), r"'text' on sample 0 .*must be a real number, "
                                              r"got str '1.0'"),
    (batched(lambda completions, **_: [1.0] * 7, name="short"),
     r"'short' on the batch of 8 samples: returned 7 values for 8 samples"),
    (batched(lambda completions, **_: 1.0, name="scalar"),
     r"'scalar' on the batch of 8 samples: returned float, not a list"),
    (batched(lambda completions, **_: [1.0] * 5 + [math.inf, 0.0, 0.0], name="inf"),
     r"'inf' on sample 5 \(group 2\): its value must be finite, got inf"),
    (batched(lambda prompts, completions: [0.0] * 8, name="strict"),  # no **kwargs
     r"'strict' on the batch of 8 samples: raised TypeError: .*completion_ids"),
    ([RewardFn(lambda *_: 1e300, weight=1e10, name="big")], r"weighted reward of sample 0 "
                                                            r"overflows"),
])
def test_a_failing_reward_is_one_line_naming_function_and_sample(reward, match):
    with pytest.raises(RewardError, match=match) as e:
        score(reward)
    assert "\n" not in str(e.value) and str(e.value).startswith("step 3: ")


def test_ctrl_c_on_the_calling_thread_is_not_a_reward_fault():
    """A KeyboardInterrupt in a call on the calling thread is a real Ctrl-C: it propagates;
    on a worker thread (which never receives signals) it is the code's own fault."""
    def interrupt(meta, sample, text):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        score(interrupt)
    with pytest.raises(RewardError, match=r"'interrupt' on sample \d .*KeyboardInterrupt"):
        score(RewardFn(interrupt, concurrent=True))


def test_reward_definitions_are_checked():
    with pytest.raises(ValueError, match="timeout needs concurrent=True"):
        RewardFn(length, timeout=1.0)
    with pytest.raises(ValueError, match="'length' timeout must be finite and > 0"):
        RewardFn(length, concurrent=True, timeout=0)
    with pytest.raises(ValueError, match="'length' weight must be finite"):
        RewardFn(length, weight=math.nan)
    with pytest.raises(ValueError, match="two reward functions are named 'length'"):
        Rewards((length, RewardFn(digits, name="length")))
    with pytest.raises(TypeError, match="must be callable"):
        RewardFn(3)
    with pytest.raises(ValueError, match="no reward functions"):
        Rewards.of([])
    with pytest.raises(TypeError, match="reward must be a callable"):
        Rewards.of(42)
    with pytest.raises(ValueError, match="Rewards.workers must be >= 1"):
        Rewards((length,), workers=0)


def test_load_reward_specs(tmp_path):
    """--reward: module:function or file.py:function, =weight; a plain function is batched
    (TRL's shape), a RewardFn is used as declared; every error one line naming the spec."""
    path = tmp_path / "my_rewards.py"
    path.write_text(
        "from jaxrl_cache.rl.rewards import RewardFn\n"
        "def fmt(completions, **kwargs):\n"
        "    return [float(c.startswith('<')) for c in completions]\n"
        "judge = RewardFn(lambda m, s, t: 1.0, name='judge', concurrent=True, timeout=5)\n"
        "def _chars(m, s, t):\n    return float(len(t) + BONUS)\n"
        "BONUS = 100\n"
        "isolated = RewardFn(_chars, name='chars', process=True, timeout=30)\n"
        "NUMBER = 3\n")
    f = load_reward(f"{path}:fmt=0.25")
    assert (f.name, f.weight, f.batched, f.concurrent) == ("fmt", 0.25, True, False)
    assert f.fn(completions=["<a", "b"]) == [1.0, 0.0]
    assert load_reward(f"{path}:fmt").fn is f.fn  # the file is loaded once
    j = load_reward(f"{path}:judge=2")
    assert (j.name, j.weight, j.batched, j.timeout) == ("judge", 2.0, False, 5.0)
    iso = load_reward(f"{path}:isolated")  # the file is loaded in its worker process too
    assert score(iso).totals == [len(t) + 100.0 for t in TEXTS]
    m = load_reward("jaxrl_cache.rl.answers:final_answer")
    assert m.name == "final_answer" and m.batched
    (tmp_path / "broken.py").write_text("import not_a_module_anywhere\n")
    (tmp_path / "exits.py").write_text("import sys\nsys.exit(0)\n")
    (tmp_path / "bad_str.py").write_text(
        "class E(Exception):\n    def __str__(self):\n        raise RuntimeError('no')\n"
        "raise E()\n")
    for spec, match in [
            (f"{tmp_path}/exits.py:f", "importing .*exits.py failed: SystemExit"),
            (f"{tmp_path}/bad_str.py:f", "importing .*bad_str.py failed: E: \\(its message"),
            ("fmt", "expected module:function"), (f"{path}:fmt=heavy", "weight must be a "
                                                                        "finite number"),
            (f"{path}:fmt=inf", "weight must be a finite"),
            (f"{tmp_path}/none.py:fmt", "no such file"),
            (f"{path}:missing", "has no attribute 'missing'"),
            (f"{path}:NUMBER", "is not callable"),
            (f"{tmp_path}/broken.py:f", "importing .*broken.py failed: ModuleNotFoundError"),
            ("not_a_module_anywhere:f", "importing not_a_module_anywhere failed")]:
        with pytest.raises(ValueError, match=match) as e:
            load_reward(spec)
        assert str(e.value).startswith(f"--reward {spec!r}") and "\n" not in str(e.value)


# grpo_step: episode calls of the multi-turn tests (no engine), 8 episodes in 2 groups

def _episodes():
    from tests.test_episode_training import FixedRollouts, tasks
    return FixedRollouts, tasks(seed=8)


def _history():
    from tests.test_episode_training import PARAMS
    history = PolicyHistory(lag=0)
    history.add(0, PARAMS[0])
    return history


def turns(meta, episode, text):
    return float(len(episode.turns))


def tokens(completions, completion_ids, **_):
    return [len(ids) / 4 if len(ids) > 3 else None for ids in completion_ids]


def test_grpo_step_trains_on_the_weighted_sum():
    """Two functions (one batched, on threads) train exactly as make_batch + train_step
    on their weighted sum; the record has each one's mean and std by name."""
    from tests.test_episode_training import _state
    FixedRollouts, batch = _episodes()
    rewards = [RewardFn(turns, weight=2.0), batched(tokens, weight=-0.5, concurrent=True)]
    result = grpo_step(0, _state(), FixedRollouts([("m", batch)]), rewards, decode=str,
                       history=_history())
    want = [2.0 * len(e.turns) - (0.5 * e.sampled_tokens / 4 if e.sampled_tokens > 3 else 0)
            for e in batch.episodes]
    expected, _ = train_step(_state(), make_batch(batch, want), max_policy_lag=0)
    for a, b in zip(jax.tree.leaves(result.state.params), jax.tree.leaves(expected.params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)
    r = result.record
    assert r["reward"] == pytest.approx(np.mean(want))
    assert r["rewards/turns/mean"] == pytest.approx(np.mean([len(e.turns)
                                                             for e in batch.episodes]))
    applied = [e.sampled_tokens / 4 for e in batch.episodes if e.sampled_tokens > 3]
    assert r["rewards/tokens/std"] == pytest.approx(np.std(applied))
    assert r["reward_unscored"] == 0 and int(result.state.version) == 1


class _Counting:
    """FixedRollouts that counts its gets and publishes."""

    def __init__(self, parts):
        from tests.test_episode_training import FixedRollouts
        self.inner, self.gets, self.publishes = FixedRollouts(parts), 0, 0
        self.gate = self.inner.gate

    def get(self, step, state):
        self.gets += 1
        return self.inner.get(step, state)

    def publish(self, state):
        self.publishes += 1
        return self.inner.publish(state)

    def oldest_pending(self, trainer_version):
        return trainer_version


@pytest.mark.parametrize("reward,match", [
    (RewardFn(lambda m, e, t: 1 / 0 if e.index == 3 else 1.0, name="div"),
     r"step 5: reward function 'div' on sample 3 \(group 0\): raised ZeroDivisionError"),
    (batched(lambda completions, **_: [math.nan] * len(completions), name="nan"),
     r"'nan' on sample 0 \(group 0\): its value must be finite, got nan"),
    (batched(lambda completions, **_: [], name="empty"), "returned 0 values for 8 samples"),
])
def test_a_failing_reward_trains_nothing(reward, match):
    """The step raises before any audit or update: nothing published, no new version in
    the history, the state untouched; a reward that is not one fails before the rollouts."""
    from tests.test_episode_training import _state
    _, batch = _episodes()
    rollouts, history, state = _Counting([("m", batch)]), _history(), _state()
    with pytest.raises(RewardError, match=match):
        grpo_step(5, state, rollouts, reward, decode=str, history=history)
    assert rollouts.publishes == 0 and set(history.params) == {0}
    assert int(state.version) == 0
    with pytest.raises(TypeError, match="reward must be a callable"):
        grpo_step(5, state, rollouts, 42, decode=str, history=history)
    assert rollouts.gets == 1
