"""This engine vs transformers `generate` on the GRPO workload, same weights, side by side.

8 prompts sharing a 192-token prefix + 64 own tokens each, n=8 samples per prompt, 32 new
tokens, no stop, temperature 1. The weights are written once with save_pretrained and loaded
by both (fp32, CPU). transformers runs with torch's thread count set to the cores this
process may use (XLA's CPU client uses the same). Each engine call runs at a new version,
so it starts from an empty prefix cache (only in-call reuse counts). Needs the `parity`
extra (torch, transformers); skipped otherwise.
"""
import os

import jax
import numpy as np
import pytest

from jaxrl_cache.models import ModelConfig, from_pretrained, init_params, save_pretrained
from jaxrl_cache.rollout import CacheConfig, RolloutEngine
from jaxrl_cache.rollout.sampling import SamplingParams
from benchmarks.timing import timed

torch = pytest.importorskip("torch")
tf = pytest.importorskip("transformers")
pytestmark = pytest.mark.slow

PROMPTS, GROUP, PREFIX, OWN, NEW = 8, 8, 192, 64, 32
CONFIG = ModelConfig(vocab_size=2048, d_model=256, n_layers=4, n_heads=4, n_kv_heads=2,
                     head_dim=64, d_ff=768, max_seq_len=512, qkv_bias=True, rope_theta=1e6)
SAMPLING = SamplingParams(n=GROUP, max_new_tokens=NEW, temperature=1.0)
ROUNDS = 3


def _prompts():
    rng = np.random.default_rng(0)
    prefix = rng.integers(0, CONFIG.vocab_size, PREFIX).tolist()
    return [prefix + rng.integers(0, CONFIG.vocab_size, OWN).tolist() for _ in range(PROMPTS)]


def _median_seconds(fn) -> float:
    fn()  # compile / warm up
    return timed(fn, ROUNDS)[0]


def test_engine_vs_transformers_generate(benchmark, tmp_path):
    threads = len(os.sched_getaffinity(0))
    torch.set_num_threads(threads)
    save_pretrained(tmp_path, CONFIG, init_params(CONFIG, jax.random.key(0)))
    config, params = from_pretrained(tmp_path, dtype="float32")
    model = tf.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    prompts = _prompts()

    def engine_run(prefix_cache: bool):
        engine = RolloutEngine(config, CacheConfig(num_pages=2048, page_size=16,
                                                   prefix_cache=prefix_cache), backend="xla")
        version = iter(range(1_000_000))

        def run():
            v = next(version)
            batch = engine.rollout(params, v, prompts, SAMPLING, rng=jax.random.key(v))
            assert all(len(s.output_ids) == NEW for s in batch.samples)
        return run

    def hf_run():
        ids = torch.tensor(prompts)
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True,
                                 temperature=1.0, top_k=0, top_p=1.0,
                                 num_return_sequences=GROUP, max_new_tokens=NEW,
                                 min_new_tokens=NEW, eos_token_id=None, pad_token_id=0)
        assert out.shape == (PROMPTS * GROUP, PREFIX + OWN + NEW)

    hf_s = _median_seconds(hf_run)
    off_s = _median_seconds(engine_run(False))
    on = engine_run(True)
    on()  # compile
    benchmark.pedantic(on, rounds=ROUNDS)
    on_s = benchmark.stats.stats.median
    benchmark.extra_info.update(
        threads=threads, transformers_s=hf_s, engine_prefix_reuse_s=on_s,
        engine_no_reuse_s=off_s, speedup_prefix_reuse=hf_s / on_s,
        speedup_no_reuse=hf_s / off_s, transformers_version=tf.__version__,
        torch_version=torch.__version__)
