"""The demo task, the GRPO demo loop (outputs, resume, Ctrl-C) and the CLI."""
import json
import os
import signal

import numpy as np
import pytest

from jaxrl_cache.app import cli, demo
from jaxrl_cache.app.tasks import EOS, ReverseDigits

SMALL = dict(group_size=2, prompts_per_step=4, rollout_calls=2, max_new_tokens=5)


def test_task_reward_and_prompts():
    task = ReverseDigits()
    prompts = task.sample_prompts(np.random.default_rng(0), 3)
    assert all(p[:len(task.prefix)] == task.prefix for p in prompts)
    assert all(len(p) == task.prompt_len for p in prompts)
    p = prompts[0]
    target = task.target(p)
    assert target[:-1] == p[-2:-2 - task.num_digits:-1] and target[-1] == EOS
    assert task.reward(p, target) == 1.0
    assert task.reward(p, []) == 0.0
    assert 0.0 < task.reward(p, target[:2]) < 1.0
    wrong = [(t - 4 + 1) % 10 + 4 for t in target[:-1]]  # every digit off by one (or nine)
    assert 0.0 < task.reward(p, wrong) < 0.5


def read_rows(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_demo_writes_outputs_and_resumes(tmp_path):
    out = tmp_path / "run"
    summary = demo.run_demo(demo.DemoOptions(steps=3, out=str(out), **SMALL))
    rows = read_rows(out)
    assert [r["version"] for r in rows] == [0, 1, 2] and summary["final_version"] == 3
    for key in ("step", "version", "reward", "cache_hit_rate", "lr", "loss",
                "rollout_seconds", "train_seconds"):
        assert key in rows[0]
    assert all(r["audit_ok"] for r in rows) and summary["audit_failures"] == 0
    # the second rollout call of each step hits the instruction prefix cached by the first
    assert all(r["cache_hit_rate"] > 0 for r in rows)
    assert (out / "reward.png").stat().st_size > 0 and (out / "checkpoint").is_dir()
    resumed = demo.run_demo(demo.DemoOptions(steps=5, out=str(out), resume=True, **SMALL))
    rows = read_rows(out)
    assert [r["version"] for r in rows] == [0, 1, 2, 3, 4] and resumed["final_version"] == 5
    schedule = demo._lr_schedule(demo.DemoOptions(steps=5, **SMALL))
    assert rows[3]["lr"] == pytest.approx(float(schedule(3)))


def test_ctrl_c_stops_after_the_current_step_and_saves(tmp_path, monkeypatch):
    real = demo.train_step
    calls = {"n": 0}

    def interrupting(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            os.kill(os.getpid(), signal.SIGINT)
        return real(*args, **kwargs)

    monkeypatch.setattr(demo, "train_step", interrupting)
    out = tmp_path / "run"
    summary = demo.run_demo(demo.DemoOptions(steps=10, out=str(out), **SMALL))
    assert summary["interrupted"] and summary["final_version"] == 2
    assert len(read_rows(out)) == 2 and (out / "checkpoint").is_dir()


@pytest.mark.parametrize("argv,message", [
    (["demo", "--steps", "0"], "positive integer"),
    (["demo", "--lr", "abc"], "positive number"),
    (["demo", "--backend", "tpu"], "invalid choice"),
    (["demo", "--group-size", "1"], "group-size must be >= 2"),
    (["nope"], "invalid choice"),
])
def test_cli_bad_flags_give_one_line(argv, message, capsys):
    try:
        code = cli.main(argv)
    except SystemExit as e:
        code = e.code
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err and "Traceback" not in err


def test_cli_help_explains_subcommands(capsys):
    with pytest.raises(SystemExit):
        cli.main(["demo", "--help"])
    text = capsys.readouterr().out
    assert "--resume" in text and "Ctrl-C" in text


def test_second_ctrl_c_aborts_but_keeps_the_last_state(tmp_path, monkeypatch):
    real = demo.train_step

    def interrupting_twice(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGINT)
        return real(*args, **kwargs)

    monkeypatch.setattr(demo, "train_step", interrupting_twice)
    out = tmp_path / "run"
    with pytest.raises(KeyboardInterrupt):
        demo.run_demo(demo.DemoOptions(steps=10, out=str(out), **SMALL))
    assert (out / "checkpoint").is_dir() and not read_rows(out)
