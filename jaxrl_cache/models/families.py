"""The model-family registry: what each Hugging Face architecture reads, runs and shards by.

A `Family` is one value: the HF architectures it loads, its config reader and writer, the HF
names of its weights, the decoder module whose functions run it and its partition rules.
`family_for_architecture` picks the family of a config.json (`models.hf`); `family_of` the
family of a ModelConfig (its `family` field), which the trainer, the rollout engine, the
memory planner and the meshes call instead of naming a decoder. Adding a family is one entry
here (docs/internals.md, "Adding a model family").

Every family registered today runs `models.llama` (its math differences are ModelConfig
fields, so the sampler and the trainer run them alike) with the Llama-layout weight names
and `models.sharding`'s rules.
"""
from __future__ import annotations

import dataclasses
import types
from typing import Callable

from jaxrl_cache.models import llama, sharding
from jaxrl_cache.models.config import ModelConfig
from jaxrl_cache.models.hf_config import flag, head_dim, number, refuse

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


@dataclasses.dataclass(frozen=True)
class Family:
    """One model family. Invariant: `decoder`'s params have exactly the leaves the weight
    tables and the rules name (a leaf absent from a config's params is skipped)."""
    name: str  # ModelConfig.family
    architectures: tuple[str, ...]  # HF architectures; model_type is `model_type(arch)`
    fields: frozenset  # config.json fields `read` reads besides hf_config.COMMON_FIELDS
    # (config.json dict, architecture, source, hf_config.common_fields) -> ModelConfig fields
    # of this family's math (ConfigError naming the field for what it cannot run)
    read: Callable[[dict, str, str, dict], dict]
    # ModelConfig -> its config.json fields besides common_to_hf's, "architectures" included;
    # ValueError when none of the architectures has this math
    write: Callable[[ModelConfig], dict]
    layer_weights: tuple  # (ours, HF name under "model.layers.{i}.", transposed)
    top_weights: tuple  # (ours, HF name, transposed)
    # init_params, hidden_states, lm_logits, forward, prefill_forward, decode_forward,
    # init_kv_cache, copy_pages, sampler_layout (`models.llama`'s signatures)
    decoder: types.ModuleType
    train_rules: sharding.Rules  # FSDP (`parallel.training`)
    rollout_rules: Callable[[ModelConfig, int], sharding.Rules]  # (config, tensor axis size)


def model_type(architecture: str) -> str:
    """The model_type transformers builds `architecture` from: "LlamaForCausalLM" -> "llama"."""
    return architecture[:-len("ForCausalLM")].lower()


def _read_llama(hf: dict, arch: str, source: str, common: dict) -> dict:
    """Llama, Mistral, Qwen2, Qwen3: SwiGLU; biases by attention_bias (Qwen2: q/k/v always);
    Qwen3's q/k norms; Mistral's sliding window caps max_seq_len (within it, windowed and
    full attention are equal)."""
    if hf.get("hidden_act", "silu") != "silu":
        refuse(source, "hidden_act", hf["hidden_act"], "only SiLU (SwiGLU MLP) is implemented")
    if flag(hf, "mlp_bias", source):
        refuse(source, "mlp_bias", True, "MLP biases are not implemented")
    if hf.get("pretraining_tp", 1) not in (None, 1):
        refuse(source, "pretraining_tp", hf["pretraining_tp"],
               "transformers 4.x then splits the matmuls (other rounding); only 1 is run")
    if flag(hf, "use_sliding_window", source):
        refuse(source, "use_sliding_window", True, "per-layer sliding windows are not "
               "implemented")
    layer_types = hf.get("layer_types") or []
    if not isinstance(layer_types, list) or any(t != "full_attention" for t in layer_types):
        refuse(source, "layer_types", layer_types, "only full_attention is implemented")
    bias = flag(hf, "attention_bias", source)
    out = dict(qkv_bias=True if arch == "Qwen2ForCausalLM" else
               bias and arch != "MistralForCausalLM",
               out_bias=bias and arch in ("LlamaForCausalLM", "Qwen3ForCausalLM"),
               qk_norm=arch == "Qwen3ForCausalLM")
    if arch == "MistralForCausalLM" and hf.get("sliding_window") is not None:
        out["max_seq_len"] = min(common["max_seq_len"],
                                 number(hf, "sliding_window", int, source))
    return out


def _write_llama(config: ModelConfig) -> dict:
    """Llama (biases both or neither), Qwen2 (q/k/v biases only), Qwen3 (q/k norms)."""
    if config.embed_scale or config.norm_plus_one or config.mlp_act != "silu":
        raise ValueError("no Llama-family architecture scales embeddings, norms by 1 + w or "
                         f"runs mlp_act={config.mlp_act!r}")
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
    return dict(architectures=[arch], hidden_act="silu", **extra)


def _read_gemma(hf: dict, arch: str, source: str, common: dict) -> dict:
    """Gemma (1): GeGLU (tanh GELU; transformers runs hidden_act "gelu" as it too), RMSNorm
    by 1 + w, embeddings x sqrt(d_model), biases by attention_bias; GemmaConfig's defaults
    (tied head, head_dim 256, 8192 positions) where a field is absent."""
    if hf.get("hidden_act") not in (None, "gelu", "gelu_pytorch_tanh"):
        refuse(source, "hidden_act", hf["hidden_act"],
               "Gemma runs gelu_pytorch_tanh (GeGLU MLP)")
    if hf.get("hidden_activation") not in (None, "gelu_pytorch_tanh"):
        refuse(source, "hidden_activation", hf["hidden_activation"],
               "transformers 4.x runs it, 5.x gelu_pytorch_tanh: only that one is run")
    bias = flag(hf, "attention_bias", source)
    tied = hf.get("tie_word_embeddings") is None or common["tie_embeddings"]
    return dict(family="gemma", embed_scale=True, norm_plus_one=True, mlp_act="gelu_tanh",
                qkv_bias=bias, out_bias=bias, tie_embeddings=tied,
                head_dim=head_dim(hf, source, default=256),
                max_seq_len=number(hf, "max_position_embeddings", int, source, default=8192))


def _write_gemma(config: ModelConfig) -> dict:
    if not (config.embed_scale and config.norm_plus_one and config.mlp_act == "gelu_tanh") \
            or config.qk_norm or config.qkv_bias != config.out_bias:
        raise ValueError("GemmaForCausalLM scales embeddings, norms by 1 + w, runs "
                         "mlp_act='gelu_tanh', has no q/k norms and q/k/v/o biases together "
                         "or none")
    return dict(architectures=["GemmaForCausalLM"], hidden_act="gelu_pytorch_tanh",
                attention_bias=config.qkv_bias)


_LLAMA_FIELDS = frozenset({"hidden_act", "attention_bias", "mlp_bias", "sliding_window",
                           "use_sliding_window", "layer_types", "pretraining_tp"})
FAMILIES = {family.name: family for family in (
    Family("llama", ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
                     "Qwen3ForCausalLM"), _LLAMA_FIELDS, _read_llama, _write_llama,
           LAYER_WEIGHTS, TOP_WEIGHTS, llama, sharding.TRAIN_RULES, sharding.rollout_rules),
    Family("gemma", ("GemmaForCausalLM",),
           frozenset({"hidden_act", "hidden_activation", "attention_bias"}), _read_gemma,
           _write_gemma, LAYER_WEIGHTS, TOP_WEIGHTS, llama, sharding.TRAIN_RULES,
           sharding.rollout_rules),
)}
ARCHITECTURES = tuple(arch for family in FAMILIES.values() for arch in family.architectures)


def family_of(config: ModelConfig) -> Family:
    """The registered family of `config` (its `family` field); ValueError if none."""
    family = FAMILIES.get(config.family)
    if family is None:
        raise ValueError(f"ModelConfig.family={config.family!r} is not a registered family "
                         f"({', '.join(FAMILIES)})")
    return family


def family_for_architecture(architecture) -> Family | None:
    """The family that loads HF `architecture` (any JSON value); None if none does."""
    return next((family for family in FAMILIES.values()
                 if architecture in family.architectures), None)
