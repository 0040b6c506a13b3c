"""Data in (issue 36, item 5): rows -> Examples (`data.prompts_from_rows`: GSM8K rows, chat
prompts, numeric answers, any sequence of mappings), JSONL and JSON task files with
--prompt-key / --answer-key, and --model as a Hub id read from a real Hub-cache layout
(HF_HUB_OFFLINE=1: no network)."""
import json
import shutil

import pytest

from jaxrl_cache.app import cli, demo
from jaxrl_cache.app.tasks import DatasetTask
from jaxrl_cache.data import (Example, RowError, canonical_answer, gsm8k_answer,
                              prompts_from_rows, read_rows)
from jaxrl_cache.models import load_tokenizer
from tests.hf_fixtures import FIXTURES

GSM8K_ROWS = [  # GSM8K's own format (train split, first rows, shortened)
    {"question": "Natalia sold clips to 48 of her friends in April, and then she sold half "
                 "as many clips in May. How many clips did Natalia sell altogether?",
     "answer": "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = "
               "<<48+24=72>>72 clips altogether in April and May.\n#### 72"},
    {"question": "A company pays $1,000 a week. How much in 5 weeks?",
     "answer": "5 * 1,000 = <<5*1000=5000>>5,000\n#### 5,000"},
]


class Rows:
    """A sequence of dicts that is not a list (as a datasets.Dataset is)."""

    def __init__(self, rows):
        self._rows = rows

    def __len__(self):
        return len(self._rows)

    def __getitem__(self, i):
        return dict(self._rows[i])


def test_gsm8k_rows_chat_prompts_and_numeric_answers():
    examples = prompts_from_rows(Rows(GSM8K_ROWS), prompt_key="question")
    assert [e.answer for e in examples] == ["72", "5000"]
    assert examples[0].prompt == GSM8K_ROWS[0]["question"]
    assert examples[0].row["answer"].endswith("#### 72")  # the whole row is kept
    assert examples[0] == Example(GSM8K_ROWS[0]["question"], "72")  # row not compared
    raw = prompts_from_rows(GSM8K_ROWS, prompt_key="question", gsm8k_answers=False)
    assert raw[1].answer == GSM8K_ROWS[1]["answer"]
    chat = [{"role": "user", "content": "What is 3 + 4?"}]
    rows = [{"prompt": chat, "answer": 7}, {"prompt": "6 * 7 =", "answer": 42.0},
            {"prompt": "half of 1", "answer": 0.5}, {"prompt": "x", "answer": -3}]
    examples = prompts_from_rows(rows, system_prompt="Answer with a number.")
    assert [e.answer for e in examples] == ["7", "42", "0.5", "-3"]
    system = {"role": "system", "content": "Answer with a number."}
    assert examples[0].prompt == (system, chat[0])
    assert examples[1].prompt == (system, {"role": "user", "content": "6 * 7 ="})
    assert prompts_from_rows(rows)[0].prompt == tuple(chat)  # no system prompt: as given
    assert gsm8k_answer("so #### 3 then #### -1,234.5 ") == "-1234.5"
    assert gsm8k_answer(" 12 ") == "12"
    assert canonical_answer(10**20) == str(10**20) and canonical_answer(1e300) == "1e+300"


@pytest.mark.parametrize("row,message", [
    ({"prompt": "a"}, "row 0: expected an object with fields 'prompt' and 'answer'; it has "
                      "no 'answer' (its fields: prompt; --answer-key chooses"),
    ({"question": "a", "answer": "1"}, "it has no 'prompt' (its fields: question, answer; "
                                       "--prompt-key chooses the prompt field)"),
    ("just text", "row 0: expected an object with fields"),
    ({"prompt": "a", "answer": True}, "row 0: 'answer': expected a string or a number, got "
                                      "bool True"),
    ({"prompt": "a", "answer": float("nan")}, "'answer': expected a finite number, got nan"),
    ({"prompt": "a", "answer": None}, "'answer': expected a string or a number, got NoneType"),
    ({"prompt": 5, "answer": "1"}, "'prompt': expected text or chat messages, got int 5"),
    ({"prompt": [], "answer": "1"}, "'prompt': expected text or chat messages, got an empty"),
    ({"prompt": [{"role": "user"}], "answer": "1"}, "message 0 is not a"),
])
def test_bad_rows_are_named(row, message):
    with pytest.raises(RowError, match="^row 0: ") as info:
        prompts_from_rows([row])
    assert message in str(info.value) and info.value.index == 0


def test_jsonl_and_json_task_files_name_the_line(tmp_path):
    rows = [{"q": f"{i} + 1 =", "a": i + 1} for i in range(8)]
    listed = tmp_path / "task.json"
    listed.write_text("[\n" + ",\n".join(json.dumps(r) for r in rows) + "\n]\n")
    lines = tmp_path / "task.jsonl"
    lines.write_text("".join(json.dumps(r) + "\n\n" for r in rows))
    assert read_rows(listed) == (rows, list(range(2, 10)))
    assert read_rows(lines) == (rows, list(range(1, 17, 2)))
    for path in (listed, lines):
        task = DatasetTask(path, prompt_key="q", answer_key="a")
        assert [(e.prompt, e.answer) for e in task.examples] == \
            [(r["q"], str(r["a"])) for r in rows]
        assert len(task.held_out) == 2 and len(task.train) == 6
    rows[5] = {"q": "no answer"}
    listed.write_text("[\n" + ",\n".join(json.dumps(r) for r in rows) + "\n]\n")
    with pytest.raises(ValueError, match=r"task.json:7: expected an object with fields 'q' "
                                         r"and 'a'; it has no 'a'"):
        DatasetTask(listed, prompt_key="q", answer_key="a")
    chat = tmp_path / "chat.jsonl"  # chat prompts: held-out ones are never trained on
    chat.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": c}],
                                        "answer": "1"}) + "\n" for c in "abcdea"))
    task = DatasetTask(chat)
    assert [e.prompt[0]["content"] for e in task.held_out] == ["b", "a"]
    assert {e.prompt[0]["content"] for e in task.train} == {"c", "d", "e"}


def _cli_error(argv, capsys) -> str:
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err, err
    return err


def test_chat_prompts_need_a_chat_template(tmp_path, capsys):
    task = tmp_path / "t.jsonl"
    task.write_text("".join(json.dumps({"prompt": f"{i}", "answer": "1"}) + "\n"
                            for i in range(4)))
    err = _cli_error(["grpo", "--dataset", str(task), "--system-prompt", "Be brief.",
                      "--out", str(tmp_path / "run")], capsys)
    assert "chat-format prompts" in err and "need a model with a chat template" in err
    with pytest.raises(SystemExit) as info:  # the built-in task has plain prompts
        cli.main(["demo", "--system-prompt", "x", "--out", str(tmp_path / "run")])
    assert info.value.code == 2
    assert "unrecognized arguments: --system-prompt" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def _hub_cache(root, repo="org/tiny-qwen2", snapshot="0123abcd"):
    """A Hugging Face Hub cache holding `repo` (the committed tiny qwen2 model), laid out
    as huggingface_hub writes it: models--org--name/{refs/main, snapshots/<hash>/...}."""
    folder = root / f"models--{repo.replace('/', '--')}"
    shutil.copytree(FIXTURES / "qwen2", folder / "snapshots" / snapshot)
    (folder / "refs").mkdir()
    (folder / "refs" / "main").write_text(snapshot)
    (folder / "blobs").mkdir()
    return folder / "snapshots" / snapshot


def test_model_from_the_hub_cache_offline(tmp_path, monkeypatch, capsys):
    pytest.importorskip("huggingface_hub")
    from jaxrl_cache.models.hub import resolve_model
    snapshot = _hub_cache(tmp_path / "hub")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert resolve_model("org/tiny-qwen2") == snapshot
    assert resolve_model(str(snapshot)) == snapshot  # a directory is itself
    for name, message in [
            ("Qwen/Qwen2.5-0.5B-Instruct", "--model Qwen/Qwen2.5-0.5B-Instruct: not a local "
                                           "directory and not in the Hugging Face cache "
                                           "(HF_HUB_OFFLINE is set"),
            ("./missing/model", "--model ./missing/model: no such directory"),
            (str(snapshot / "config.json"), "not a directory")]:
        with pytest.raises(ValueError, match="^--model ") as info:
            resolve_model(name)
        assert message in str(info.value) and "\n" not in str(info.value)
    # the CLI reads the model's config and chat template from the cache and renders every
    # task prompt (a system prompt + chat messages) before its first check of the job
    task = tmp_path / "chat.json"
    task.write_text(json.dumps([{"question": [{"role": "user", "content": f"{i}+1"}],
                                 "answer": f"x\n#### {i + 1}"} for i in range(6)]))
    argv = ["grpo", "--model", "org/tiny-qwen2", "--dataset", str(task), "--prompt-key",
            "question", "--system-prompt", "Add.", "--max-new-tokens", "4", "--out",
            str(tmp_path / "run")]
    tok = load_tokenizer(snapshot)
    longest = max(len(tok.apply_chat_template([{"role": "system", "content": "Add."},
                                               {"role": "user", "content": f"{i}+1"}]))
                  for i in range(6)) + 4
    err = _cli_error(argv + ["--kv-pages", "2"], capsys)
    assert f"--kv-pages 2 cannot hold one sample: the longest prompt + --max-new-tokens, " \
           f"{longest} tokens" in err
    opts = demo.DemoOptions(model="org/tiny-qwen2", dataset=str(task), sft_steps=0)
    assert demo._initial_policy(opts, None, None) == snapshot  # GRPO starts from the cache
    assert "not in the Hugging Face cache" in _cli_error(
        ["demo", "--model", "Qwen/Qwen2.5-0.5B-Instruct", "--out", str(tmp_path / "q")],
        capsys)
    assert not (tmp_path / "q").exists() and not (tmp_path / "run").exists()
