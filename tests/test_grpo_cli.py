"""`jaxrl-cache grpo` (issue 63, part 1): --dataset from a JSONL/JSON/parquet file, a
save_to_disk directory (--split), a directory load_dataset reads, a Hub name through the
offline cache; answers optional with --reward; --chat-template-kwargs and TRL's
`{% generation %}` templates; one-line errors before any work; TRL-style rewards (async,
a `solution` column, chat completions) end to end; and examples/gsm8k_grpo.yaml with its
TRL reward file, run end to end on a small saved dataset and a tiny model."""
import csv
import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

from jaxrl_cache import from_pretrained, latest_checkpoint_version
from jaxrl_cache.app import cli, demo
from jaxrl_cache.app.options import DemoOptions
from jaxrl_cache.app.tasks import DatasetTask
from jaxrl_cache.dataset_source import read_dataset
from jaxrl_cache.models import load_tokenizer
from jaxrl_cache.rl.rewards import load_reward
from tests.helpers import cli_error

datasets = pytest.importorskip("datasets")

REPO = pathlib.Path(__file__).resolve().parents[1]
QWEN2 = REPO / "tests" / "fixtures" / "hf" / "qwen2"
ROWS = [{"question": f"{a}+{b}?", "answer": f"{a} + {b} = {a + b}\n#### {a + b}"}
        for a, b in [(1, 2), (3, 4), (2, 2), (5, 1), (4, 3), (6, 2), (1, 1), (2, 5)]]
TINY = ["--group-size", "2", "--prompts-per-step", "2", "--eval-prompts", "2",
        "--sft-steps", "0", "--max-new-tokens", "6"]


def test_dataset_sources_and_splits(tmp_path):
    data = datasets.Dataset.from_list(ROWS)
    data.to_parquet(tmp_path / "rows.parquet")
    data.save_to_disk(tmp_path / "one")
    datasets.DatasetDict(train=data, test=data.select(range(4))).save_to_disk(tmp_path / "two")
    files = tmp_path / "files"  # a directory of data files: load_dataset reads it
    files.mkdir()
    for split, rows in (("train", ROWS), ("test", ROWS[:3])):
        (files / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    for spec, split, name, n in [(tmp_path / "rows.parquet", None, "rows.parquet", 8),
                                 (tmp_path / "one", None, "one", 8),
                                 (tmp_path / "two", None, "two[train]", 8),
                                 (tmp_path / "two", "test", "two[test]", 4),
                                 (files, None, "files[train]", 8),
                                 (files, "test", "files[test]", 3)]:
        task = DatasetTask(spec, prompt_key="question", split=split)
        assert (task.name, len(task.examples)) == (name, n)
        assert [(e.prompt, e.answer) for e in task.examples] == \
            [(r["question"], r["answer"].rsplit(" ", 1)[1]) for r in ROWS[:n]]
    assert read_dataset(str(tmp_path / "two"), split="test").where(2) == \
        f"{tmp_path / 'two'}[test] row 2"
    (tmp_path / "rows.csv").write_text("question,answer\n")
    (tmp_path / "empty.jsonl").write_text("\n")
    for spec, split, config, message in [
            ("two", "validation", None, "no split 'validation' (its splits: train, test; "
                                        "--split chooses one)"),
            ("one", "train", None, "a single file or Dataset has one split"),
            ("rows.parquet", "train", None, "a single file or Dataset has one split"),
            ("rows.parquet", None, "main", "--dataset-config main applies to a Hub dataset"),
            ("rows.csv", None, None, "cannot read a .csv file (expected .jsonl, .json, "
                                     ".parquet"),
            ("missing.jsonl", None, None, "no such file or directory"),
            ("empty.jsonl", None, None, "the dataset is empty (no rows)"),
            ("files", "nope", None, "ValueError: ")]:
        spec = str(tmp_path / spec)
        with pytest.raises(ValueError) as info:
            read_dataset(spec, split=split, config=config)
        assert str(info.value).startswith(f"--dataset {spec}: ") and \
            message in str(info.value) and "\n" not in str(info.value), str(info.value)


def test_a_hub_name_offline_is_one_line(tmp_path):
    """HF_DATASETS_OFFLINE=1 and a name not in the cache: one line, exit 2, nothing written
    (a separate process: `datasets` reads the variable when it is imported)."""
    env = dict(os.environ, HF_HOME=str(tmp_path / "hf"), HF_DATASETS_OFFLINE="1",
               HF_HUB_OFFLINE="1", PYTHONPATH=str(REPO))
    out = tmp_path / "run"
    done = subprocess.run([sys.executable, "-m", "jaxrl_cache.app.cli", "grpo", "--dataset",
                           "org/not-cached", "--out", str(out)], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    err = done.stderr.strip().splitlines()[-1]
    assert err.startswith("jaxrl-cache grpo: error: --dataset org/not-cached: ") and \
        "offline" in err.lower(), done.stderr
    assert not out.exists()


def test_answers_are_optional_with_rewards_and_errors_come_before_any_work(tmp_path,
                                                                           capsys):
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"prompt": f"{i}+{i}?", "solution": str(2 * i)}) + "\n"
                            for i in range(4)))
    (tmp_path / "r.py").write_text("def one(completions, **kwargs):\n"
                                   "    return [1.0] * len(completions)\n")
    out, reward = tmp_path / "run", f"{tmp_path / 'r.py'}:one"
    task = DatasetTask(rows, answers_required=False)
    assert not task.has_answers and task.held_out == [] and len(task.train) == 4
    assert {e.answer for e in task.examples} == {None}
    grpo = ["grpo", "--dataset", str(rows), "--out", str(out)]
    for argv, message in [
            (grpo, f"{rows}:1: no 'answer' field (its fields: prompt, solution): the answer "
                   f"reward needs one (--answer-key chooses it); a task without answers "
                   f"needs --reward functions"),
            ([*grpo, "--reward", reward, "--answer-check", "exact"], "no 'answer' field"),
            ([*grpo, "--reward", reward, "--sft-steps", "2"], "--sft-steps 2: the warm start "
                                                               "trains on reference answers"),
            ([*grpo, "--reward", reward, "--eval-every", "1"], "--eval-every 1: evaluation "
                                                                "scores answers"),
            ([*grpo, "--reward", reward, "--split", "test"], "a single file or Dataset has "
                                                              "one split"),
            ([*grpo, "--reward", reward, "--chat-template-kwargs", "[1]"],
             "--chat-template-kwargs: expected a JSON object such as"),
            ([*grpo, "--reward", reward, "--chat-template-kwargs", "{nope"],
             "--chat-template-kwargs: not valid JSON"),
            ([*grpo, "--reward", reward, "--chat-template-kwargs", '{"enable_thinking": false}'],
             "--chat-template-kwargs needs a model with a chat template"),
            (["grpo", "--out", str(out)], "--dataset is required"),
            (["demo", "--split", "train", "--out", str(out)], "unrecognized arguments: --split")]:
        assert message in cli_error(argv, capsys)
        assert not out.exists()


def test_resumed_runs_from_before_the_rename_keep_their_rewards():
    old = {"task": "rows.jsonl", "rewards": ["m:f"], "answer_check": None, "steps": 3}
    assert demo._upgraded(old) == {"dataset": "rows.jsonl", "rewards": ["m:f"],
                                   "answer_check": "numeric", "steps": 3}
    assert demo._upgraded({"task": "rows.jsonl"})["answer_check"] == "exact"
    assert demo._upgraded({"task": None, "steps": 3}) == {"dataset": None, "steps": 3}


def test_chat_template_kwargs_and_the_generation_tag(tmp_path, monkeypatch, capsys):
    model = _thinking_model(tmp_path)
    tok = load_tokenizer(model)
    messages = [{"role": "user", "content": "2+2?"}]
    text = tok.apply_chat_template(messages, tokenize=False, enable_thinking=False)
    assert text.endswith("<think></think>") and "2+2?" in text
    with_answer = messages + [{"role": "assistant", "content": "4"}]
    assert "4<|im_end|>" in tok.apply_chat_template(with_answer, tokenize=False,
                                                    add_generation_prompt=False,
                                                    enable_thinking=False)
    calls = []
    monkeypatch.setattr(demo, "run_demo", lambda opts, given: calls.append(opts) or 1 / 0)
    config = tmp_path / "run.yaml"
    config.write_text(f"dataset: {tmp_path / 'x.jsonl'}\n"
                      f"chat_template_kwargs: {{enable_thinking: false}}\n")
    with pytest.raises(ZeroDivisionError):
        cli.main(["grpo", "--config", str(config)])
    assert calls[0].chat_template_kwargs == {"enable_thinking": False}


def _thinking_model(tmp_path) -> pathlib.Path:
    """The tiny Qwen2 fixture with a Qwen3-style template: TRL's `{% generation %}` tag
    around assistant turns, and `enable_thinking` that must be given false (else it raises:
    a run that did not pass --chat-template-kwargs fails)."""
    model = tmp_path / "thinking-model"
    shutil.copytree(QWEN2, model)
    (model / "chat_template.jinja").write_text(
        "{% for m in messages %}<|im_start|>{{ m.role }}\n"
        "{% if m.role == 'assistant' %}{% generation %}{{ m.content }}<|im_end|>"
        "{% endgeneration %}{% else %}{{ m.content }}<|im_end|>{% endif %}\n{% endfor %}"
        "{% if enable_thinking is not defined or enable_thinking %}"
        "{{ raise_exception('this test renders with enable_thinking=false') }}{% endif %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n<think></think>{% endif %}")
    return model


TRL_REWARDS = '''
import asyncio
import re

seen = {}


def format_reward(completions, **kwargs):
    """As TRL's docs: completion[0]["content"] on conversational data."""
    pattern = r"^<think>.*?</think>"
    return [1.0 if re.match(pattern, c[0]["content"]) else 0.0 for c in completions]


def accuracy_reward(completions, solution, **kwargs):
    """The dataset's `solution` column by name; None (not applicable) for an empty one."""
    seen.update(solution=solution)
    return [None if not c[0]["content"].strip() else float(s in c[0]["content"])
            for c, s in zip(completions, solution)]


async def judge_reward(prompts, completions, trainer_state, **kwargs):
    """An async reward (an LLM judge's shape), awaited with the step's others."""
    await asyncio.sleep(0.01)
    seen.setdefault("steps", []).append((trainer_state.global_step, trainer_state.max_steps))
    seen.update(prompts=prompts, completions=completions)
    return [0.5] * len(completions)
'''


def test_trl_rewards_end_to_end_on_chat_prompts_without_answers(tmp_path, capsys):
    """A saved DatasetDict of chat prompts with a `solution` column and no answers; rewards
    written as for TRL (sync, async, a column by name, None) run unchanged; the model's
    template needs --chat-template-kwargs and has TRL's {% generation %} tag."""
    rows = [{"prompt": [{"role": "user", "content": f"{i}+{i}?"}], "solution": str(2 * i)}
            for i in range(6)]
    datasets.DatasetDict(train=datasets.Dataset.from_list(rows)).save_to_disk(tmp_path / "ds")
    (tmp_path / "trl_rewards.py").write_text(TRL_REWARDS)
    spec = str(tmp_path / "trl_rewards.py")
    out = tmp_path / "run"
    code = cli.main(["grpo", "--dataset", str(tmp_path / "ds"), "--model",
                     str(_thinking_model(tmp_path)), "--chat-template-kwargs",
                     '{"enable_thinking": false}', "--reward", f"{spec}:format_reward",
                     "--reward", f"{spec}:accuracy_reward=2", "--reward",
                     f"{spec}:judge_reward", "--steps", "2", "--out", str(out), *TINY])
    assert code == 0, capsys.readouterr().err
    text = capsys.readouterr().out
    assert "jaxrl-cache grpo summary" in text and "n/a (no answer column)" in text
    rows_out = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rows_out) == 2 and "exact_match" not in rows_out[0]
    assert {"rewards/format_reward/mean", "rewards/accuracy_reward/mean",
            "rewards/judge_reward/mean"} <= set(rows_out[0])
    assert "rewards/answer/mean" not in rows_out[0]  # no answer reward: TRL's reward_funcs
    seen = load_reward(f"{spec}:judge_reward").fn.__globals__["seen"]
    assert seen["steps"] == [(0, 2), (1, 2)]
    assert all(p in [r["prompt"] for r in rows] for p in seen["prompts"])
    assert all(c[0]["role"] == "assistant" and isinstance(c[0]["content"], str)
               for c in seen["completions"])
    assert set(seen["solution"]) <= {r["solution"] for r in rows}


def test_the_gsm8k_recipe_config_runs_end_to_end(tmp_path, monkeypatch, capsys):
    """examples/gsm8k_grpo.yaml + examples/gsm8k_rewards.py (TRL-style rewards) on a small
    saved dataset and a tiny model (flags override the config): both rewards logged by name
    (no answer reward: they are the rewards), exact match and held-out evaluation from the
    answer column, every sample audited, CSV and TensorBoard, a checkpoint at version 2 and
    an HF export that loads."""
    datasets.DatasetDict(train=datasets.Dataset.from_list(ROWS)).save_to_disk(tmp_path / "ds")
    monkeypatch.chdir(REPO)  # the config's reward files are relative to the repository
    out = tmp_path / "run"
    code = cli.main(["grpo", "--config", str(REPO / "examples" / "gsm8k_grpo.yaml"),
                     "--model", str(QWEN2), "--dataset", str(tmp_path / "ds"),
                     "--system-prompt", "Be brief.", "--steps", "2", "--eval-every", "1",
                     "--out", str(out), *TINY])
    assert code == 0, capsys.readouterr().err
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["version"] for r in rows] == [0, 1] and rows[-1]["audited_samples"] == 4
    assert {"rewards/correctness_reward/mean", "rewards/format_reward/mean", "exact_match",
            "eval/exact_match", "eval/pass@4"} <= set(rows[-1])
    assert "rewards/answer/mean" not in rows[-1]
    assert rows[0]["sample"]["prompt"][0] == {"role": "system", "content": "Be brief."}
    logged = list(csv.DictReader(open(out / "metrics.csv")))
    assert [int(float(r["step"])) for r in logged] == [0, 1]
    assert any((out / "tensorboard").rglob("events.out.tfevents*"))
    assert latest_checkpoint_version(out / "checkpoints") == 2
    config, params = from_pretrained(out / "final_model")
    assert config.vocab_size == params["embed"].shape[0]
    assert DemoOptions(**json.loads((out / "run.json").read_text())["options"]).rewards == (
        "examples/gsm8k_rewards.py:correctness_reward",
        "examples/gsm8k_rewards.py:format_reward=0.1")
