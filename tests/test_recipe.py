"""examples/gsm8k_grpo.py, the recipe of docs/api.md ("From TRL"), runs two GRPO steps on the
demo's built-in model: GSM8K rows in, both rewards logged by name, held-out evaluation, every sample
audited, CSV and TensorBoard written, a checkpoint at version 2 and an HF export that loads."""
import csv
import importlib.util
import pathlib

from jaxrl_cache import from_pretrained, latest_checkpoint_version

RECIPE = pathlib.Path(__file__).resolve().parents[1] / "examples/gsm8k_grpo.py"


def test_gsm8k_recipe_runs_two_steps(tmp_path):
    spec = importlib.util.spec_from_file_location("gsm8k_grpo", RECIPE)
    recipe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(recipe)
    out = tmp_path / "run"
    record = recipe.main(["--steps", "2", "--max-new-tokens", "8", "--eval-every", "1",
                          "--out", str(out)])
    assert record["version"] == 1 and record["audited_samples"] == 16  # 2 prompts x 8
    assert {"rewards/correct/mean", "rewards/format/mean", "eval/exact_match",
            "eval/pass@4", "reward_std", "zero_std_groups"} <= set(record)
    rows = list(csv.DictReader(open(out / "metrics.csv")))
    assert [int(float(r["step"])) for r in rows] == [0, 1]
    assert all(r["eval/pass@4"] != "" for r in rows)
    assert any((out / "tensorboard").rglob("events.out.tfevents*"))
    assert latest_checkpoint_version(out / "checkpoints") == 2
    config, params = from_pretrained(out / "policy")
    assert config.vocab_size == params["embed"].shape[0]
