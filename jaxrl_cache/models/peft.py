"""LoRA adapters out as a PEFT adapter directory (peft.PeftModel.from_pretrained loads it).

    adapter_config.json        peft_type LORA, task_type CAUSAL_LM, r, lora_alpha,
                               target_modules, lora_dropout 0, bias none, fan_in_fan_out false
    adapter_model.safetensors  base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight
                               [r, in], ...lora_B.weight [out, r] (mlp.gate_proj, ...), in
                               the adapters' dtype

PEFT computes W x + (alpha / r) * B (A x) with torch Linear weights ([out, in]): lora_A is our
a[i] transposed, lora_B our b[i] transposed, and the scale is the same alpha / r (no rsLoRA),
so the adapter on the same base is the same model. The merged model (adapters folded into
the base) is `hf.save_pretrained(path, config, lora.merged(params))`.
"""
from __future__ import annotations

import json
import pathlib

import jax
import numpy as np
from safetensors.numpy import save_file

from jaxrl_cache.models.config import ModelConfig
from jaxrl_cache.models.families import family_of
from jaxrl_cache.models.lora import HF_NAMES, LoraConfig, check_adapters

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PREFIX = "base_model.model."  # PeftModel wraps the LoraModel that wraps the transformers model


def adapter_config(lora: LoraConfig, base_model_name_or_path=None) -> dict:
    """The adapter_config.json of `lora` (PEFT's LoraConfig fields; defaults spelled out
    where another value would change the math)."""
    alpha = int(lora.alpha) if float(lora.alpha).is_integer() else lora.alpha
    name = None if base_model_name_or_path is None else str(base_model_name_or_path)
    return dict(peft_type="LORA", task_type="CAUSAL_LM", r=lora.rank, lora_alpha=alpha,
                target_modules=list(lora.targets), lora_dropout=0.0, bias="none",
                fan_in_fan_out=False, use_rslora=False, use_dora=False, lora_bias=False,
                modules_to_save=None, layers_to_transform=None, rank_pattern={},
                alpha_pattern={}, init_lora_weights=True, inference_mode=True,
                base_model_name_or_path=name)


def peft_state_dict(config: ModelConfig, adapters: dict) -> dict[str, np.ndarray]:
    """PEFT tensor name -> host array of `adapters` ({name: {"a": [n_layers, in, r],
    "b": [n_layers, r, out]}}): lora_A [r, in], lora_B [out, r] per layer, dtype kept,
    named by the config's family ("wq" -> "self_attn.q_proj")."""
    modules = {ours: hf[:-len(".weight")] for ours, hf, _ in family_of(config).layer_weights
               if ours in HF_NAMES.values()}
    out = {}
    for name, ab in adapters.items():
        a, b = np.asarray(jax.device_get(ab["a"])), np.asarray(jax.device_get(ab["b"]))
        for i in range(a.shape[0]):
            module = f"{PREFIX}model.layers.{i}.{modules[name]}"
            out[f"{module}.lora_A.weight"] = np.ascontiguousarray(a[i].T)
            out[f"{module}.lora_B.weight"] = np.ascontiguousarray(b[i].T)
    return out


def _adapters_and_config(source) -> tuple[dict, LoraConfig]:
    """(adapters, LoraConfig) of a LoRA TrainState or an (adapters, LoraConfig) pair."""
    if isinstance(source, tuple) and len(source) == 2:
        adapters, lora = source
    elif hasattr(source, "lora") and hasattr(source, "params"):  # a TrainState
        if source.lora is None:
            raise ValueError("the TrainState trains the full model, not LoRA adapters: "
                             "export it with hf.save_pretrained")
        adapters, lora = source.params, source.lora
    else:
        raise TypeError(f"expected a LoRA TrainState or an (adapters, LoraConfig) pair, got "
                        f"{type(source).__name__}")
    if not isinstance(lora, LoraConfig):
        raise TypeError(f"expected a LoraConfig, got {type(lora).__name__}")
    return adapters, lora


def save_peft_adapter(path, config: ModelConfig, source, *,
                      base_model_name_or_path=None) -> pathlib.Path:
    """Writes `source` (a LoRA TrainState, or an (adapters, LoraConfig) pair) as a PEFT
    adapter directory at `path` (created; the two adapter files replaced, others left).
    Returns the directory. ValueError (one line), nothing written, unless the adapters fit
    `config`, are exactly the LoraConfig's targets at its rank, and are finite."""
    adapters, lora = _adapters_and_config(source)
    check_adapters(config, adapters)
    want = {HF_NAMES[t] for t in lora.targets}
    if set(adapters) != want:
        raise ValueError(f"the adapters are {sorted(adapters)}, the LoraConfig's targets "
                         f"need {sorted(want)}")
    rank = next(iter(adapters.values()))["a"].shape[-1]
    if rank != lora.rank:
        raise ValueError(f"the adapters have rank {rank}, the LoraConfig rank {lora.rank}")
    bad = sorted(f"{name}.{part}" for name, ab in adapters.items() for part, x in ab.items()
                 if not np.isfinite(np.asarray(x)).all())
    if bad:
        raise ValueError(f"the adapters hold NaN or Inf ({', '.join(bad)}); nothing written")
    path = pathlib.Path(path)
    path.mkdir(parents=True, exist_ok=True)
    save_file(peft_state_dict(config, adapters), path / ADAPTER_WEIGHTS, metadata={"format": "pt"})
    (path / ADAPTER_CONFIG).write_text(json.dumps(
        adapter_config(lora, base_model_name_or_path), indent=2))
    return path
