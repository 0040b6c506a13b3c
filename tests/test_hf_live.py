"""Live parity against transformers (runs when the `parity` extra is installed, else skipped):
what save_pretrained writes, transformers loads as the same model; multi-step engine
samples carry transformers' warped log-probabilities."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_cache.models import (ModelConfig, RopeScaling, forward, from_pretrained, init_params,
                                save_pretrained)
from jaxrl_cache.rollout import CacheConfig, RolloutEngine
from jaxrl_cache.rollout.sampling import SamplingParams
from tests.hf_fixtures import FIXTURES

torch = pytest.importorskip("torch")
tf = pytest.importorskip("transformers")

TOL = 1e-4
BASE = dict(vocab_size=56, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, d_ff=48,
            max_seq_len=64, norm_eps=1e-5)
VARIANTS = {  # each exports as a different architecture / option set
    "qwen2": dict(qkv_bias=True, rope_theta=1e6),
    "qwen3": dict(qk_norm=True, head_dim=12, tie_embeddings=False),
    "qwen3_bias": dict(qk_norm=True, qkv_bias=True, out_bias=True),
    "llama_bias_llama3": dict(qkv_bias=True, out_bias=True, tie_embeddings=False,
                              rope_scaling=RopeScaling("llama3", 8.0, 1.0, 4.0, 16)),
    "llama_linear_mqa": dict(n_kv_heads=1, rope_scaling=RopeScaling("linear", 2.0)),
}


def random_params(config, seed):
    """Every leaf redrawn (norms around 1, nonzero biases) so each mapping is exercised."""
    rng = np.random.default_rng(seed)

    def draw(path, x):
        name = jax.tree_util.keystr(path)
        z = rng.standard_normal(x.shape).astype(np.float32)
        if "norm" in name:
            return jnp.asarray(1 + 0.3 * z)
        if "'b" in name:  # bq, bk, bv, bo
            return jnp.asarray(0.3 * z)
        return jnp.asarray(z if "embed" in name else z * 1.5 / x.shape[-2] ** 0.5)

    return jax.tree_util.tree_map_with_path(draw, init_params(config, jax.random.key(0)))


@pytest.mark.parametrize("name", VARIANTS)
def test_transformers_loads_the_export_as_the_same_model(tmp_path, name):
    config = ModelConfig(**{**BASE, **VARIANTS[name]})
    params = random_params(config, 1)
    save_pretrained(tmp_path, config, params)
    model = tf.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    tokens = np.random.default_rng(2).integers(0, config.vocab_size, (2, 24))
    with torch.no_grad():
        want = model(torch.tensor(tokens)).logits.numpy()
    got = np.asarray(forward(params, config, jnp.asarray(tokens, jnp.int32)))
    np.testing.assert_allclose(got, want, atol=TOL, rtol=0)


@pytest.mark.parametrize("temperature,top_k,top_p", [(0.8, 12, 1.0), (1.2, 0, 0.85)])
def test_multistep_engine_logprobs_match_transformers_warpers(temperature, top_k, top_p):
    from transformers.generation.logits_process import (TemperatureLogitsWarper,
                                                        TopKLogitsWarper, TopPLogitsWarper)
    config, params = from_pretrained(FIXTURES / "qwen3", dtype="float32")
    model = tf.AutoModelForCausalLM.from_pretrained(FIXTURES / "qwen3",
                                                    dtype=torch.float32).eval()
    engine = RolloutEngine(config, CacheConfig(num_pages=64, page_size=8), backend="xla")
    sampling = SamplingParams(n=4, max_new_tokens=8, temperature=temperature, top_k=top_k,
                              top_p=top_p)
    batch = engine.rollout(params, 0, [[3, 1, 4, 1, 5, 9, 2, 6]], sampling,
                           rng=jax.random.key(0))
    for s in batch.samples:
        seq = torch.tensor([list(s.prompt_ids) + list(s.output_ids)])
        with torch.no_grad():
            scores = model(seq).logits[0, len(s.prompt_ids) - 1:-1]
        scores = TemperatureLogitsWarper(temperature)(None, scores)
        if top_k:
            scores = TopKLogitsWarper(top_k)(None, scores)
        if top_p < 1:
            scores = TopPLogitsWarper(top_p)(None, scores)
        want = torch.log_softmax(scores, -1).gather(-1, torch.tensor(s.output_ids)[:, None])
        np.testing.assert_allclose(s.output_logprobs, want[:, 0].numpy(), atol=TOL)
