"""`slow`: the real-model fixture (SmolLM2-135M-Instruct, built by scripts/fetch_smollm2.py)
against transformers on the same directory: it loads as the same model, greedy chat output is
transformers' (token ids and text), sampled tokens carry the log-probs of transformers' warped
distribution, and save_pretrained writes a directory transformers loads with equal logits.

Skipped (with the reason) where the directory, torch or transformers is absent: CI has none
of them. Run in the torch venv (the script's docstring):
    python -m pytest tests/test_real_model.py -m slow
"""
import importlib.util
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_cache.models import forward, from_pretrained, load_tokenizer, save_pretrained
from jaxrl_cache.rollout import CacheConfig, RolloutEngine, SamplingParams, SchedulerConfig

pytestmark = pytest.mark.slow

_spec = importlib.util.spec_from_file_location(
    "fetch_smollm2", pathlib.Path(__file__).resolve().parents[1] / "scripts" / "fetch_smollm2.py")
fetch = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fetch)
DIR = fetch.model_dir()
if not fetch.is_complete(DIR):
    pytest.skip(f"no real model at {DIR} (build it with `make real-model`; "
                f"JAXRL_SMOLLM2_DIR overrides the path)", allow_module_level=True)
torch = pytest.importorskip("torch", reason="the real-model tests compare against torch + "
                                            "transformers (see scripts/fetch_smollm2.py)")
tf = pytest.importorskip("transformers", reason="the real-model tests compare against "
                                                "transformers (see scripts/fetch_smollm2.py)")

PROMPTS = ["What is 12 * 7?", "Name the capital of France in one word.",
           "Write a haiku about the sea."]
GREEDY_NEW = 48
# fp32, 30 layers summed in another order: measured 1.2e-4 on logits of magnitude <= 38,
# 4e-5 on warped log-probs
LOGIT_TOL = 1e-3
LOGPROB_TOL = 5e-4


def chat(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


@pytest.fixture(scope="module")
def ours():
    config, params = from_pretrained(DIR, dtype="float32")
    return config, params, load_tokenizer(DIR)


@pytest.fixture(scope="module")
def theirs():
    torch.set_num_threads(2)
    model = tf.AutoModelForCausalLM.from_pretrained(DIR, dtype=torch.float32).eval()
    return model, tf.AutoTokenizer.from_pretrained(DIR)


@pytest.fixture(scope="module")
def engine(ours):
    config, _, tok = ours
    return RolloutEngine(config, CacheConfig(num_pages=128, page_size=16),
                         scheduler_config=SchedulerConfig(max_num_seqs=8, chunk_steps=16),
                         backend="xla", tokenizer=tok)


def hf_logits(model, ids) -> np.ndarray:
    """f32 [T, V] transformers logits of one token sequence."""
    with torch.no_grad():
        return model(torch.tensor([list(ids)])).logits[0].numpy()


def test_loads_as_the_model_transformers_runs(ours, theirs):
    config, params, tok = ours
    model, hf_tok = theirs
    assert (config.n_layers, config.d_model, config.vocab_size, config.n_heads,
            config.n_kv_heads, config.tie_embeddings) == (30, 576, 49152, 9, 3, True)
    ids = tok.apply_chat_template(chat(PROMPTS[0]))
    assert ids == list(hf_tok.apply_chat_template(chat(PROMPTS[0]), add_generation_prompt=True,
                                                  tokenize=True, return_dict=False))
    got = np.asarray(forward(params, config, jnp.asarray([ids], jnp.int32)))[0]
    np.testing.assert_allclose(got, hf_logits(model, ids), atol=LOGIT_TOL, rtol=0)


def test_greedy_chat_is_transformers_text_and_ids(ours, theirs, engine):
    _, params, tok = ours
    model, hf_tok = theirs
    sampling = SamplingParams(max_new_tokens=GREEDY_NEW, temperature=0.0,
                              stop_token_ids=tok.stop_token_ids)
    batch = engine.rollout(params, 0, [chat(p) for p in PROMPTS], sampling,
                           rng=jax.random.key(0))
    for prompt, s in zip(PROMPTS, batch.samples):
        with torch.no_grad():
            out = model.generate(torch.tensor([s.prompt_ids]), do_sample=False,
                                 max_new_tokens=GREEDY_NEW)[0, len(s.prompt_ids):].tolist()
        assert list(s.output_ids) == out, prompt
        assert s.text == hf_tok.decode(out, skip_special_tokens=True), prompt
    # both endings covered: the chat stop token (<|im_end|>) and the token budget
    assert {s.finish_reason for s in batch.samples} == {"stop", "length"}


def test_sampled_logprobs_are_transformers_warped_log_softmax(ours, theirs, engine):
    from transformers.generation.logits_process import (TemperatureLogitsWarper,
                                                        TopKLogitsWarper, TopPLogitsWarper)
    _, params, tok = ours
    model, _ = theirs
    temperature, top_k, top_p = 0.7, 50, 0.9
    sampling = SamplingParams(n=4, max_new_tokens=24, temperature=temperature, top_k=top_k,
                              top_p=top_p, stop_token_ids=tok.stop_token_ids)
    batch = engine.rollout(params, 0, [chat(PROMPTS[2])], sampling, rng=jax.random.key(1))
    assert len({s.output_ids for s in batch.samples}) > 1  # really sampled
    for s in batch.samples:
        scores = torch.tensor(hf_logits(model, s.prompt_ids + s.output_ids)
                              [len(s.prompt_ids) - 1:-1])
        for warp in (TemperatureLogitsWarper(temperature), TopKLogitsWarper(top_k),
                     TopPLogitsWarper(top_p)):
            scores = warp(None, scores)
        want = torch.log_softmax(scores, -1).gather(-1, torch.tensor(s.output_ids)[:, None])
        np.testing.assert_allclose(s.output_logprobs, want[:, 0].numpy(), atol=LOGPROB_TOL)


def test_export_reloads_in_transformers_with_equal_logits(ours, theirs, tmp_path):
    config, params, tok = ours
    model, _ = theirs
    save_pretrained(tmp_path, config, params, tokenizer=tok)
    reloaded = tf.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    ids = tok.apply_chat_template(chat(PROMPTS[1]))
    np.testing.assert_array_equal(hf_logits(reloaded, ids), hf_logits(model, ids))
    assert tf.AutoTokenizer.from_pretrained(tmp_path).apply_chat_template(
        chat(PROMPTS[1]), add_generation_prompt=True, tokenize=True, return_dict=False) == ids
