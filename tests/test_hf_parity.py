"""Parity with transformers on the committed fixtures (no torch needed): dense logits, greedy
tokens and logprobs through the RolloutEngine, sampling logprobs under temperature / top-k /
top-p, and a negative control showing a wrong weight mapping fails the same checks."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_cache.models import FAMILIES, forward, from_pretrained
from jaxrl_cache.rollout import CacheConfig, RolloutEngine
from jaxrl_cache.distribution import behavior_log_probs
from jaxrl_cache.rollout.sampling import SamplingParams
from tests.hf_fixtures import ARCHS, FIXTURES, SAMPLING, expected

TOL = 1e-4


def dense_error(name: str) -> float:
    config, params = from_pretrained(FIXTURES / name, dtype="float32")
    want = expected(name)
    got = forward(params, config, jnp.asarray(want["tokens"])[None])[0]
    return float(np.abs(np.asarray(got) - want["logits"]).max())


@pytest.mark.parametrize("name", ARCHS)
def test_dense_logits_match_transformers(name):
    assert dense_error(name) <= TOL


# CI runs the engine path for the layouts that cover every mapping branch (Llama-3 rope
# scaling + attention bias; Qwen3 q/k norms; Gemma's GeGLU, 1 + w norms and scaled
# embeddings); `make test-full` runs all six.
ENGINE_CI = ("llama3", "qwen3", "gemma")


@pytest.mark.parametrize("name", [n if n in ENGINE_CI else pytest.param(
    n, marks=pytest.mark.slow) for n in ARCHS])
def test_engine_greedy_and_sampling_logprobs_match_transformers(name):
    """One rollout shape per setting (no prefix cache, so one compilation per model): the
    greedy prompt plus prefixes of the fixture sequence. Greedy: the whole continuation equals
    transformers generate. Sampling: each prefix's first drawn token lies in the support of
    transformers' warped distribution and its recorded logprob is that distribution's."""
    config, params = from_pretrained(FIXTURES / name, dtype="float32")
    want = expected(name)
    engine = RolloutEngine(config, CacheConfig(num_pages=128, page_size=8, prefix_cache=False),
                           backend="xla")
    lengths = (5, 9, 12)  # + 12 new tokens fits mistral's 24 (its sliding window)
    prompts = [want["greedy_prompt"].tolist()] + [want["tokens"][:n].tolist() for n in lengths]
    new = len(want["greedy_tokens"])
    settings = {"greedy": (0.0, 0, 1.0), **SAMPLING}
    for key, (temperature, top_k, top_p) in settings.items():
        sampling = SamplingParams(n=4, max_new_tokens=new, temperature=temperature,
                                  top_k=top_k, top_p=top_p)
        batch = engine.rollout(params, 0, prompts, sampling, rng=jax.random.key(1))
        for s in batch.samples:
            if key == "greedy" and s.group == 0:
                assert list(s.output_ids) == want["greedy_tokens"].tolist()
                np.testing.assert_allclose(s.output_logprobs, want["greedy_logprobs"], atol=TOL)
            elif key != "greedy" and s.group > 0:
                logp = want[f"sample_{key}"][len(s.prompt_ids) - 1]
                tok = s.output_ids[0]
                assert np.isfinite(logp[tok]), (key, tok)
                np.testing.assert_allclose(s.output_logprobs[0], logp[tok], atol=TOL,
                                           err_msg=f"sampling {key}")


def test_top_k_then_top_p_matches_transformers_warpers():
    """The behavior distribution itself, at every position of the fixture sequence."""
    config, params = from_pretrained(FIXTURES / "qwen3", dtype="float32")
    want = expected("qwen3")
    logits = forward(params, config, jnp.asarray(want["tokens"])[None])[0]
    for key, (temperature, top_k, top_p) in SAMPLING.items():
        got = np.asarray(behavior_log_probs(logits, jnp.float32(temperature),
                                            jnp.float32(top_p), jnp.int32(top_k)))
        finite = np.isfinite(want[f"sample_{key}"])
        np.testing.assert_array_equal(np.isfinite(got), finite, err_msg=key)
        np.testing.assert_allclose(got[finite], want[f"sample_{key}"][finite], atol=TOL,
                                   err_msg=key)


@pytest.mark.parametrize("wrong", ["swap_gate_up", "untransposed_o_proj"])
def test_negative_control_a_wrong_mapping_fails(monkeypatch, wrong):
    llama = FAMILIES["llama"]
    table = list(llama.layer_weights)
    names = [ours for ours, _, _ in table]
    if wrong == "swap_gate_up":
        g, u = names.index("w_gate"), names.index("w_up")
        table[g], table[u] = (("w_gate",) + table[u][1:]), (("w_up",) + table[g][1:])
    else:  # o_proj is square here (4 heads x 8 = 32 = hidden), so shapes still fit
        o = names.index("wo")
        table[o] = table[o][:2] + (False,)
    monkeypatch.setitem(FAMILIES, "llama", dataclasses.replace(llama, layer_weights=tuple(table)))
    assert dense_error("qwen2") > 100 * TOL
