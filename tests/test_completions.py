"""The completions log (rl/completions.py): every sample of a step as a row, checked against
the step's own samples and against rewards, advantages and log-prob mismatches computed
here; its file cut to a checkpoint's steps on a resume; the demo's completions.jsonl and
--no-completions-log."""
import dataclasses
import json

import numpy as np
import pytest

from jaxrl_cache.app import cli, demo
from jaxrl_cache.app.options import DemoOptions
from jaxrl_cache.rl.audit import AuditGate
from jaxrl_cache.rl.completions import CompletionsLog, completion_rows
from jaxrl_cache.rl.loop import PolicyHistory, grpo_step
from jaxrl_cache.rl.rewards import RewardFn, batched
from jaxrl_cache.rl.train_config import TrainConfig
from tests.test_episode_training import PARAMS, FixedRollouts, _state, tasks


def turns(meta, episode, text):
    return float(len(episode.turns))


def tokens(completions, completion_ids, **_):
    return [len(ids) / 4 if len(ids) > 9 else None for ids in completion_ids]


REWARDS = [RewardFn(turns, weight=2.0), batched(tokens, weight=-0.5)]


def _step(parts, gate=AuditGate(), train=TrainConfig()):
    history = PolicyHistory(lag=0)
    history.add(0, PARAMS[0])
    return grpo_step(0, _state(), FixedRollouts(parts, gate), REWARDS, decode=str,
                     history=history, train=train)


def _advantages(rewards, groups) -> np.ndarray:
    """GRPO's (r - group mean) / (group std + 1e-6), written out here."""
    rewards, groups = np.asarray(rewards, np.float64), list(groups)
    out = np.empty_like(rewards)
    for g in set(groups):
        idx = [i for i, h in enumerate(groups) if h == g]
        r = rewards[idx]
        out[idx] = (r - r.mean()) / (r.std() + 1e-6)
    return out


def test_rows_are_the_steps_samples_with_their_rewards_and_advantages():
    """Two calls of episodes: one row per episode in batch order with its call, group,
    prompt, text, each function's value (None where it did not apply), the weighted total,
    GRPO's advantage over (call, group), its versions; an exact run's mismatch is 0."""
    calls = [("a", tasks(seed=8)), ("b", tasks(seed=9, groups=1))]
    result = _step(calls)
    rows = completion_rows(result, lambda meta, e: f"{meta}/{e.group}")
    episodes = [(c, meta, e) for c, (meta, b) in enumerate(calls) for e in b.episodes]
    assert len(rows) == len(episodes) == 12
    want_tokens = [e.sampled_tokens / 4 if e.sampled_tokens > 9 else None
                   for _, _, e in episodes]
    assert None in want_tokens and any(want_tokens)  # both cases are exercised
    totals = [2.0 * len(e.turns) - 0.5 * (t or 0.0)
              for (_, _, e), t in zip(episodes, want_tokens)]
    advantages = _advantages(totals, [(c, e.group) for c, _, e in episodes])
    for row, (c, meta, e), t, total, adv in zip(rows, episodes, want_tokens, totals,
                                                 advantages):
        assert row == dict(
            step=0, version=0, call=c, group=e.group, prompt=f"{meta}/{e.group}",
            completion="".join(e.turn_texts), rewards=dict(turns=len(e.turns), tokens=t),
            reward=pytest.approx(total), advantage=pytest.approx(adv, abs=1e-5),
            finish_reason="done", completion_tokens=e.sampled_tokens, behavior_version=0,
            last_version=0, mixed_tokens=0, mismatch=0.0)
    assert np.mean([r["reward"] for r in rows]) == pytest.approx(result.record["reward"])
    json.dumps(rows)  # plain JSON


def test_mismatch_is_per_sample_where_the_separate_audit_measures_it():
    """A sample whose recorded log-prob is off by 0.003 on one token: the separate audit
    (two mini-batches: the step's forward does not reproduce the sampler) gives each sample
    its own figure; the train step's own check (one mini-batch) knows only the step's
    largest, so its samples get None (0 would be exact: see the test above)."""
    batch = tasks(seed=8)
    e = batch.episodes[5]
    first = int(np.flatnonzero(e.loss_mask)[0])
    off = dataclasses.replace(e, logprobs=e.logprobs + np.float32(0.003) * (
        np.arange(len(e.logprobs)) == first))
    batch = dataclasses.replace(batch, episodes=batch.episodes[:5] + [off] +
                                batch.episodes[6:])
    gate = AuditGate(tolerance=0.01)
    separate = _step([("m", batch)], gate, TrainConfig(mini_batches=2)).mismatch
    assert separate[5] == pytest.approx(0.003, abs=1e-6)
    assert [m for k, m in enumerate(separate) if k != 5] == [0.0] * 7
    in_step = _step([("m", batch)], gate)
    assert in_step.record["logprob_mismatch_max"] == pytest.approx(0.003, abs=1e-6)
    assert in_step.mismatch == (None,) * 8


def _rows(path) -> list:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_the_log_keeps_the_steps_before_a_resume(tmp_path):
    path = tmp_path / "completions.jsonl"
    log = CompletionsLog(path)
    for step in range(4):
        log.write([dict(step=step, k=k) for k in range(3)])
        assert [r["step"] for r in _rows(path)][-3:] == [step] * 3  # on disk at once
    with open(path, "a") as f:
        f.write('{"step": 4, "k"')  # torn: killed while writing step 4
    CompletionsLog(path, start_step=2).write([dict(step=2, k="again")])
    assert [(r["step"], r["k"]) for r in _rows(path)] == [
        (0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2), (2, "again")]
    assert not list(tmp_path.glob("*.tmp"))
    lines = path.read_text().splitlines()
    path.write_text("\n".join([lines[0], "garbage", *lines[1:]]) + "\n")
    with pytest.raises(ValueError, match=r"completions.jsonl:2: torn or corrupted line"):
        CompletionsLog(path, start_step=1)


SMALL = dict(sft_steps=2, sft_batch=4, eval_prompts=4, group_size=2, prompts_per_step=4,
             rollout_calls=2, checkpoint_every=1)


def test_the_demo_writes_every_sample_once_across_resumes(tmp_path):
    """completions.jsonl is on by default (--no-completions-log turns it off); a resumed
    run appends after the checkpoint's steps (rows a killed process wrote after it are
    replaced, not duplicated); each step's rows agree with its metrics row."""
    assert DemoOptions().completions_log
    args = cli.build_parser().parse_args(["demo", "--no-completions-log"])
    assert args.completions_log is False
    out = tmp_path / "run"
    demo.run_demo(DemoOptions(out=str(out), steps=2, completions_log=False, **SMALL))
    assert not (out / "completions.jsonl").exists()
    demo.run_demo(DemoOptions(out=str(out), steps=3, resume=True, **SMALL),
                  given={"out", "steps", "resume", "completions_log"})
    assert [r["step"] for r in _rows(out / "completions.jsonl")] == [2] * 8
    with open(out / "completions.jsonl", "a") as f:  # a process killed after step 3's
        f.write(json.dumps(dict(step=3, completion="stale")) + '\n{"step": 3, "pro')
    demo.run_demo(DemoOptions(out=str(out), steps=4, resume=True, **SMALL),
                  given={"out", "steps", "resume"})  # on: the command line decides
    rows = _rows(out / "completions.jsonl")
    assert [r["step"] for r in rows] == [2] * 8 + [3] * 8
    assert "stale" not in {r["completion"] for r in rows}
    metrics = {m["step"]: m for m in _rows(out / "metrics.jsonl")}
    for step in (2, 3):
        mine = [r for r in rows if r["step"] == step]
        assert all(r["version"] == metrics[step]["version"] == step for r in mine)
        assert np.mean([r["reward"] for r in mine]) == pytest.approx(metrics[step]["reward"])
        assert [r["rewards"]["answer"] for r in mine] == [r["reward"] for r in mine]
        assert [r["call"] for r in mine] == [0] * 4 + [1] * 4
        assert all(r["prompt"].startswith("number: ") and r["mismatch"] == 0.0 for r in mine)
        assert [r["advantage"] for r in mine] == pytest.approx(list(_advantages(
            [r["reward"] for r in mine], [(r["call"], r["group"]) for r in mine])), abs=1e-5)

