"""LoRA export: the PEFT adapter directory (names, shapes, values, config fields), the merged
Hugging Face model (loads back as the attached model), and (slow, in the torch venv)
peft.PeftModel.from_pretrained running our adapter as our model."""
import json
import os
import pathlib
import subprocess

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors import safe_open

from jaxrl_cache.models import (ModelConfig, forward, from_pretrained, init_params, lora,
                                save_peft_adapter, save_pretrained)
from jaxrl_cache.models.peft import ADAPTER_CONFIG, ADAPTER_WEIGHTS, PREFIX
from jaxrl_cache.rl.train import TrainState

ROOT = pathlib.Path(__file__).resolve().parents[1]
TORCH_PYTHON = ROOT / ".venv-torch" / "bin" / "python"
LLAMA = ModelConfig(vocab_size=56, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
                    d_ff=48, max_seq_len=64, norm_eps=1e-5, tie_embeddings=False)
QWEN2 = ModelConfig.tiny(vocab_size=40, max_seq_len=64)  # qkv bias, tied embeddings
ALL = lora.LoraConfig(rank=4, alpha=16, targets="all-linear")
MODULES = {"wq": "self_attn.q_proj", "wk": "self_attn.k_proj", "wv": "self_attn.v_proj",
           "wo": "self_attn.o_proj", "w_gate": "mlp.gate_proj", "w_up": "mlp.up_proj",
           "w_down": "mlp.down_proj"}


def random_params(config, seed):
    """Every leaf redrawn (norms around 1, nonzero biases) so each mapping is exercised."""
    rng = np.random.default_rng(seed)

    def draw(path, x):
        name = jax.tree_util.keystr(path)
        z = rng.standard_normal(x.shape).astype(np.float32)
        if "norm" in name:
            return jnp.asarray(1 + 0.3 * z)
        if "'b" in name:  # bq, bk, bv, bo
            return jnp.asarray(0.3 * z)
        return jnp.asarray(z if "embed" in name else z * 1.5 / x.shape[-2] ** 0.5)

    return jax.tree_util.tree_map_with_path(draw, init_params(config, jax.random.key(0)))


def trained_adapters(config, cfg, seed=3):
    """PEFT-initialised adapters with B moved well off zero (a trained adapter)."""
    adapters = lora.init_adapters(config, cfg, jax.random.key(seed))
    keys = iter(jax.random.split(jax.random.key(seed + 1), len(adapters)))
    return {n: {"a": ab["a"], "b": 0.5 * jax.random.normal(next(keys), ab["b"].shape)}
            for n, ab in adapters.items()}


def read_safetensors(file) -> dict:
    with safe_open(file, framework="np") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, f.metadata()


def test_peft_adapter_directory_round_trips_to_our_adapters(tmp_path):
    adapters = trained_adapters(LLAMA, ALL)
    out = save_peft_adapter(tmp_path / "adapter", LLAMA, (adapters, ALL),
                            base_model_name_or_path="org/base")
    assert out == tmp_path / "adapter"
    cfg = json.loads((out / ADAPTER_CONFIG).read_text())
    assert {k: cfg[k] for k in ("peft_type", "task_type", "r", "lora_alpha", "lora_dropout",
                                "bias", "fan_in_fan_out", "use_rslora", "use_dora",
                                "base_model_name_or_path")} == dict(
        peft_type="LORA", task_type="CAUSAL_LM", r=4, lora_alpha=16, lora_dropout=0.0,
        bias="none", fan_in_fan_out=False, use_rslora=False, use_dora=False,
        base_model_name_or_path="org/base")
    assert cfg["target_modules"] == list(lora.ALL_LINEAR)
    tensors, metadata = read_safetensors(out / ADAPTER_WEIGHTS)
    assert metadata == {"format": "pt"}
    want = {f"{PREFIX}model.layers.{i}.{MODULES[n]}.lora_{p}.weight"
            for n in MODULES for i in range(LLAMA.n_layers) for p in "AB"}
    assert set(tensors) == want
    for name, ab in adapters.items():
        for i in range(LLAMA.n_layers):
            key = f"base_model.model.model.layers.{i}.{MODULES[name]}"
            a, b = tensors[f"{key}.lora_A.weight"], tensors[f"{key}.lora_B.weight"]
            assert a.shape == (4, ab["a"].shape[1]) and b.shape == (ab["b"].shape[2], 4)
            assert a.dtype == b.dtype == np.float32
            np.testing.assert_array_equal(a.T, np.asarray(ab["a"][i]))
            np.testing.assert_array_equal(b.T, np.asarray(ab["b"][i]))


def test_a_lora_train_state_exports_its_adapters_and_mismatches_are_refused(tmp_path):
    qv = lora.LoraConfig(rank=2, alpha=3.5)
    base = random_params(QWEN2, 0)
    state = TrainState.create(base, config=QWEN2, lora=qv,
                              adapters=trained_adapters(QWEN2, qv))
    save_peft_adapter(tmp_path / "a", QWEN2, state)
    cfg = json.loads((tmp_path / "a" / ADAPTER_CONFIG).read_text())
    assert (cfg["r"], cfg["lora_alpha"], cfg["target_modules"]) == (2, 3.5,
                                                                   ["q_proj", "v_proj"])
    assert cfg["base_model_name_or_path"] is None
    tensors, _ = read_safetensors(tmp_path / "a" / ADAPTER_WEIGHTS)
    assert len(tensors) == 2 * 2 * QWEN2.n_layers
    np.testing.assert_array_equal(
        tensors[f"{PREFIX}model.layers.1.self_attn.v_proj.lora_B.weight"].T,
        np.asarray(state.params["wv"]["b"][1]))
    full = TrainState.create(base, config=QWEN2)
    with pytest.raises(ValueError, match="trains the full model"):
        save_peft_adapter(tmp_path / "b", QWEN2, full)
    with pytest.raises(ValueError, match=r"the adapters are \['wq', 'wv'\], the LoraConfig"):
        save_peft_adapter(tmp_path / "b", QWEN2, (state.params, ALL))
    with pytest.raises(ValueError, match="rank 2, the LoraConfig rank 8"):
        save_peft_adapter(tmp_path / "b", QWEN2, (state.params, lora.LoraConfig()))
    with pytest.raises(ValueError, match="LoRA adapter wq.a"):
        save_peft_adapter(tmp_path / "b", LLAMA, state)
    with pytest.raises(TypeError, match="LoRA TrainState or an"):
        save_peft_adapter(tmp_path / "b", QWEN2, state.params)
    nan = dict(state.params, wv=dict(state.params["wv"], b=state.params["wv"]["b"].at[
        1, 0, 0].set(np.nan)))
    with pytest.raises(ValueError, match=r"NaN or Inf \(wv.b\); nothing written"):
        save_peft_adapter(tmp_path / "b", QWEN2, (nan, qv))
    assert not (tmp_path / "b").exists()


def test_merged_export_loads_back_as_the_attached_model(tmp_path):
    base = random_params(LLAMA, 0)
    state = TrainState.create(base, config=LLAMA, lora=ALL, adapters=trained_adapters(LLAMA, ALL))
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, LLAMA.vocab_size, (2, 24)),
                         jnp.int32)
    want = np.asarray(forward(state.model_params, LLAMA, tokens))
    effect = np.abs(want - np.asarray(forward(base, LLAMA, tokens))).max()
    assert effect > 0.1  # not the base
    with pytest.raises(ValueError, match="carry LoRA adapters, which this export would drop"):
        save_pretrained(tmp_path, LLAMA, state.model_params)
    assert not any(tmp_path.iterdir())
    merged = lora.merged(state.model_params)
    assert jax.tree.structure(merged) == jax.tree.structure(base)
    save_pretrained(tmp_path, LLAMA, merged)
    config, params = from_pretrained(tmp_path)
    assert config == LLAMA
    for x, y in zip(jax.tree.leaves(params), jax.tree.leaves(merged)):  # f32: exact
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    # W x + s (x A) B vs (W + s A B) x: f32 rounding only, whose size is the CPU's (its
    # kernels' summation order); a wrong merge (scale, a transposed or dropped adapter)
    # moves logits by the adapters' whole effect, >= 100x this bound
    np.testing.assert_allclose(np.asarray(forward(params, config, tokens)), want,
                               atol=effect / 100, rtol=0)


PEFT_RUN = """
import sys
import numpy as np
import peft
import torch
import transformers as tf
torch.set_num_threads(2)
base, adapter, tokens, out = sys.argv[1:]
model = tf.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
model = peft.PeftModel.from_pretrained(model, adapter).eval()
ids = torch.tensor(np.load(tokens))
with torch.no_grad():
    logits = model(ids).logits.numpy()
    with model.disable_adapter():
        base_logits = model(ids).logits.numpy()
np.savez(out, logits=logits, base=base_logits)
"""


def _peft_available() -> bool:
    if not TORCH_PYTHON.exists():
        return False
    done = subprocess.run([str(TORCH_PYTHON), "-c", "import peft, torch, transformers"],
                          capture_output=True, timeout=300)
    return done.returncode == 0


@pytest.mark.slow
@pytest.mark.parametrize("config,cfg", [(LLAMA, ALL), (QWEN2, lora.LoraConfig(rank=8,
                                                                              alpha=8))],
                         ids=["llama_all_linear", "qwen2_q_v"])
def test_peft_runs_our_adapter_as_our_model(tmp_path, config, cfg):
    """The base through save_pretrained, the adapters through save_peft_adapter; transformers
    + peft (the torch venv, a subprocess) compute the attached model's logits."""
    if not _peft_available():
        pytest.skip(f"needs torch, transformers and peft in {TORCH_PYTHON.parent.parent}")
    base = random_params(config, 0)
    adapters = trained_adapters(config, cfg)
    save_pretrained(tmp_path / "base", config, base)
    save_peft_adapter(tmp_path / "adapter", config, (adapters, cfg),
                      base_model_name_or_path=tmp_path / "base")
    tokens = np.random.default_rng(2).integers(0, config.vocab_size, (2, 24))
    np.save(tmp_path / "tokens.npy", tokens)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX", "XLA"))}
    done = subprocess.run([str(TORCH_PYTHON), "-c", PEFT_RUN, str(tmp_path / "base"),
                           str(tmp_path / "adapter"), str(tmp_path / "tokens.npy"),
                           str(tmp_path / "out.npz")], capture_output=True, text=True,
                          timeout=600, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    with np.load(tmp_path / "out.npz") as theirs:
        theirs = dict(theirs)
    ids = jnp.asarray(tokens, jnp.int32)
    ours = np.asarray(forward(lora.attach(lora.frozen_part(base, cfg), adapters), config, ids))
    np.testing.assert_allclose(theirs["base"], np.asarray(forward(base, config, ids)),
                               atol=1e-4, rtol=0)
    assert np.abs(ours - theirs["base"]).max() > 0.1  # the adapter changes the model
    np.testing.assert_allclose(theirs["logits"], ours, atol=1e-4, rtol=0)
