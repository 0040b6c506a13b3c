"""Hugging Face checkpoints in and out: config.json + safetensors <-> (ModelConfig, params).

Supported: LlamaForCausalLM (rope_scaling linear / llama3), MistralForCausalLM (a sliding
window caps max_seq_len at the window, where windowed and full attention are equal),
Qwen2ForCausalLM (q/k/v bias), Qwen3ForCausalLM (per-head q/k RMSNorm). Any config field
that would change the math and is not implemented raises ConfigError naming the field: a
checkpoint either loads as exactly the model transformers runs, or not at all. Metadata
(names, versions, generation defaults, training-only knobs, fields of features that are
off) is accepted: tests/test_hf_configs.py holds the field lists of real hub checkpoints.

A broken directory raises ModelFileError (a ValueError) whose first line names the file and
the field or tensor: unreadable JSON, a config that is not an object, a missing, mistyped or
non-positive field, a truncated or corrupt safetensors file, a missing tensor, a tensor
whose header dtype is not floating point, an index entry outside the directory.
Weights are read as transformers reads them: model.safetensors, else the shards of
model.safetensors.index.json; a directory holding both is refused (transformers would pick
the single file, an older save's loader the index). tie_word_embeddings with a distinct
lm_head.weight in the file is refused too: transformers versions disagree on which head
that checkpoint means (4.x ties and drops the file's head, 5.x keeps it).

Weights move by the name tables below (ours, Hugging Face name, transposed?): HF Linear
weights are [out, in], ours [in, out]; no rotary permutation is needed (both use the
rotate-half layout). Import reads safetensors through numpy (memory-mapped, no torch) and
fills each stacked [n_layers, ...] leaf directly in the target dtype.
"""
from __future__ import annotations

import json
import math
import pathlib
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from jaxrl_cache.models.config import ModelConfig, RopeScaling
from jaxrl_cache.models.llama import init_params
from jaxrl_cache.models.lora import ADAPTERS, SCALE

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
_MODEL_TYPES = {arch: arch[:-len("ForCausalLM")].lower() for arch in ARCHITECTURES}
# Fields that never change the forward math, whatever their value: metadata, generation
# defaults (SamplingParams decides sampling), training-only knobs (dropout, init), fields
# of features another field turns off (max_window_layers: use_sliding_window is refused).
_INERT_FIELDS = frozenset({
    "architectures", "model_type", "transformers_version", "_name_or_path",
    "_model_name_or_path", "_commit_hash", "torch_dtype", "dtype", "use_cache",
    "initializer_range", "bos_token_id", "eos_token_id", "pad_token_id", "sep_token_id",
    "decoder_start_token_id", "output_hidden_states", "output_attentions", "return_dict",
    "use_return_dict", "chunk_size_feed_forward", "is_encoder_decoder", "id2label", "label2id",
    "problem_type", "tokenizer_class", "attention_dropout", "max_window_layers",
    "_attn_implementation_autoset", "tf_legacy_loss", "torchscript", "pruned_heads",
    "use_bfloat16", "finetuning_task", "prefix", "task_specific_params",
    "keys_to_ignore_at_inference", "is_llama_config", "transformers.js_config",
    "max_length", "min_length", "do_sample", "early_stopping", "num_beams", "num_beam_groups",
    "diversity_penalty", "temperature", "top_k", "top_p", "typical_p", "repetition_penalty",
    "length_penalty", "no_repeat_ngram_size", "encoder_no_repeat_ngram_size", "bad_words_ids",
    "num_return_sequences", "output_scores", "return_dict_in_generate", "forced_bos_token_id",
    "forced_eos_token_id", "remove_invalid_values", "exponential_decay_length_penalty",
    "suppress_tokens", "begin_suppress_tokens",
})
# Fields read below (each either mapped onto ModelConfig or refused when not supported).
_READ_FIELDS = frozenset({
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_act",
    "max_position_embeddings", "rms_norm_eps", "rope_theta", "rope_scaling", "rope_parameters",
    "tie_word_embeddings", "attention_bias", "mlp_bias", "sliding_window", "use_sliding_window",
    "layer_types", "partial_rotary_factor", "pretraining_tp",
})
# Any other field is refused unless it is off (None, False, 0, [], {}: e.g. use_mrope false,
# rope_interleaved false, which transformers ignores for these architectures).
_ROPE_KEYS = {"default": {"rope_theta"}, "linear": {"rope_theta", "factor"},
              "llama3": {"rope_theta", "factor", "low_freq_factor", "high_freq_factor",
                         "original_max_position_embeddings"}}
_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}
_FLOAT_HEADER_DTYPES = frozenset({"F16", "BF16", "F32", "F64"})
SINGLE_FILE, INDEX_FILE = "model.safetensors", "model.safetensors.index.json"
_SHARD_FILE = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")
# other weight formats transformers or vLLM may load from a directory (save_pretrained refuses
# to write beside them)
_FOREIGN_WEIGHTS = re.compile(r".*\.(safetensors|bin|pt|pth|gguf)(\.index\.json)?")


class ModelFileError(ValueError):
    """A model directory file this library cannot read as written; the message names the
    file and the field or tensor."""


class ConfigError(ModelFileError):
    """A Hugging Face config this library would not run exactly; the message names the field."""


def read_json(file: pathlib.Path):
    """The JSON value of `file`; ModelFileError naming it (and the position) if it is not
    UTF-8 JSON. A missing file raises FileNotFoundError."""
    try:
        return json.loads(file.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelFileError(f"{file}: not valid JSON ({e})") from None


def _refuse(source: str, field: str, value, why: str):
    """A one-line ConfigError (a field name with control characters is written escaped)."""
    field = field if field.isprintable() else ascii(field)
    raise ConfigError(f"{source} field {field:.200}={value!r:.200} is not supported: {why}")


def _number(d: dict, key: str, kind: type, source: str, *, label: str | None = None,
            default=None):
    """d[key] as a positive int (a JSON integer) or a positive finite float; `default` when
    absent or null. ConfigError naming `label` (default `key`) otherwise."""
    label = label or key
    value = d.get(key)
    if value is None:
        if default is None:
            raise ConfigError(f"{source}: required field {label} is missing")
        return default
    ok = not isinstance(value, bool) and (isinstance(value, int) if kind is int else
                                          isinstance(value, (int, float)))
    if ok and isinstance(value, int):  # math.isfinite and float() overflow past 2**1024;
        ok = value.bit_length() <= (31 if kind is int else 1024)  # sizes index int32 arrays
    elif ok:
        ok = math.isfinite(value)
    if not ok or value <= 0:
        raise ConfigError(f"{source} field {label}={value!r:.200}: expected a positive "
                          f"{'integer below 2**31' if kind is int else 'number'}")
    return kind(value)


def _flag(hf: dict, key: str, source: str) -> bool:
    """hf[key] as a bool (absent or null: False); ConfigError naming it if not a JSON bool."""
    value = hf.get(key)
    if value is not None and not isinstance(value, bool):
        raise ConfigError(f"{source} field {key}={value!r:.200}: expected true or false")
    return bool(value)


def _rope_dict(hf: dict, key: str, source: str) -> dict:
    """The rope_scaling / rope_parameters object ({} when absent), "type" read as "rope_type"."""
    value = hf.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ConfigError(f"{source} field {key}={value!r:.200}: expected an object")
    value = dict(value)
    if "type" in value:
        value.setdefault("rope_type", value.pop("type"))
    return value


def _rope(hf: dict, source: str) -> tuple[float, RopeScaling | None]:
    """(rope_theta, scaling) from the legacy rope_theta/rope_scaling keys and the v5
    rope_parameters; where both give a key they must agree."""
    legacy = _rope_dict(hf, "rope_scaling", source)
    if hf.get("rope_theta") is not None:
        legacy["rope_theta"] = hf["rope_theta"]
    v5 = _rope_dict(hf, "rope_parameters", source)
    for key in sorted(legacy.keys() & v5.keys()):
        if legacy[key] != v5[key]:
            other = "rope_theta" if key == "rope_theta" else f"rope_scaling.{key}"
            _refuse(source, f"rope_parameters.{key}", v5[key],
                    f"it disagrees with {other}={legacy[key]!r}")
    params = {**v5, **legacy}
    where = "rope_scaling" if hf.get("rope_scaling") else "rope_parameters"

    def at(key: str) -> str:
        """The field a merged key came from (the legacy keys win the merge); a missing one
        is named in the object the config uses."""
        if key == "rope_theta" and key in legacy:
            return key
        field = "rope_scaling" if key in legacy else "rope_parameters" if key in v5 else where
        return f"{field}.{key}"

    kind = params.pop("rope_type", "default")
    if not isinstance(kind, str) or kind not in _ROPE_KEYS:
        _refuse(source, at("rope_type"), kind,
                "only default, linear and llama3 rotary scaling are implemented")
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        _refuse(source, at("partial_rotary_factor"), params["partial_rotary_factor"],
                "only full rotary embeddings are implemented")
    params.pop("partial_rotary_factor", None)
    unknown = sorted(set(params) - _ROPE_KEYS[kind])
    if unknown:
        _refuse(source, at(unknown[0]), params[unknown[0]],
                f"not a parameter of {kind} rotary embeddings")

    def num(key, cast=float):
        return _number(params, key, cast, source, label=at(key))

    theta = _number(params, "rope_theta", float, source, default=10000.0,
                    label=at("rope_theta"))
    try:
        if kind == "linear":
            return theta, RopeScaling("linear", num("factor"))
        if kind == "llama3":
            return theta, RopeScaling("llama3", num("factor"), num("low_freq_factor"),
                                      num("high_freq_factor"),
                                      num("original_max_position_embeddings", int))
    except ConfigError:
        raise
    except ValueError as e:  # RopeScaling's own checks
        raise ConfigError(f"{source} field {where}: {e}") from None
    return theta, None


def config_from_hf(hf, *, dtype: str | None = None,
                   source: str = "config.json") -> ModelConfig:
    """ModelConfig of a Hugging Face config.json dict; ConfigError naming `source` and the
    field for anything unsupported, missing or mistyped.

    dtype: params dtype; default the checkpoint's dtype / torch_dtype (float32 if absent).
    """
    if not isinstance(hf, dict):
        raise ConfigError(f"{source}: expected a JSON object of config fields, got "
                          f"{type(hf).__name__}")
    archs = hf.get("architectures") or []
    if not isinstance(archs, list) or len(archs) != 1 or archs[0] not in ARCHITECTURES:
        _refuse(source, "architectures", archs, f"supported: {', '.join(ARCHITECTURES)}")
    arch = archs[0]
    if hf.get("model_type") not in (None, _MODEL_TYPES[arch]):
        _refuse(source, "model_type", hf["model_type"], f"{arch} is model_type "
                f"{_MODEL_TYPES[arch]!r} (transformers builds the model from model_type)")
    for field, value in hf.items():
        if field not in _INERT_FIELDS | _READ_FIELDS and value not in (None, False, 0, [], {}):
            _refuse(source, field, value, "unknown field (it may change the model's math)")
    if hf.get("hidden_act", "silu") != "silu":
        _refuse(source, "hidden_act", hf["hidden_act"], "only SiLU (SwiGLU MLP) is implemented")
    if _flag(hf, "mlp_bias", source):
        _refuse(source, "mlp_bias", True, "MLP biases are not implemented")
    if hf.get("partial_rotary_factor", 1.0) not in (None, 1.0):
        _refuse(source, "partial_rotary_factor", hf["partial_rotary_factor"],
                "only full rotary embeddings are implemented")
    if hf.get("pretraining_tp", 1) not in (None, 1):
        _refuse(source, "pretraining_tp", hf["pretraining_tp"],
                "transformers 4.x then splits the matmuls (other rounding); only 1 is run")
    if _flag(hf, "use_sliding_window", source):
        _refuse(source, "use_sliding_window", True, "per-layer sliding windows are not "
                "implemented")
    layer_types = hf.get("layer_types") or []
    if not isinstance(layer_types, list) or any(t != "full_attention" for t in layer_types):
        _refuse(source, "layer_types", layer_types, "only full_attention is implemented")
    theta, scaling = _rope(hf, source)
    max_seq_len = _number(hf, "max_position_embeddings", int, source, default=2048)
    if arch == "MistralForCausalLM" and hf.get("sliding_window") is not None:
        # within the window, windowed attention is full attention: cap the length there
        max_seq_len = min(max_seq_len, _number(hf, "sliding_window", int, source))
    bias = _flag(hf, "attention_bias", source)
    d_model = _number(hf, "hidden_size", int, source)
    heads = _number(hf, "num_attention_heads", int, source)
    kv_heads = _number(hf, "num_key_value_heads", int, source, default=heads)
    if heads % kv_heads:
        raise ConfigError(f"{source} field num_key_value_heads={kv_heads}: must divide "
                          f"num_attention_heads={heads}")
    head_dim = _number(hf, "head_dim", int, source, default=d_model // heads or 1)
    if head_dim % 2:
        raise ConfigError(f"{source} field head_dim={head_dim} (default hidden_size // "
                          f"num_attention_heads): rotary embeddings need an even head_dim")
    dtype_field = "dtype argument" if dtype else \
        f"{source} field {'dtype' if hf.get('dtype') else 'torch_dtype'}"
    dtype = dtype or hf.get("dtype") or hf.get("torch_dtype") or "float32"
    if not isinstance(dtype, str) or dtype not in _DTYPES:
        raise ConfigError(f"{dtype_field}={dtype!r:.80} is not supported; use one of "
                          f"{sorted(_DTYPES)}")
    return ModelConfig(
        vocab_size=_number(hf, "vocab_size", int, source), d_model=d_model,
        n_layers=_number(hf, "num_hidden_layers", int, source), n_heads=heads,
        n_kv_heads=kv_heads, head_dim=head_dim,
        d_ff=_number(hf, "intermediate_size", int, source), max_seq_len=max_seq_len,
        rope_theta=theta, norm_eps=_number(hf, "rms_norm_eps", float, source, default=1e-6),
        qkv_bias=True if arch == "Qwen2ForCausalLM" else bias and arch != "MistralForCausalLM",
        out_bias=bias and arch in ("LlamaForCausalLM", "Qwen3ForCausalLM"),
        qk_norm=arch == "Qwen3ForCausalLM",
        tie_embeddings=_flag(hf, "tie_word_embeddings", source), dtype=dtype,
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


def _shard_name(index: pathlib.Path, tensor: str, file) -> str:
    """An index entry's file: a relative path inside the model directory (never opened
    otherwise: an index must not make the loader read /etc/passwd). Symlinks are followed,
    as for model.safetensors: the hub cache links each file to its blob."""
    parts = pathlib.PurePosixPath(file).parts if isinstance(file, str) else ()
    if not parts or parts[0] == "/" or ".." in parts or "\\" in file:
        raise ModelFileError(f"{index}: weight_map entry {tensor!r:.100}: {file!r:.100} is "
                             f"not a file inside the model directory")
    return file


def _tensor_names(file: pathlib.Path) -> list[str]:
    try:
        with safe_open(file, framework="np") as f:
            return list(f.keys())
    except SafetensorError as e:
        raise ModelFileError(f"{file}: not a readable safetensors file ({e})") from None


def _weight_files(path: pathlib.Path) -> tuple[str, dict[str, pathlib.Path]]:
    """(the weights' file name, HF tensor name -> the safetensors file holding it):
    model.safetensors, else the shards of model.safetensors.index.json (transformers'
    order); both at once is refused as ambiguous."""
    single, index = path / SINGLE_FILE, path / INDEX_FILE
    if single.exists() and index.exists():
        raise ModelFileError(f"{path}: holds both {SINGLE_FILE} and {INDEX_FILE} (a stale "
                             f"earlier save?): remove the one that is not this model")
    if single.exists():
        return SINGLE_FILE, {name: single for name in _tensor_names(single)}
    if not index.exists():
        raise ModelFileError(f"{path}: no {SINGLE_FILE} or {INDEX_FILE} (safetensors weights "
                             f"as transformers saves them)")
    weight_map = read_json(index)
    weight_map = weight_map.get("weight_map") if isinstance(weight_map, dict) else None
    if not isinstance(weight_map, dict):
        raise ModelFileError(f"{index}: no weight_map object (tensor name -> shard file)")
    files = {name: path / _shard_name(index, name, file) for name, file in weight_map.items()}
    for file in sorted(set(files.values())):
        held = set(_tensor_names(file)) if file.is_file() else None
        absent = sorted(name for name, f in files.items()
                        if f == file and (held is None or name not in held))
        if absent:
            raise ModelFileError(f"{index}: weight_map puts {absent[0]} in {file.name}, which "
                                 f"{'does not exist' if held is None else 'does not hold it'}")
    return INDEX_FILE, files


def _read_tensor(file: pathlib.Path, name: str) -> np.ndarray:
    """Tensor `name` of safetensors `file` (memory-mapped); its header dtype must be
    floating point. ModelFileError naming file and tensor otherwise."""
    try:
        with safe_open(file, framework="np") as f:
            kind = f.get_slice(name).get_dtype()
            if kind not in _FLOAT_HEADER_DTYPES:
                raise ModelFileError(f"{file}: tensor {name} has dtype {kind} in its header; "
                                     f"weights are floating point "
                                     f"({', '.join(sorted(_FLOAT_HEADER_DTYPES))})")
            return f.get_tensor(name)
    except SafetensorError as e:
        raise ModelFileError(f"{file}: cannot read tensor {name} ({e})") from None


def _check_tied_head(path: pathlib.Path, files: dict) -> None:
    """tie_word_embeddings with an lm_head.weight in the file: refused unless bitwise equal
    to the embedding (transformers 4.x ties and drops the file's head, 5.x keeps it)."""
    head = _read_tensor(files["lm_head.weight"], "lm_head.weight")
    embed = _read_tensor(files["model.embed_tokens.weight"], "model.embed_tokens.weight")
    if head.dtype != embed.dtype or head.shape != embed.shape or not np.array_equal(
            head.view(np.uint8), embed.view(np.uint8)):
        raise ModelFileError(
            f"{path / 'config.json'} field tie_word_embeddings=true, but "
            f"{files['lm_head.weight'].name} holds an lm_head.weight unlike "
            f"model.embed_tokens.weight (transformers versions disagree on which head this "
            f"means): set tie_word_embeddings false to use the file's head, or delete it")


def _weight_file_name(name: str) -> bool:
    """Whether `name` is a weight file save_pretrained writes (and so may replace)."""
    return name in (SINGLE_FILE, INDEX_FILE) or bool(_SHARD_FILE.fullmatch(name))


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
    leaf and one tensor. Raises ConfigError for unsupported configs and ModelFileError (its
    base) for any other broken file, naming the file and field or tensor (module doc).
    """
    path = pathlib.Path(path)
    config_file = path / "config.json"
    config = config_from_hf(read_json(config_file), dtype=dtype, source=str(config_file))
    shapes = jax.eval_shape(lambda k: init_params(config, k), jax.random.key(0))
    weights, files = _weight_files(path)
    wanted = _hf_names(config, shapes)
    missing = [hf for _, hf, _ in wanted if hf not in files]
    if missing:
        raise ModelFileError(f"{path / weights}: missing tensor {missing[0]}"
                             f"{f' (and {len(missing) - 1} more)' if len(missing) > 1 else ''}")
    ignorable = {"lm_head.weight"} if config.tie_embeddings else set()
    if ignorable & set(files):
        _check_tied_head(path, files)
    unused = sorted(set(files) - {hf for _, hf, _ in wanted} - ignorable)
    unused = [n for n in unused if not n.endswith("rotary_emb.inv_freq")]
    if unused:
        raise ModelFileError(f"{path / weights}: tensors the model does not use (unsupported "
                             f"architecture variant?): {unused[:5]}")
    np_dtype = _DTYPES[config.dtype]
    by_leaf: dict[tuple, list] = {}
    for ours, hf, t in wanted:
        by_leaf.setdefault(ours[:2], []).append((ours, hf, t))
    params: dict = {"layers": {}}
    for leaf, items in by_leaf.items():
        shape = (shapes[leaf[0]] if len(leaf) == 1 else shapes["layers"][leaf[1]]).shape
        buf = np.empty(shape, np_dtype)
        for ours, hf, t in items:
            # one open per tensor: its mapped pages are released before the next one
            tensor = _read_tensor(files[hf], hf)
            tensor = tensor.T if t else tensor
            dest = buf if len(ours) == 1 else buf[ours[2]]
            if tensor.shape != dest.shape:
                raise ModelFileError(f"{files[hf]}: tensor {hf} has shape "
                                     f"{list(tensor.shape)} (after transpose: {t}); the "
                                     f"config needs {list(dest.shape)}")
            dest[...] = tensor
            del tensor
        value = jnp.asarray(buf)
        del buf
        if len(leaf) == 1:
            params[leaf[0]] = value
        else:
            params["layers"][leaf[1]] = value
    return config, params


def save_pretrained(path, config: ModelConfig, params, *, tokenizer=None,
                    max_shard_bytes: int = 4 << 30) -> pathlib.Path:
    """Writes a Hugging Face directory transformers (and vLLM) load as the same model.

    config.json, model.safetensors (or model-0000i-of-0000n.safetensors shards with
    model.safetensors.index.json past max_shard_bytes), in config.dtype; with a `Tokenizer`
    also its files and generation_config.json (bos/eos/stop ids). Returns the directory.
    An existing directory may be written again: weight files of an earlier save that this
    one does not rewrite (its single file, index or shards) are removed once the new ones
    are written, so exactly one set remains; other files are left as they are. Weights in
    another format or name (pytorch_model.bin, consolidated.safetensors, ...), which
    transformers or vLLM might load instead, make it refuse before writing anything, as do
    params carrying LoRA adapters (export `lora.merged(params)`, or the adapters alone with
    `models.peft.save_peft_adapter`).
    """
    path = pathlib.Path(path)
    if path.is_dir():
        foreign = sorted(f.name for f in path.iterdir()
                         if _FOREIGN_WEIGHTS.fullmatch(f.name) and not _weight_file_name(f.name))
        if foreign:
            raise FileExistsError(f"{path / foreign[0]}: weights this save would not replace "
                                  f"(transformers or vLLM could load them): remove them or "
                                  f"save elsewhere")
    config_json = json.dumps(config_to_hf(config), indent=2)
    if SCALE in params or ADAPTERS in params.get("layers", {}):
        raise ValueError("the params carry LoRA adapters, which this export would drop: pass "
                         "lora.merged(params), or save the adapters with save_peft_adapter")
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(config_json)
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
        written = {SINGLE_FILE}
        save_file(shards[0], path / SINGLE_FILE, metadata=metadata)
    else:
        weight_map = {}
        for i, shard in enumerate(shards):
            name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, path / name, metadata=metadata)
            weight_map.update({hf: name for hf in shard})
        total = sum(a.nbytes for shard in shards for a in shard.values())
        (path / INDEX_FILE).write_text(json.dumps(
            {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
        written = {INDEX_FILE, *weight_map.values()}
    for stale in sorted(f for f in path.iterdir()
                        if _weight_file_name(f.name) and f.name not in written):
        stale.unlink()
    if tokenizer is not None:
        tokenizer.save(path)
        stop = list(tokenizer.stop_token_ids)
        generation = dict(bos_token_id=tokenizer.bos_token_id,
                          eos_token_id=stop[0] if len(stop) == 1 else stop)
        (path / "generation_config.json").write_text(json.dumps(generation, indent=2))
    return path
