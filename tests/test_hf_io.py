"""Hugging Face import/export without transformers: exact round trips, sharding, refusal of
every unsupported math-changing config field by name, bad tensors, the tokenizer."""
import json
import shutil

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from jaxrl_cache.models import (ModelConfig, from_pretrained, init_params, load_tokenizer,
                                save_pretrained)
from jaxrl_cache.models.hf import ConfigError
from tests.hf_fixtures import ARCHS, FIXTURES


def assert_same_params(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize("name", ARCHS)
def test_import_export_import_is_exact(tmp_path, name):
    config, params = from_pretrained(FIXTURES / name)  # the checkpoint's dtype: bfloat16
    assert config.dtype == "bfloat16"
    again = from_pretrained(save_pretrained(tmp_path / name, config, params))
    assert again[0] == config
    assert_same_params(again[1], params)


def test_sharded_checkpoint_round_trip(tmp_path):
    config, params = from_pretrained(FIXTURES / "qwen3", dtype="float32")
    save_pretrained(tmp_path, config, params, max_shard_bytes=20_000)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    assert not (tmp_path / "model.safetensors").exists()
    again_config, again = from_pretrained(tmp_path)
    assert again_config == config
    assert_same_params(again, params)


def test_random_config_export_import_keeps_dtype_and_layout(tmp_path):
    config = ModelConfig.tiny(vocab_size=40, dtype="bfloat16", tie_embeddings=False,
                              max_seq_len=64)
    params = init_params(config, jax.random.key(0))
    got_config, got = from_pretrained(save_pretrained(tmp_path, config, params))
    assert got_config == config
    assert_same_params(got, params)
    f32_config, f32 = from_pretrained(tmp_path, dtype="float32")
    assert f32_config.dtype == "float32" and f32["layers"]["wq"].dtype == np.float32
    np.testing.assert_array_equal(np.asarray(f32["layers"]["wq"]),
                                  np.asarray(params["layers"]["wq"], np.float32))


def edited(tmp_path, name="qwen2", **changes):
    """A copy of a fixture with config.json fields changed (None deletes a field)."""
    dst = tmp_path / name
    shutil.copytree(FIXTURES / name, dst)
    hf = json.loads((dst / "config.json").read_text())
    hf.update(changes)
    (dst / "config.json").write_text(json.dumps({k: v for k, v in hf.items() if v is not None}))
    return dst


@pytest.mark.parametrize("field,value", [
    ("hidden_act", "gelu"),
    ("mlp_bias", True),
    ("partial_rotary_factor", 0.5),
    ("rope_scaling", {"rope_type": "yarn", "factor": 4.0}),
    ("rope_parameters", {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}),
    ("num_local_experts", 8),
    ("num_experts", 4),
    ("use_sliding_window", True),
    ("layer_types", ["full_attention", "sliding_attention"]),
    ("architectures", ["GemmaForCausalLM"]),
    ("final_logit_softcapping", 30.0),
    ("quantization_config", {"quant_method": "gptq"}),
])
def test_unsupported_fields_are_refused_by_name(tmp_path, field, value):
    with pytest.raises(ConfigError, match=field):
        from_pretrained(edited(tmp_path, **{field: value}))


def test_legacy_rope_keys_and_mistral_sliding_window(tmp_path):
    config, _ = from_pretrained(FIXTURES / "mistral")
    assert config.max_seq_len == 24  # sliding_window 24 < max_position_embeddings 64
    legacy = edited(tmp_path, "llama3", rope_parameters=None, rope_theta=500000.0,
                    rope_scaling={"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                  "high_freq_factor": 4.0,
                                  "original_max_position_embeddings": 16})
    assert from_pretrained(legacy)[0] == from_pretrained(FIXTURES / "llama3")[0]


def test_bad_tensors_are_named(tmp_path):
    path = edited(tmp_path)
    tensors = load_file(path / "model.safetensors")
    name = "model.layers.1.self_attn.k_proj.bias"
    save_file({k: v for k, v in tensors.items() if k != name}, path / "model.safetensors")
    with pytest.raises(KeyError, match=name):
        from_pretrained(path)
    save_file({**tensors, name: tensors[name][:-1]}, path / "model.safetensors")
    with pytest.raises(ValueError, match=name):
        from_pretrained(path)
    save_file({**tensors, "model.layers.0.mlp.extra.weight": tensors[name]},
              path / "model.safetensors")
    with pytest.raises(ValueError, match="mlp.extra"):
        from_pretrained(path)


def test_export_refuses_an_architecture_that_does_not_exist(tmp_path):
    config = ModelConfig.tiny(qkv_bias=False, out_bias=True)
    with pytest.raises(ValueError, match="out_bias"):
        save_pretrained(tmp_path, config, None)  # refused before params are read


def test_tokenizer_matches_transformers_and_round_trips(tmp_path):
    want = json.loads((FIXTURES / "qwen2" / "tokenizer_expected.json").read_text())
    tok = load_tokenizer(FIXTURES / "qwen2")
    assert [tok.encode(t) for t in want["texts"]] == want["ids"]
    assert [tok.decode(ids) for ids in want["ids"]] == want["decoded"]
    assert tok.apply_chat_template(want["messages"], tokenize=False) == want["chat_text"]
    assert tok.apply_chat_template(want["messages"]) == want["chat_ids"]
    assert tok.stop_token_ids == tuple(want["stop_token_ids"])
    config, params = from_pretrained(FIXTURES / "qwen2")
    again = load_tokenizer(save_pretrained(tmp_path, config, params, tokenizer=tok))
    assert again.apply_chat_template(want["messages"]) == want["chat_ids"]
    assert again.stop_token_ids == tok.stop_token_ids
    assert [again.encode(t) for t in want["texts"]] == want["ids"]
