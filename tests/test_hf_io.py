"""Hugging Face import/export without transformers: exact round trips, sharding, refusal of
every unsupported math-changing config field by name, bad tensors, broken directories (one
line naming the file and field, in the library and the CLI), saves over older saves, tied
heads, the tokenizer."""
import contextlib
import io
import json
import shutil
import struct

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from jaxrl_cache.app import cli
from jaxrl_cache.models import (ModelConfig, from_pretrained, init_params, load_tokenizer,
                                save_pretrained)
from jaxrl_cache.models.hf import ConfigError, ModelFileError
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
    ("architectures", ["Gemma2ForCausalLM"]),
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
    with pytest.raises(ModelFileError, match=f"model.safetensors: missing tensor {name}"):
        from_pretrained(path)
    save_file({**tensors, name: tensors[name][:-1]}, path / "model.safetensors")
    with pytest.raises(ModelFileError, match=f"model.safetensors: tensor {name} has shape"):
        from_pretrained(path)
    save_file({**tensors, "model.layers.0.mlp.extra.weight": tensors[name]},
              path / "model.safetensors")
    with pytest.raises(ModelFileError, match="mlp.extra"):
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


# ---------------------------------------------------------------- broken directories
def relabel(file, tensor: str, dtype: str) -> None:
    """Rewrites `tensor`'s dtype in the header of safetensors `file` (same byte size)."""
    raw = file.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    header[tensor]["dtype"] = dtype
    file.write_bytes(raw[:8] + json.dumps(header, separators=(",", ":")).encode().ljust(n)
                     + raw[8 + n:])


def sharded(tmp_path, **entries):
    """The qwen2 fixture as shards; `entries` rewrite weight_map entries (tensor: file)."""
    path = save_pretrained(tmp_path / "sharded", *from_pretrained(FIXTURES / "qwen2"),
                           tokenizer=load_tokenizer(FIXTURES / "qwen2"), max_shard_bytes=8_000)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    index["weight_map"].update(entries)
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    return path


def truncate(file, keep):
    file.write_bytes(file.read_bytes()[:keep])


LAYER0_Q = "model.layers.0.self_attn.q_proj.weight"
BROKEN = {  # name: (make the broken directory, what the one line must say)
    "config not JSON": (lambda t: truncate(edited(t) / "config.json", 40),
                        r"config.json: not valid JSON \(.*line 1"),
    "config a list": (lambda t: (edited(t) / "config.json").write_text("[1, 2]"),
                      r"config.json: expected a JSON object of config fields, got list"),
    "no vocab_size": (lambda t: edited(t, vocab_size=None),
                      r"config.json: required field vocab_size is missing"),
    "eps a string": (lambda t: edited(t, rms_norm_eps="1e-5x"),
                     r"config.json field rms_norm_eps='1e-5x': expected a positive number"),
    "tie a string": (lambda t: edited(t, tie_word_embeddings="false"),
                     r"config.json field tie_word_embeddings='false': expected true or false"),
    "no heads": (lambda t: edited(t, num_attention_heads=0),
                 r"config.json field num_attention_heads=0: expected a positive integer"),
    "rope_parameters without factor": (
        lambda t: edited(t, "llama_linear", rope_parameters={"rope_type": "linear"}),
        r"config.json: required field rope_parameters.factor is missing"),
    "rope_scaling without factor": (
        lambda t: edited(t, "llama_linear", rope_parameters=None, rope_scaling={"type": "linear"}),
        r"config.json: required field rope_scaling.factor is missing"),
    "truncated safetensors": (lambda t: truncate(edited(t) / "model.safetensors", 5000),
                              r"model.safetensors: not a readable safetensors file"),
    # the fixture is bfloat16: int16 keeps the byte size (int32 for float32 weights)
    "int header": (lambda t: relabel(edited(t) / "model.safetensors", LAYER0_Q, "I16"),
                   rf"model.safetensors: tensor {LAYER0_Q} has dtype I16 in its header"),
    "index outside the directory": (lambda t: sharded(t, **{LAYER0_Q: "/etc/passwd"}),
                                    r"index.json: weight_map entry .*'/etc/passwd' is not a "
                                    r"file inside the model directory"),
    "index climbing out": (lambda t: sharded(t, **{LAYER0_Q: "../qwen2/model.safetensors"}),
                           r"index.json: weight_map entry .*'\.\./qwen2/model.safetensors'"),
    "index naming the wrong shard": (
        lambda t: sharded(t, **{LAYER0_Q: "model-00006-of-00006.safetensors"}),
        rf"index.json: weight_map puts {LAYER0_Q} in model-00006-of-00006.safetensors, which "
        r"does not hold it"),
    "index naming a missing shard": (
        lambda t: sharded(t, **{LAYER0_Q: "model-00001-of-00002.safetensors"}),
        rf"index.json: weight_map puts {LAYER0_Q} in model-00001-of-00002.safetensors, which "
        r"does not exist"),
    "index beside a single file": (
        lambda t: shutil.copy(FIXTURES / "qwen2" / "model.safetensors", sharded(t)),
        r"sharded: holds both model.safetensors and model.safetensors.index.json"),
    "tokenizer.json broken": (lambda t: truncate(edited(t) / "tokenizer.json", 100),
                              r"tokenizer.json: not a readable tokenizer"),
    "generation_config not JSON": (
        lambda t: (edited(t) / "generation_config.json").write_text("{'eos_token_id': 2}"),
        r"generation_config.json: not valid JSON"),
    "eos a string": (
        lambda t: (edited(t) / "generation_config.json").write_text('{"eos_token_id": "2"}'),
        r"generation_config.json field eos_token_id='2': expected a token id"),
}


def broken(tmp_path, case):
    BROKEN[case][0](tmp_path)
    return next(p for p in tmp_path.iterdir() if p.is_dir())


@pytest.mark.parametrize("case", BROKEN)
def test_broken_directories_raise_one_line_naming_file_and_field(tmp_path, case):
    """Each used to be a KeyError, JSONDecodeError, SafetensorError, a bare TypeError or
    silently wrong weights (a float tensor relabelled int16 loaded as garbage; /etc/passwd
    was opened as a shard)."""
    path = broken(tmp_path, case)
    with pytest.raises(ModelFileError, match=BROKEN[case][1]) as info:
        from_pretrained(path)
        load_tokenizer(path)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("case", ["config a list", "truncated safetensors", "int header",
                                  "index outside the directory", "tokenizer.json broken"])
def test_demo_on_a_broken_model_directory_is_rc_2_with_one_line(tmp_path, case):
    path = broken(tmp_path, case)
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = cli.main(["demo", "--model", str(path), "--out", str(tmp_path / "out")])
    assert code == 2
    lines = err.getvalue().splitlines()
    assert len(lines) == 1 and lines[0].startswith("jaxrl-cache demo: error: ")
    assert BROKEN[case][1].split(":")[0].replace("\\", "") in lines[0]  # the file


# ---------------------------------------------------------------- saves over saves, tied heads
def weight_files(path):
    return sorted(p.name for p in path.iterdir() if "safetensors" in p.name)


def test_a_save_over_an_older_save_leaves_exactly_its_own_weights(tmp_path):
    """Sharded then single, and single then sharded, in one directory: only the new set
    remains and it loads (the stale index or single file used to stay, and this loader read
    one set while transformers read the other)."""
    config, old = from_pretrained(FIXTURES / "qwen3", dtype="float32")
    new = jax.tree.map(lambda x: x + 1, old)
    save_pretrained(tmp_path, config, old, max_shard_bytes=20_000)
    save_pretrained(tmp_path, config, new)
    assert weight_files(tmp_path) == ["model.safetensors"]
    assert_same_params(from_pretrained(tmp_path)[1], new)
    save_pretrained(tmp_path, config, old, max_shard_bytes=60_000)
    save_pretrained(tmp_path, config, new, max_shard_bytes=20_000)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert weight_files(tmp_path) == sorted({"model.safetensors.index.json",
                                             *index["weight_map"].values()})
    assert_same_params(from_pretrained(tmp_path)[1], new)


def test_a_save_beside_foreign_weights_is_refused_before_writing(tmp_path):
    (tmp_path / "pytorch_model.bin").write_bytes(b"old torch weights")
    config, params = from_pretrained(FIXTURES / "qwen3")
    with pytest.raises(FileExistsError, match="pytorch_model.bin: weights this save would not "
                                              "replace"):
        save_pretrained(tmp_path, config, params)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pytorch_model.bin"]


def test_a_tokenizer_save_removes_a_stale_chat_template_file(tmp_path):
    tok = load_tokenizer(FIXTURES / "qwen2")
    (tmp_path / "chat_template.jinja").write_text("{{ 'stale template' }}")
    tok.save(tmp_path)
    assert load_tokenizer(tmp_path).chat_template == tok.chat_template


def test_tied_embeddings_with_a_distinct_head_in_the_file_are_refused(tmp_path):
    """qwen2 ties its head; a file that also holds an lm_head.weight loads only when that
    head is the embedding bit for bit (transformers 4.x would tie, 5.x use the file's head:
    the logits differ, so the old silent tie is refused)."""
    path = edited(tmp_path)
    tensors = load_file(path / "model.safetensors")
    embed = tensors["model.embed_tokens.weight"]
    save_file({**tensors, "lm_head.weight": embed.copy()}, path / "model.safetensors")
    assert_same_params(from_pretrained(path)[1], from_pretrained(FIXTURES / "qwen2")[1])
    other = embed.copy()
    other[0, 0] += 1
    save_file({**tensors, "lm_head.weight": other}, path / "model.safetensors")
    with pytest.raises(ModelFileError, match=r"config.json field tie_word_embeddings=true, but "
                                             r"model.safetensors holds an lm_head.weight unlike"):
        from_pretrained(path)
