"""Eval during training (issue 36, item 7): the library's `rl.evaluate.evaluate` (sampled
exact match, pass@k, greedy) and `--eval-every` records, through a real config file and a
GSM8K-format JSON task, then a resume that may change --eval-every only."""
import json

import jax
import pytest

from jaxrl_cache.app import cli, demo
from jaxrl_cache.app.tasks import char_tokenizer
from jaxrl_cache.models import init_params
from jaxrl_cache.rl.evaluate import evaluate
from jaxrl_cache.rollout import CacheConfig, RolloutEngine, SamplingParams
from tests.test_demo import read_rows


@pytest.fixture(scope="module")
def engine_and_params():
    tok = char_tokenizer()
    config = demo.builtin_model_config(tok.vocab_size)
    engine = RolloutEngine(config, CacheConfig(num_pages=128, page_size=8), tokenizer=tok)
    return engine, init_params(config, jax.random.key(0)), tok


def test_evaluate_sampled_pass_at_k_and_greedy(engine_and_params):
    engine, params, tok = engine_and_params
    prompts = [tok.encode(f"number: {n}=") for n in ("12", "345", "6789")]
    sampling = SamplingParams(max_new_tokens=3, temperature=1.0,
                              stop_token_ids=tok.stop_token_ids)
    seen = []

    def first_of_each(i, sample, text):  # right: the first completion of each prompt
        assert tuple(sample.prompt_ids) == tuple(prompts[i]) and text == sample.text
        seen.append(i)
        return seen.count(i) == 1

    key = jax.random.key(1)
    out = evaluate(engine, params, 0, prompts, first_of_each, sampling, rng=key, k=4)
    assert sorted(seen) == [0] * 4 + [1] * 4 + [2] * 4
    assert out["exact_match"] == 0.25 and out["pass@4"] == 1.0 and out["samples"] == 12
    assert "greedy_exact_match" not in out and out["seconds"] > 0
    greedy = engine.rollout(params, 0, prompts, SamplingParams(
        max_new_tokens=3, temperature=0.0, stop_token_ids=tok.stop_token_ids), rng=key)
    texts = {s.group: s.text for s in greedy.samples}

    def startswith_1(i, sample, text):
        return text.startswith("1")

    out = evaluate(engine, params, 0, prompts, lambda i, s, t: t == texts[i] and i != 2,
                   sampling, rng=key, k=1, greedy=True)
    assert out["greedy_exact_match"] == pytest.approx(2 / 3) and "pass@1" not in out
    assert out["samples"] == 6
    again = [evaluate(engine, params, 0, prompts, startswith_1, sampling, rng=key, k=4)
             for _ in range(2)]  # the same rng: the same numbers
    assert again[0]["exact_match"] == again[1]["exact_match"]
    with pytest.raises(ValueError, match="at least one prompt"):
        evaluate(engine, params, 0, [], startswith_1, sampling, rng=key)


GSM8K_LIKE = [{"question": f"{a}+{b}=", "answer": f"{a} + {b} = <<{a}+{b}={a + b}>>"
                                                  f"{a + b}\n#### {a + b:,}"}
              for a, b in [(3, 4), (10, 20), (999, 1), (5, 5), (12, 30), (7, 8), (1, 1),
                           (40, 2)]]


def test_eval_every_records_through_a_config_file_then_resume(tmp_path, capsys):
    """A JSON dataset of GSM8K rows and a YAML config: every 2nd step's row holds the eval
    metrics, the last one equals the after-GRPO eval (same prompts, key and params); a
    --resume may change --eval-every, not --eval-k."""
    task = tmp_path / "gsm8k.json"
    task.write_text(json.dumps(GSM8K_LIKE))
    config = tmp_path / "run.yaml"
    config.write_text(f"dataset: {task}\nprompt-key: question\neval_every: 2\neval_k: 2\n"
                      f"eval_greedy: true\nsft_steps: 2\nsft_batch: 4\neval_prompts: 2\n"
                      f"group_size: 2\nprompts_per_step: 2\nmax_new_tokens: 5\n"
                      f"checkpoint_every: 2\n")
    out = tmp_path / "run"
    assert cli.main(["grpo", "--config", str(config), "--steps", "2", "--out",
                     str(out)]) == 0
    text = capsys.readouterr().out
    rows = read_rows(out)
    assert [r["step"] for r in rows] == [0, 1] and "eval/exact_match" not in rows[0]
    last = rows[1]
    for key in ("eval/exact_match", "eval/pass@2", "eval/greedy_exact_match"):
        assert 0.0 <= last[key] <= 1.0
    assert last["eval/samples"] == 2 * 2 + 2 and last["eval/seconds"] > 0
    assert last["eval/pass@2"] >= last["eval/exact_match"]
    assert f"after GRPO {last['eval/exact_match']:.3f}" in text
    assert all(r["sample"]["answer"] in {str(x["answer"].split("#### ")[1]).replace(",", "")
                                         for x in GSM8K_LIKE} for r in rows)
    assert "1000" in {e.answer for e in demo.DatasetTask(task, prompt_key="question").examples}
    assert cli.main(["grpo", "--config", str(config), "--out", str(out), "--resume",
                     "--steps", "3", "--eval-k", "3"]) == 2
    assert "--eval-k 3 (the run has 2)" in capsys.readouterr().err
    assert cli.main(["grpo", "--config", str(config), "--out", str(out), "--resume",
                     "--steps", "3", "--eval-every", "1"]) == 0
    rows = read_rows(out)
    assert [r["step"] for r in rows] == [0, 1, 2] and "eval/pass@2" in rows[2]
