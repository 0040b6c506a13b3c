"""Rollout engine on CPU with the demo-family model: GRPO prefix reuse on vs off, the
weight-sync acknowledgement path, a full iteration; `_dense_decode_loop` is the dense-KV
baseline that benchmarks/engine_v2.py compares the paged decode chunk against."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_cache.rollout import CacheConfig, RolloutEngine
from jaxrl_cache.models.llama import (ModelConfig, _mlp, _qkv, init_params, lm_logits,
                                      rms_norm, rotary_tables)
from jaxrl_cache.rollout.sampling import SamplingParams, sample_tokens
from jaxrl_cache.rl.batch import make_batch
from jaxrl_cache.rl.train import TrainState, train_step
from benchmarks.timing import timed

pytestmark = pytest.mark.slow
CONFIG = ModelConfig.tiny(vocab_size=32, max_seq_len=512)
PROMPTS, GROUP, PROMPT_LEN, NEW = 8, 8, 256, 32
SAMPLING = SamplingParams(n=GROUP, max_new_tokens=NEW, temperature=1.0)


def _prompts(seed=0):
    rng = np.random.default_rng(seed)
    return rng.integers(4, CONFIG.vocab_size, (PROMPTS, PROMPT_LEN)).tolist()


class _Cold:
    """Rollouts that always start from an empty cache: each call runs at a new version."""

    def __init__(self, prefix_cache):
        self.engine = RolloutEngine(CONFIG, CacheConfig(num_pages=2048, page_size=16,
                                                        prefix_cache=prefix_cache))
        self.params = init_params(CONFIG, jax.random.key(0))
        self.version = 0

    def __call__(self):
        batch = self.engine.rollout(self.params, self.version, _prompts(), SAMPLING,
                                    rng=jax.random.key(self.version))
        self.version += 1
        return batch



def test_grpo_rollout_prefix_reuse_on_vs_off(benchmark):
    on, off = _Cold(True), _Cold(False)
    on(), off()  # compile both
    off_s = timed(off, 3)[0]
    batch = benchmark.pedantic(on, rounds=3)
    off_batch = off()
    benchmark.extra_info.update(
        prefill_tokens_on=batch.prefill_tokens, prefill_tokens_off=off_batch.prefill_tokens,
        prefill_fraction=batch.prefill_tokens / off_batch.prefill_tokens,
        seconds_on=benchmark.stats.stats.median, seconds_off=off_s,
        speedup=off_s / benchmark.stats.stats.median)
    assert batch.prefill_tokens * GROUP == off_batch.prefill_tokens


def _dense_decode_loop(config, steps):
    """Baseline: contiguous per-row KV [B, S, Hkv, D], jitted lax.fori_loop decode."""
    @jax.jit
    def run(params, cache, tokens, pos, key):
        def step(i, carry):
            cache, tokens, pos, key, out = carry
            x = params["embed"][tokens][:, None]  # [B, 1, d]
            new_cache = []
            for i, (k_all, v_all) in enumerate(cache):
                layer = {name: w[i] for name, w in params["layers"].items()}
                h = rms_norm(x, layer["attn_norm"], config.norm_eps)
                q, k, v = _qkv(layer, config, h,
                               rotary_tables(pos[:, None], jnp.asarray(config.inv_freq())),
                               None)
                rows = jnp.arange(tokens.shape[0])
                k_all = k_all.at[rows, pos].set(k[:, 0])
                v_all = v_all.at[rows, pos].set(v[:, 0])
                group = config.n_heads // config.n_kv_heads
                kr, vr = jnp.repeat(k_all, group, 2), jnp.repeat(v_all, group, 2)
                s = jnp.einsum("bhd,bshd->bhs", q[:, 0], kr) * config.head_dim ** -0.5
                valid = jnp.arange(k_all.shape[1])[None, :] <= pos[:, None]
                p = jax.nn.softmax(jnp.where(valid[:, None], s, -jnp.inf), axis=-1)
                attn = jnp.einsum("bhs,bshd->bhd", p, vr).reshape(x.shape[0], 1, -1)
                x = x + attn @ layer["wo"]
                h = rms_norm(x, layer["mlp_norm"], config.norm_eps)
                x = x + _mlp(layer, config, h, None)
                new_cache.append((k_all, v_all))
            key, sub = jax.random.split(key)
            tok, _ = sample_tokens(lm_logits(params, config, x[:, 0]),
                                   jax.random.split(sub, tokens.shape[0]), 1.0, 1.0, 0)
            return tuple(new_cache), tok, pos + 1, key, out.at[:, i].set(tok)

        out = jnp.zeros((tokens.shape[0], steps), jnp.int32)
        return jax.lax.fori_loop(0, steps, step, (cache, tokens, pos, key, out))[-1]
    return run


def test_weight_sync_ack_with_2048_cached_pages(benchmark):
    tiny = ModelConfig.tiny(vocab_size=32, max_seq_len=512)
    engine = RolloutEngine(tiny, CacheConfig(num_pages=4096, page_size=16))
    params = init_params(tiny, jax.random.key(0))
    rng = np.random.default_rng(0)
    engine.sync_weights(params, 0)

    def setup():
        # 128 cached 256-token prompts = 2,048 pages under the current version
        for _ in range(128):
            prompt = rng.integers(0, 32, 256).tolist()
            pages = engine.cache.alloc(16)
            engine.cache.insert(engine.version, prompt, pages)
            engine.cache.release(pages)
        new = jax.tree.map(lambda x: x + 0, params)  # fresh buffers, as after a train step
        return (new, engine.version + 1), {}

    ack = benchmark.pedantic(engine.sync_weights, setup=setup, rounds=10)
    assert ack.invalidated_pages == 2048
    benchmark.extra_info["ack_ms"] = benchmark.stats.stats.median * 1e3


def test_full_iteration_rollout_train_sync(benchmark):
    engine = RolloutEngine(CONFIG, CacheConfig(num_pages=2048, page_size=16))
    state = TrainState.create(init_params(CONFIG, jax.random.key(0)), config=CONFIG)
    holder = {"state": state}
    sampling = SamplingParams(n=GROUP, max_new_tokens=NEW, temperature=1.0)

    def iteration():
        s = holder["state"]
        b = engine.rollout(s.params, s.version, _prompts(), sampling,
                           rng=jax.random.key(int(s.version)))
        rewards = [float(np.mean(x.output_ids)) for x in b.samples]
        s, _ = train_step(s, make_batch(b, rewards))
        engine.sync_weights(s.params, s.version)
        holder["state"] = s

    iteration()
    benchmark.pedantic(iteration, rounds=3)
