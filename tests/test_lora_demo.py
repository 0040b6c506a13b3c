"""LoRA through the demo, the path users run: `--lora-rank` trains adapters over the frozen
warm-started model, synchronous and asynchronous, single-turn and multi-turn; every sampled
token audited bit for bit; syncs move only the adapters; resume restores them; the final
export is a PEFT adapter directory and a merged HF directory."""
import json

import jax
import numpy as np
import pytest

from jaxrl_cache.app import cli, demo
from jaxrl_cache.models import forward, from_pretrained
from jaxrl_cache.models.peft import peft_state_dict
from safetensors.numpy import load_file
from tests.test_demo import SMALL, read_rows

LORA = dict(lora_rank=4, lora_alpha=8.0, lora_targets=("q_proj", "v_proj", "down_proj"))


def test_lora_demo_trains_adapters_exports_peft_and_merged_and_resumes(tmp_path):
    out = tmp_path / "lora"
    summary = demo.run_demo(demo.DemoOptions(out=str(out), **SMALL, **LORA))
    assert summary["final_version"] == 3 and summary["audit_failures"] == 0
    assert summary["audited_samples"] == 3 * 4 * 2
    rows = read_rows(out)
    assert all(r["logprob_mismatch_max"] == 0.0 and r["audit_failed"] == 0 for r in rows)
    config, base = from_pretrained(out / "sft_model")
    _, merged = from_pretrained(out / "final_model")
    adapter_dir = out / "final_adapter"
    saved = json.loads((adapter_dir / "adapter_config.json").read_text())
    assert (saved["r"], saved["lora_alpha"]) == (4, 8.0)
    assert sorted(saved["target_modules"]) == sorted(LORA["lora_targets"])
    assert (adapter_dir / "adapter_model.safetensors").stat().st_size > 0
    # what was trained: the adapters of the last checkpoint, over the untouched base
    template = demo.TrainState.create(base, config=config, lora=demo.DemoOptions(
        **LORA).lora_config())
    state = demo.restore_checkpoint(out / "checkpoints", template)
    assert int(state.version) == 3
    exported = load_file(str(adapter_dir / "adapter_model.safetensors"))
    want = peft_state_dict(state.config, state.params)
    assert exported.keys() == want.keys()
    assert all(np.array_equal(exported[k], v) for k, v in want.items())
    tokens = jax.random.randint(jax.random.key(0), (2, 12), 0, config.vocab_size)
    np.testing.assert_allclose(np.asarray(forward(merged, config, tokens)),
                               np.asarray(forward(state.model_params, config, tokens)),
                               atol=2e-5, rtol=2e-5)
    resumed = demo.run_demo(demo.DemoOptions(out=str(out), resume=True,
                                             **dict(SMALL, steps=4), **LORA))
    assert resumed["final_version"] == 4 and resumed["audit_failures"] == 0
    assert [r["step"] for r in read_rows(out)] == [0, 1, 2, 3]


@pytest.mark.parametrize("policy", ["recompute", "keep"])
def test_async_lora_demo_syncs_only_the_adapters(tmp_path, policy):
    out = tmp_path / "async"
    summary = demo.run_demo(demo.DemoOptions(out=str(out), async_rollouts=True,
                                             kv_policy=policy, **SMALL, **LORA))
    assert summary["final_version"] == 3 and summary["audit_failures"] == 0
    assert summary["mode"] == f"async/{policy}"
    if policy == "recompute":
        assert summary["mixed_tokens"] == 0
    # the engine lends the trainer's adapters (the async trainer never donates its params)
    # and holds one base for the run: a sync copies nothing
    assert {r["sync_bytes"] for r in read_rows(out)} == {0}


def test_lora_calculator_episodes(tmp_path):
    summary = demo.run_demo(demo.DemoOptions(out=str(tmp_path / "calc"), env="calculator",
                                             **SMALL, **LORA))
    assert summary["final_version"] == 3 and summary["audit_failures"] == 0
    assert all(r["audit_checked_tokens"] == r["generated_tokens"] > 0
               for r in read_rows(tmp_path / "calc"))


@pytest.mark.parametrize("argv, message", [
    (["--lora-rank", "4", "--lora-targets", "qkv"], "--lora-targets: LoRA targets must be"),
    (["--lora-alpha", "16"], "need --lora-rank"),
    (["--lora-rank", "-1"], "--lora-rank"),
    (["--lora-rank", "4", "--mesh", "trainer=1,engine=1"], "not supported"),
])
def test_lora_flags_give_one_line(argv, message, capsys, tmp_path):
    try:
        code = cli.main(["demo", "--out", str(tmp_path / "x"), *argv])
    except SystemExit as e:  # argparse's own checks
        code = e.code
    err = capsys.readouterr().err.strip()
    assert code == 2 and message in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "x").exists()
