"""Model scale: decode-loop compile time vs depth (layers run by one lax.scan), and loading
a Qwen2.5-0.5B-shaped checkpoint (random weights written with save_pretrained) on CPU."""
import json
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import pytest

from jaxrl_cache.models import ModelConfig, init_kv_cache, init_params, save_pretrained
from jaxrl_cache.rollout import core as rollout_core

pytestmark = pytest.mark.slow
QWEN25_05B = ModelConfig(vocab_size=151936, d_model=896, n_layers=24, n_heads=14, n_kv_heads=2,
                         head_dim=64, d_ff=4864, max_seq_len=32768, rope_theta=1e6,
                         norm_eps=1e-6, qkv_bias=True, tie_embeddings=True, dtype="bfloat16")


def decode_loop_compile_seconds(config: ModelConfig, rows=8, width=8, steps=32) -> float:
    """Seconds to lower and compile the rollout decode chunk (the on-device decode loop) for
    `config`, without running it."""
    params = jax.eval_shape(lambda k: init_params(config, k), jax.random.key(0))
    kv = jax.eval_shape(lambda: init_kv_cache(config, rows * width + 1, 16))
    i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)  # noqa: E731
    start = time.perf_counter()
    rollout_core.decode_chunk.lower(
        params, kv, jax.ShapeDtypeStruct((rows, config.vocab_size), jnp.float32),
        jax.ShapeDtypeStruct((rows,), jnp.bool_), i32(rows), i32(rows), i32(rows, width),
        i32(rows), i32(rows), i32(rows), i32(1), i32(), jnp.float32(1.0), jnp.float32(1.0),
        jnp.int32(0), jax.random.key(0), config=config, backend="xla", steps=steps).compile()
    return time.perf_counter() - start


def test_decode_loop_compile_time_does_not_grow_with_depth(benchmark):
    decode_loop_compile_seconds(ModelConfig.tiny(n_layers=1))  # one-off backend warm-up
    shallow = decode_loop_compile_seconds(ModelConfig.tiny(n_layers=2))
    deep = benchmark.pedantic(decode_loop_compile_seconds, args=(ModelConfig.tiny(n_layers=24),),
                              rounds=1)
    benchmark.extra_info.update(compile_s_2_layers=shallow, compile_s_24_layers=deep)


_LOAD = """
import json, sys, time
import jax
from jaxrl_cache.models import from_pretrained

def rss_gib(field):  # VmHWM (peak) / VmRSS of this process; unlike ru_maxrss not inherited
    line = next(l for l in open("/proc/self/status") if l.startswith(field))
    return int(line.split()[1]) / 2**20

base = rss_gib("VmRSS")
start = time.perf_counter()
config, params = from_pretrained(sys.argv[1])
jax.block_until_ready(params)
seconds = time.perf_counter() - start
nbytes = sum(x.nbytes for x in jax.tree.leaves(params))
print(json.dumps(dict(seconds=seconds, peak_rss_gib=rss_gib("VmHWM"), rss_before_gib=base,
                      params_gib=nbytes / 2**30)))
"""


def test_load_qwen25_05b_shaped_checkpoint(benchmark, tmp_path):
    """Load in a fresh process so its peak RSS is the load's."""
    keys = iter(jax.random.split(jax.random.key(0), 64))
    shapes = jax.eval_shape(lambda k: init_params(QWEN25_05B, k), jax.random.key(0))
    params = jax.tree.map(lambda s: jax.random.normal(next(keys), s.shape, s.dtype) * 0.02,
                          shapes)
    save_pretrained(tmp_path, QWEN25_05B, params)
    del params

    def load():
        out = subprocess.run([sys.executable, "-c", _LOAD, str(tmp_path)], check=True,
                             capture_output=True, text=True)
        return json.loads(out.stdout.strip().splitlines()[-1])

    result = benchmark.pedantic(load, rounds=1)
    benchmark.extra_info.update(result)
