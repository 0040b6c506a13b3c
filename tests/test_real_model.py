"""`slow`: the real-model fixture (SmolLM2-135M-Instruct, built by scripts/fetch_smollm2.py)
against transformers on the same directory: it loads as the same model, greedy chat output is
transformers' (token ids and text), sampled tokens carry the log-probs of transformers' warped
distribution, and save_pretrained writes a directory transformers loads with equal logits.

Also detection power on the real model (needs only jax): after ONE GRPO `train_step` at lr
1e-6 or 1e-7, a version-blind engine that serves version-0 prefix KV to the version-1 rollout
is flagged by the exact audit on every stale sample, and the honest engine on none.

Skipped (with the reason) where the directory, torch or transformers is absent: CI has none
of them; the comparisons with transformers skip without torch, the detection test runs in the
main venv. Run in the torch venv (the script's docstring):
    python -m pytest tests/test_real_model.py -m slow
"""
import importlib.util
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_cache.models import forward, from_pretrained, load_tokenizer, save_pretrained
from jaxrl_cache.rl.audit import audit_attribution
from jaxrl_cache.rl.logprobs import next_token_log_probs
from jaxrl_cache.rl.batch import make_batch
from jaxrl_cache.rl.train import TrainState, train_step
from jaxrl_cache.rollout import CacheConfig, RolloutEngine, SamplingParams, SchedulerConfig
from jaxrl_cache.shapes import bucket

pytestmark = pytest.mark.slow

_spec = importlib.util.spec_from_file_location(
    "fetch_smollm2", pathlib.Path(__file__).resolve().parents[1] / "scripts" / "fetch_smollm2.py")
fetch = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fetch)
DIR = fetch.model_dir()
if not fetch.is_complete(DIR):
    pytest.skip(f"no real model at {DIR} (build it with `make real-model`; "
                f"JAXRL_SMOLLM2_DIR overrides the path)", allow_module_level=True)
try:  # only the comparisons with transformers need them (the `theirs` fixture skips)
    import torch
    import transformers as tf
except ImportError:
    torch = tf = None

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
    if tf is None:
        pytest.skip("the comparisons with transformers need torch + transformers "
                    "(see scripts/fetch_smollm2.py)")
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


# Detection power on the real model (issue 33): 4 chat prompts sharing a ~120-token system
# prompt, n = 4, 16 new tokens, temperature 1, fp32.
SYSTEM = ("You are a careful, friendly assistant for a small team of engineers who build and "
          "test software for reinforcement learning. Answer every question briefly and "
          "precisely, in plain English, without markdown, lists or code unless the user asks "
          "for them. When a question involves arithmetic, give the final number first and then "
          "one short sentence of explanation. When you do not know the answer, say so plainly "
          "instead of guessing, and suggest where the user could look it up. Never invent "
          "facts, names, dates or citations, and keep every answer under fifty words.")
DETECT_PROMPTS = ["What is 12 * 7?", "Name the capital of France in one word.",
                  "Write a haiku about the sea.", "Why is the sky blue?"]


class VersionBlindEngine(RolloutEngine):
    """The bug the library exists to prevent: one cache namespace for every version."""

    def _cache_key(self, version):
        return 0


@pytest.mark.parametrize("lr", [1e-6, 1e-7])
def test_one_update_at_a_real_learning_rate_flags_every_stale_sample(ours, lr):
    """Version 1 = one real GRPO train_step (the library's default optimizer, rewards by
    sample parity) from version 0. The version-blind engine rolls out at version 0 (filling
    its cache), is synced to version 1 and rolls out again: every sample that reused cached
    prefix KV (all 16) is flagged by the exact audit; the honest engine's 16 are not.
    Measured (2026-12-03, XLA:CPU, 128 cached prefix tokens per sample): lr 1e-6: 16 of 16
    flagged, largest |diff| 1.1e-2, smallest per-sample max |diff| 2.9e-3; lr 1e-7: 16 of
    16, largest 1.1e-3, smallest per-sample 3.0e-4 (the old 2e-3 tolerance would have
    passed all 16); the honest engine: 0 of 16 at both, max |diff| 0. ~11 min on 2 loaded
    cores."""
    config, params0, tok = ours
    messages = [[{"role": "system", "content": SYSTEM}, {"role": "user", "content": p}]
                for p in DETECT_PROMPTS]
    assert 110 <= len(tok.apply_chat_template(messages[0][:1])) <= 130  # ~120 tokens
    sampling = SamplingParams(n=4, max_new_tokens=16, temperature=1.0)

    def engine(cls):
        return cls(config, CacheConfig(num_pages=128, page_size=16),
                   scheduler_config=SchedulerConfig(max_num_seqs=16, chunk_steps=16),
                   backend="xla", tokenizer=tok)

    blind, honest = engine(VersionBlindEngine), engine(RolloutEngine)
    first = blind.rollout(params0, 0, messages, sampling, rng=jax.random.key(1))
    assert audit_attribution(first, {0: params0}, config).ok
    rewards = [float(i % 2) for i in range(len(first.samples))]  # non-constant in each group
    state = TrainState.create(params0, config=config, lr_schedule=lr)
    new, metrics = train_step(state, make_batch(first, rewards), audit_tolerance=0.0)
    assert int(new.version) == 1 and float(metrics["logprob_mismatch_max"]) == 0.0
    params1 = new.params
    assert any(bool(np.any(np.asarray(a) != np.asarray(b)))
               for a, b in zip(jax.tree.leaves(params0), jax.tree.leaves(params1)))
    honest.rollout(params0, 0, messages, sampling, rng=jax.random.key(1))  # same history
    for e in (blind, honest):
        e.sync_weights(params1, 1)
    stale = blind.rollout(params1, 1, messages, sampling, rng=jax.random.key(2))
    reused = tuple(i for i, s in enumerate(stale.samples) if s.cached_tokens > 0)
    assert len(reused) == len(stale.samples) == 16  # every sample reused version-0 KV
    report = audit_attribution(stale, {1: params1}, config)
    fresh = honest.rollout(params1, 1, messages, sampling, rng=jax.random.key(2))
    honest_report = audit_attribution(fresh, {1: params1}, config)
    per_sample = _per_sample_max_diff(stale, params1, config)
    print(f"\nlr {lr:g}: version-blind flagged {len(report.flagged)}/{len(reused)} stale "
          f"(max diff {report.max_abs_diff:.3g}, smallest per-sample max diff "
          f"{min(per_sample[i] for i in reused):.3g}, cached tokens "
          f"{sorted({stale.samples[i].cached_tokens for i in reused})}); honest flagged "
          f"{len(honest_report.flagged)}/{honest_report.num_samples} "
          f"(max diff {honest_report.max_abs_diff})")
    assert report.exact and report.flagged == reused, (lr, report)
    assert honest_report.ok and honest_report.max_abs_diff == 0.0, honest_report


def _per_sample_max_diff(batch, params, config) -> list[float]:
    """max |recorded - teacher-forced| log-prob of each sample: the audit's comparison, kept
    per sample (one dense pass, rows padded to 64 like the audit's)."""
    longest = max(len(s.prompt_ids) + len(s.output_ids) for s in batch.samples)
    rows = np.zeros((bucket(len(batch.samples), 64), bucket(longest, 64)), np.int32)
    for i, s in enumerate(batch.samples):
        rows[i, :len(s.prompt_ids) + len(s.output_ids)] = s.prompt_ids + s.output_ids
    logp = np.asarray(next_token_log_probs(params, config, rows, batch.sampling))
    return [float(np.max(np.abs(logp[i, len(s.prompt_ids) - 1:len(s.prompt_ids) - 1
                                    + len(s.output_ids)] - s.output_logprobs)))
            for i, s in enumerate(batch.samples)]
