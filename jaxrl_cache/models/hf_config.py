"""Hugging Face config.json fields, as every model family reads them (`models.families`
adds each family's own; `models.hf.config_from_hf` puts them together).

Any config field that would change the math and is not implemented raises ConfigError
naming the field: a checkpoint either loads as exactly the model transformers runs, or not
at all. Metadata (names, versions, generation defaults, training-only knobs, fields of
features that are off) is accepted: tests/test_hf_configs.py holds the field lists of real
hub checkpoints. A broken file raises ModelFileError (a ValueError) whose first line names
the file and the field.
"""
from __future__ import annotations

import json
import math
import pathlib

import ml_dtypes
import numpy as np

from jaxrl_cache.models.config import ModelConfig, RopeScaling

# Fields that never change the forward math, whatever their value: metadata, generation
# defaults (SamplingParams decides sampling), training-only knobs (dropout, init), fields
# of features another field turns off (max_window_layers: use_sliding_window is refused).
INERT_FIELDS = frozenset({
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
_ROPE_KEYS = {"default": {"rope_theta"}, "linear": {"rope_theta", "factor"},
              "llama3": {"rope_theta", "factor", "low_freq_factor", "high_freq_factor",
                         "original_max_position_embeddings"}}
DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}


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


def refuse(source: str, field: str, value, why: str):
    """A one-line ConfigError (a field name with control characters is written escaped)."""
    field = field if field.isprintable() else ascii(field)
    raise ConfigError(f"{source} field {field:.200}={value!r:.200} is not supported: {why}")


def number(d: dict, key: str, kind: type, source: str, *, label: str | None = None,
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


def flag(hf: dict, key: str, source: str) -> bool:
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


def read_rope(hf: dict, source: str) -> tuple[float, RopeScaling | None]:
    """(rope_theta, scaling) from the legacy rope_theta/rope_scaling keys and the v5
    rope_parameters; where both give a key they must agree."""
    legacy = _rope_dict(hf, "rope_scaling", source)
    if hf.get("rope_theta") is not None:
        legacy["rope_theta"] = hf["rope_theta"]
    v5 = _rope_dict(hf, "rope_parameters", source)
    for key in sorted(legacy.keys() & v5.keys()):
        if legacy[key] != v5[key]:
            other = "rope_theta" if key == "rope_theta" else f"rope_scaling.{key}"
            refuse(source, f"rope_parameters.{key}", v5[key],
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
        refuse(source, at("rope_type"), kind,
                "only default, linear and llama3 rotary scaling are implemented")
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        refuse(source, at("partial_rotary_factor"), params["partial_rotary_factor"],
                "only full rotary embeddings are implemented")
    params.pop("partial_rotary_factor", None)
    unknown = sorted(set(params) - _ROPE_KEYS[kind])
    if unknown:
        refuse(source, at(unknown[0]), params[unknown[0]],
                f"not a parameter of {kind} rotary embeddings")

    def num(key, cast=float):
        return number(params, key, cast, source, label=at(key))

    theta = number(params, "rope_theta", float, source, default=10000.0,
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


# The fields `common_fields` reads: every family's sizes, rotary, norm epsilon and head.
COMMON_FIELDS = frozenset({
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings",
    "rms_norm_eps", "rope_theta", "rope_scaling", "rope_parameters", "tie_word_embeddings",
    "partial_rotary_factor",
})
OFF = (None, False, 0, [], {})  # an unknown field with one of these values is accepted


def common_fields(hf: dict, source: str, dtype: str | None) -> dict:
    """The ModelConfig fields every family reads the same way (COMMON_FIELDS, and the dtype:
    the `dtype` argument, else the checkpoint's dtype / torch_dtype, else float32), with the
    Llama config defaults; a family's reader overrides what it reads otherwise."""
    if hf.get("partial_rotary_factor", 1.0) not in (None, 1.0):
        refuse(source, "partial_rotary_factor", hf["partial_rotary_factor"],
               "only full rotary embeddings are implemented")
    theta, scaling = read_rope(hf, source)
    d_model = number(hf, "hidden_size", int, source)
    heads = number(hf, "num_attention_heads", int, source)
    kv_heads = number(hf, "num_key_value_heads", int, source, default=heads)
    if heads % kv_heads:
        raise ConfigError(f"{source} field num_key_value_heads={kv_heads}: must divide "
                          f"num_attention_heads={heads}")
    dtype_field = "dtype argument" if dtype else \
        f"{source} field {'dtype' if hf.get('dtype') else 'torch_dtype'}"
    dtype = dtype or hf.get("dtype") or hf.get("torch_dtype") or "float32"
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise ConfigError(f"{dtype_field}={dtype!r:.80} is not supported; use one of "
                          f"{sorted(DTYPES)}")
    return dict(
        vocab_size=number(hf, "vocab_size", int, source), d_model=d_model,
        n_layers=number(hf, "num_hidden_layers", int, source), n_heads=heads,
        n_kv_heads=kv_heads, head_dim=head_dim(
            hf, source, default=d_model // heads or 1,
            default_from=f"hidden_size={d_model} // num_attention_heads={heads}"),
        d_ff=number(hf, "intermediate_size", int, source),
        max_seq_len=number(hf, "max_position_embeddings", int, source, default=2048),
        rope_theta=theta, norm_eps=number(hf, "rms_norm_eps", float, source, default=1e-6),
        tie_embeddings=flag(hf, "tie_word_embeddings", source), dtype=dtype,
        rope_scaling=scaling)


def head_dim(hf: dict, source: str, *, default: int, default_from: str = "") -> int:
    """hf's head_dim (`default` when absent, computed as `default_from` says), which rotary
    embeddings need even; the error names the fields the odd value came from."""
    value = number(hf, "head_dim", int, source, default=default)
    if value % 2:
        origin = "as given" if "head_dim" in hf else \
            f"absent, so {default_from or f'the default {default}'}"
        raise ConfigError(f"{source} field head_dim={value} ({origin}): rotary "
                          f"embeddings need an even head_dim")
    return value


def common_to_hf(config: ModelConfig) -> dict:
    """The COMMON_FIELDS of `config` in config.json (legacy rope_theta/rope_scaling keys,
    read by every transformers version and by vLLM), with torch_dtype."""
    rope_scaling = None
    if config.rope_scaling is not None:
        s = config.rope_scaling
        rope_scaling = dict(rope_type=s.kind, factor=s.factor)
        if s.kind == "llama3":
            rope_scaling.update(low_freq_factor=s.low_freq_factor,
                                high_freq_factor=s.high_freq_factor,
                                original_max_position_embeddings=s.original_max_position)
    return dict(
        vocab_size=config.vocab_size, hidden_size=config.d_model,
        intermediate_size=config.d_ff, num_hidden_layers=config.n_layers,
        num_attention_heads=config.n_heads, num_key_value_heads=config.n_kv_heads,
        head_dim=config.head_dim, max_position_embeddings=config.max_seq_len,
        rms_norm_eps=config.norm_eps, rope_theta=config.rope_theta, rope_scaling=rope_scaling,
        tie_word_embeddings=config.tie_embeddings, torch_dtype=config.dtype)
