"""Hugging Face checkpoints in and out: config.json + safetensors <-> (ModelConfig, params).

Supported: LlamaForCausalLM (rope_scaling linear / llama3), MistralForCausalLM (a sliding
window caps max_seq_len at the window, where windowed and full attention are equal),
Qwen2ForCausalLM (q/k/v bias), Qwen3ForCausalLM (per-head q/k RMSNorm). Any config field
that would change the math and is not implemented raises ConfigError naming the field: a
checkpoint either loads as exactly the model transformers runs, or not at all.

Weights move by the name tables below (ours, Hugging Face name, transposed?): HF Linear
weights are [out, in], ours [in, out]; no rotary permutation is needed (both use the
rotate-half layout). Import reads safetensors through numpy (memory-mapped, no torch) and
fills each stacked [n_layers, ...] leaf directly in the target dtype.
"""
from __future__ import annotations

import json
import pathlib

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from jaxrl_cache.models.config import ModelConfig, RopeScaling
from jaxrl_cache.models.llama import init_params

# (our name in params["layers"], HF name under "model.layers.{i}.", HF weight is [out, in])
LAYER_WEIGHTS = (
    ("attn_norm", "input_layernorm.weight", False),
    ("wq", "self_attn.q_proj.weight", True),
    ("wk", "self_attn.k_proj.weight", True),
    ("wv", "self_attn.v_proj.weight", True),
    ("bq", "self_attn.q_proj.bias", False),
    ("bk", "self_attn.k_proj.bias", False),
    ("bv", "self_attn.v_proj.bias", False),
    ("q_norm", "self_attn.q_norm.weight", False),
    ("k_norm", "self_attn.k_norm.weight", False),
    ("wo", "self_attn.o_proj.weight", True),
    ("bo", "self_attn.o_proj.bias", False),
    ("mlp_norm", "post_attention_layernorm.weight", False),
    ("w_gate", "mlp.gate_proj.weight", True),
    ("w_up", "mlp.up_proj.weight", True),
    ("w_down", "mlp.down_proj.weight", True),
)
# (our top-level name, HF name, transposed)
TOP_WEIGHTS = (
    ("embed", "model.embed_tokens.weight", False),
    ("final_norm", "model.norm.weight", False),
    ("lm_head", "lm_head.weight", True),
)
ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
                 "Qwen3ForCausalLM")
# Fields that never change the forward math (metadata, generation defaults, training-only).
_INERT_FIELDS = frozenset({
    "architectures", "model_type", "transformers_version", "_name_or_path", "torch_dtype",
    "dtype", "use_cache", "initializer_range", "bos_token_id", "eos_token_id", "pad_token_id",
    "output_hidden_states", "output_attentions", "return_dict", "chunk_size_feed_forward",
    "is_encoder_decoder", "id2label", "label2id", "problem_type", "tokenizer_class",
    "attention_dropout", "pretraining_tp", "max_window_layers", "use_return_dict",
    "_attn_implementation_autoset", "tf_legacy_loss", "torchscript", "pruned_heads",
})
# Fields read below (each either mapped onto ModelConfig or refused when not supported).
_READ_FIELDS = frozenset({
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_act",
    "max_position_embeddings", "rms_norm_eps", "rope_theta", "rope_scaling", "rope_parameters",
    "tie_word_embeddings", "attention_bias", "mlp_bias", "sliding_window", "use_sliding_window",
    "layer_types", "partial_rotary_factor",
})
_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}


class ConfigError(ValueError):
    """A Hugging Face config this library would not run exactly; the message names the field."""


def _refuse(field: str, value, why: str):
    raise ConfigError(f"config.json field {field}={value!r} is not supported: {why}")


def _rope(hf: dict) -> tuple[float, RopeScaling | None]:
    """(rope_theta, scaling) from the legacy rope_theta/rope_scaling or v5 rope_parameters."""
    params = dict(hf.get("rope_parameters") or {})
    params.update(hf.get("rope_scaling") or {})
    theta = float(hf.get("rope_theta", params.get("rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return theta, None
    if kind == "linear":
        return theta, RopeScaling("linear", float(params["factor"]))
    if kind == "llama3":
        return theta, RopeScaling("llama3", float(params["factor"]),
                                  float(params["low_freq_factor"]),
                                  float(params["high_freq_factor"]),
                                  int(params["original_max_position_embeddings"]))
    field = "rope_scaling" if hf.get("rope_scaling") else "rope_parameters"
    _refuse(field, kind, "only default, linear and llama3 rotary scaling are implemented")


def config_from_hf(hf: dict, *, dtype: str | None = None) -> ModelConfig:
    """ModelConfig of a Hugging Face config.json dict; ConfigError for anything unsupported.

    dtype: params dtype; default the checkpoint's torch_dtype (float32 if absent).
    """
    archs = hf.get("architectures") or []
    if len(archs) != 1 or archs[0] not in ARCHITECTURES:
        _refuse("architectures", archs, f"supported: {', '.join(ARCHITECTURES)}")
    arch = archs[0]
    for field, value in hf.items():
        if field not in _INERT_FIELDS | _READ_FIELDS and value not in (None, False, 0, [], {}):
            _refuse(field, value, "unknown field (it may change the model's math)")
    if hf.get("hidden_act", "silu") != "silu":
        _refuse("hidden_act", hf["hidden_act"], "only SiLU (SwiGLU MLP) is implemented")
    if hf.get("mlp_bias"):
        _refuse("mlp_bias", hf["mlp_bias"], "MLP biases are not implemented")
    if hf.get("partial_rotary_factor", 1.0) != 1.0:
        _refuse("partial_rotary_factor", hf["partial_rotary_factor"],
                "only full rotary embeddings are implemented")
    if hf.get("use_sliding_window"):
        _refuse("use_sliding_window", True, "per-layer sliding windows are not implemented")
    layer_types = hf.get("layer_types") or []
    if any(t != "full_attention" for t in layer_types):
        _refuse("layer_types", sorted(set(layer_types)), "only full_attention is implemented")
    theta, scaling = _rope(hf)
    max_seq_len = int(hf.get("max_position_embeddings", 2048))
    if arch == "MistralForCausalLM" and hf.get("sliding_window"):
        # within the window, windowed attention is full attention: cap the length there
        max_seq_len = min(max_seq_len, int(hf["sliding_window"]))
    bias = bool(hf.get("attention_bias", False))
    heads = int(hf["num_attention_heads"])
    dtype = dtype or hf.get("torch_dtype") or hf.get("dtype") or "float32"
    if dtype not in _DTYPES:
        raise ConfigError(f"dtype {dtype!r} is not supported; use one of {sorted(_DTYPES)}")
    return ModelConfig(
        vocab_size=int(hf["vocab_size"]), d_model=int(hf["hidden_size"]),
        n_layers=int(hf["num_hidden_layers"]), n_heads=heads,
        n_kv_heads=int(hf.get("num_key_value_heads") or heads),
        head_dim=int(hf.get("head_dim") or hf["hidden_size"] // heads),
        d_ff=int(hf["intermediate_size"]), max_seq_len=max_seq_len, rope_theta=theta,
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        qkv_bias=True if arch == "Qwen2ForCausalLM" else bias and arch != "MistralForCausalLM",
        out_bias=bias and arch in ("LlamaForCausalLM", "Qwen3ForCausalLM"),
        qk_norm=arch == "Qwen3ForCausalLM",
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)), dtype=dtype,
        rope_scaling=scaling)


def config_to_hf(config: ModelConfig) -> dict:
    """The config.json of `config` (legacy rope_theta/rope_scaling keys, read by every
    transformers version and by vLLM). Raises ValueError if no supported architecture has
    this combination of biases."""
    if config.qk_norm:
        arch, extra = "Qwen3ForCausalLM", dict(attention_bias=config.qkv_bias)
        if config.qkv_bias != config.out_bias:
            raise ValueError("Qwen3 has q/k/v and output biases together or neither: "
                             f"qkv_bias={config.qkv_bias}, out_bias={config.out_bias}")
    elif config.qkv_bias and not config.out_bias:
        arch, extra = "Qwen2ForCausalLM", {}
    elif config.qkv_bias == config.out_bias:
        arch, extra = "LlamaForCausalLM", dict(attention_bias=config.qkv_bias, mlp_bias=False)
    else:
        raise ValueError("no supported architecture has out_bias without qkv_bias")
    rope_scaling = None
    if config.rope_scaling is not None:
        s = config.rope_scaling
        rope_scaling = dict(rope_type=s.kind, factor=s.factor)
        if s.kind == "llama3":
            rope_scaling.update(low_freq_factor=s.low_freq_factor,
                                high_freq_factor=s.high_freq_factor,
                                original_max_position_embeddings=s.original_max_position)
    return dict(
        architectures=[arch], model_type=arch[:-len("ForCausalLM")].lower(),
        vocab_size=config.vocab_size, hidden_size=config.d_model,
        intermediate_size=config.d_ff, num_hidden_layers=config.n_layers,
        num_attention_heads=config.n_heads, num_key_value_heads=config.n_kv_heads,
        head_dim=config.head_dim, hidden_act="silu", max_position_embeddings=config.max_seq_len,
        rms_norm_eps=config.norm_eps, rope_theta=config.rope_theta, rope_scaling=rope_scaling,
        tie_word_embeddings=config.tie_embeddings, torch_dtype=config.dtype, **extra)


def _weight_files(path: pathlib.Path) -> dict[str, pathlib.Path]:
    """HF tensor name -> the safetensors file holding it (single file or sharded index)."""
    index = path / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: path / file for name, file in weight_map.items()}
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {path}")
    names = {}
    for file in files:
        with safe_open(file, framework="np") as f:
            names.update({name: file for name in f.keys()})
    return names


def _hf_names(config: ModelConfig, shapes: dict) -> list[tuple[tuple, str, bool]]:
    """Every (our path, HF name, transposed) the model needs; our path is ("embed",) or
    ("layers", name, i)."""
    out = [((ours,), hf, t) for ours, hf, t in TOP_WEIGHTS if ours in shapes]
    for i in range(config.n_layers):
        out += [(("layers", ours, i), f"model.layers.{i}.{hf}", t)
                for ours, hf, t in LAYER_WEIGHTS if ours in shapes["layers"]]
    return out


def from_pretrained(path, *, dtype: str | None = None) -> tuple[ModelConfig, dict]:
    """(ModelConfig, params) of a local Hugging Face model directory.

    Reads config.json and model.safetensors (or the shards of model.safetensors.index.json)
    memory-mapped through numpy, each tensor cast once into its stacked leaf of the target
    dtype (default: the checkpoint's). Peak host memory is about the params once plus one
    leaf. Raises ConfigError for unsupported configs, KeyError naming a missing tensor,
    ValueError naming a tensor of the wrong shape or a tensor the model does not use.
    """
    path = pathlib.Path(path)
    config = config_from_hf(json.loads((path / "config.json").read_text()), dtype=dtype)
    shapes = jax.eval_shape(lambda k: init_params(config, k), jax.random.key(0))
    files = _weight_files(path)
    wanted = _hf_names(config, shapes)
    missing = [hf for _, hf, _ in wanted if hf not in files]
    if missing:
        raise KeyError(f"{path}: missing tensors {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    ignorable = {"lm_head.weight"} if config.tie_embeddings else set()
    unused = sorted(set(files) - {hf for _, hf, _ in wanted} - ignorable)
    unused = [n for n in unused if not n.endswith("rotary_emb.inv_freq")]
    if unused:
        raise ValueError(f"{path}: tensors the model does not use (unsupported architecture "
                         f"variant?): {unused[:5]}")
    np_dtype = _DTYPES[config.dtype]
    by_leaf: dict[tuple, list] = {}
    for ours, hf, t in wanted:
        by_leaf.setdefault(ours[:2], []).append((ours, hf, t))
    handles = {}
    params: dict = {"layers": {}}
    try:
        for leaf, items in by_leaf.items():
            shape = (shapes[leaf[0]] if len(leaf) == 1 else shapes["layers"][leaf[1]]).shape
            buf = np.empty(shape, np_dtype)
            for ours, hf, t in items:
                file = files[hf]
                if file not in handles:
                    handles[file] = safe_open(file, framework="np").__enter__()
                tensor = handles[file].get_tensor(hf)
                tensor = tensor.T if t else tensor
                dest = buf if len(ours) == 1 else buf[ours[2]]
                if tensor.shape != dest.shape:
                    raise ValueError(f"{hf} has shape {list(tensor.shape)} (after transpose: "
                                     f"{t}); the config needs {list(dest.shape)}")
                dest[...] = tensor
                del tensor
            value = jnp.asarray(buf)
            del buf
            if len(leaf) == 1:
                params[leaf[0]] = value
            else:
                params["layers"][leaf[1]] = value
    finally:
        for handle in handles.values():
            handle.__exit__(None, None, None)
    return config, params


def save_pretrained(path, config: ModelConfig, params, *, tokenizer=None,
                    max_shard_bytes: int = 4 << 30) -> pathlib.Path:
    """Writes a Hugging Face directory transformers (and vLLM) load as the same model.

    config.json, model.safetensors (or model-0000i-of-0000n.safetensors shards with
    model.safetensors.index.json past max_shard_bytes), in config.dtype; with a `Tokenizer`
    also its files and generation_config.json (bos/eos/stop ids). Returns the directory.
    """
    path = pathlib.Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config_to_hf(config), indent=2))
    shapes = jax.eval_shape(lambda k: init_params(config, k), jax.random.key(0))
    np_dtype = _DTYPES[config.dtype]
    host = jax.tree.map(np.asarray, params)
    shards: list[dict] = [{}]
    size = 0
    for ours, hf, t in _hf_names(config, shapes):
        array = host[ours[0]] if len(ours) == 1 else host["layers"][ours[1]][ours[2]]
        array = np.ascontiguousarray((array.T if t else array).astype(np_dtype))
        if size and size + array.nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][hf] = array
        size += array.nbytes
    metadata = {"format": "pt"}  # transformers requires the pt format tag
    if len(shards) == 1:
        save_file(shards[0], path / "model.safetensors", metadata=metadata)
    else:
        weight_map = {}
        for i, shard in enumerate(shards):
            name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, path / name, metadata=metadata)
            weight_map.update({hf: name for hf in shard})
        total = sum(a.nbytes for shard in shards for a in shard.values())
        (path / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    if tokenizer is not None:
        tokenizer.save(path)
        stop = list(tokenizer.stop_token_ids)
        generation = dict(bos_token_id=tokenizer.bos_token_id,
                          eos_token_id=stop[0] if len(stop) == 1 else stop)
        (path / "generation_config.json").write_text(json.dumps(generation, indent=2))
    return path
