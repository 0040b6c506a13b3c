"""Where do the sampler's bits and the trainer's part? (issue 33, for a GPU that says "not exact")

`gpu_check`'s exactness rows count the engine log-probs that differ from the trainer's; this
says where the difference starts. For one token sequence it computes the same values on the
sampler's path (a paged prefill of all but the last token, then one decode step:
`models.llama.prefill_forward` / `decode_forward`, `rollout.sampling.sample_tokens`) and on
the trainer's (`models.llama.forward`, `rl.logprobs.next_token_log_probs`), and counts the
elements whose bits differ, level by level:

- `depths`: the model cut to its first d blocks, d = 0..L (d = 0: embedding, final norm and
  LM head only): the prefilled last prompt token's logits and the decoded token's logits
  against the trainer's logits at those positions. The first depth that differs names the
  block where the bits part (0: the norm / LM head path, not attention);
- `layer0_kv`: layer 0's K and V as the engine wrote them (prefilled rows, the decoded row)
  against the same projections and rotary over the whole row in one program;
- `attention`: the decode kernel against the prefill kernel on the same q, K and V (the last
  query row of a causal prefill is a decode);
- `logprob`: the recorded log-prob (the sampler's formula on the decoded logits) against the
  audit's teacher-forced one;
- `ops`: rms_norm, rotary and the log-softmax normaliser at a few row counts against the same
  rows among `OP_ROWS[-1]` (XLA's fusion and reduction codegen may change with the shape).

Counts only; never raises on a difference. JAXRL_CACHE_KERNELS applies as everywhere.

    python -m benchmarks.exactness_probe [--backend interpret|pallas|xla] [--dtype bfloat16]
"""
from __future__ import annotations

import argparse
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_cache.models import ModelConfig, init_params
from jaxrl_cache.models.llama import (_qkv, decode_forward, forward, init_kv_cache,
                                      prefill_forward, rms_norm, rotary,
                                      rotary_tables)
from jaxrl_cache.rl.logprobs import next_token_log_probs
from jaxrl_cache.rollout import SamplingParams
from jaxrl_cache.distribution import log_normaliser
from jaxrl_cache.rollout.sampling import sample_tokens

PAGE = 16
DECODE_ROWS = 4  # the decode step's batch: row 0 is the sequence, the others inactive
OP_ROWS = (1, 3, 17, 64, 256)


def _differ(got, want) -> dict:
    """Elements whose bits differ (NaN counts), out of how many, and the largest |diff|."""
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    return dict(differ=int(np.sum(got != want)), of=int(want.size),
                max_abs=float(np.max(np.abs(got - want), initial=0.0)))


def _cut(params: dict, depth: int) -> dict:
    """params of the model's first `depth` blocks (the same embedding and head; the config
    is kept: the forwards run the blocks params hold, a KV pool keeps unused layers)."""
    return dict(params, layers=jax.tree.map(lambda a: a[:depth], params["layers"]))


@functools.partial(jax.jit, static_argnames=("config", "backend"))
def _engine_side(params, tokens, *, config, backend):
    """tokens int32 [N] -> (prefill logits f32 [V] of token N-2, decode logits f32 [V] of
    token N-1, the KV pool): the sampler's two programs, as the engine lays them out (one
    sequence on pages 1..W, prefill rows padded to a multiple of PAGE, a decode batch of
    DECODE_ROWS rows of which one is live)."""
    n = tokens.shape[0]
    prompt = n - 1
    width = -(-n // PAGE)
    pool = init_kv_cache(config, width + 1, PAGE)
    table = jnp.arange(1, width + 1, dtype=jnp.int32)[None]  # [1, W]
    rows = -(-prompt // PAGE) * PAGE
    index = jnp.arange(rows, dtype=jnp.int32)
    packed = jnp.where(index < prompt, jnp.pad(tokens[:prompt], (0, rows - prompt)), 0)
    pos = jnp.where(index < prompt, index, -1)
    logits_p, pool = prefill_forward(
        params, config, pool, packed, jnp.zeros(rows, jnp.int32), pos, table,
        jnp.asarray([0, prompt], jnp.int32), jnp.asarray([prompt], jnp.int32),
        jnp.asarray([prompt - 1], jnp.int32), backend=backend)
    live = jnp.arange(DECODE_ROWS) == 0
    logits_d, pool = decode_forward(
        params, config, pool, jnp.where(live, tokens[-1], 0).astype(jnp.int32),
        jnp.where(live, prompt, -1).astype(jnp.int32),
        jnp.where(live[:, None], table, 0), backend=backend)
    return logits_p[0], logits_d[0], pool


@functools.partial(jax.jit, static_argnames=("config",))
def _trainer_logits(params, tokens, *, config):
    """tokens int32 [N] -> the trainer's dense forward logits f32 [N, V] (one plain row)."""
    return forward(params, config, tokens[None])[0]


@functools.partial(jax.jit, static_argnames=("config",))
def _layer0_kv(params, tokens, *, config):
    """tokens int32 [N] -> layer 0's (k, v) [N, Hkv, D] over the whole row in one program."""
    layer = jax.tree.map(lambda a: a[0], params["layers"])
    h = rms_norm(params["embed"][tokens][None], layer["attn_norm"], config.norm_eps)
    tables = rotary_tables(jnp.arange(tokens.shape[0], dtype=jnp.int32)[None],
                           jnp.asarray(config.inv_freq()))
    _, k, v = _qkv(layer, config, h, tables, None)
    return k[0], v[0]


def depth_rows(params, config: ModelConfig, tokens, backend: str) -> list[dict]:
    """Per depth d = 0..L: the prefilled and the decoded token's logits vs the trainer's."""
    out = []
    n = len(tokens)
    for depth in range(config.n_layers + 1):
        p = _cut(params, depth)
        prefill, decode, _ = _engine_side(p, tokens, config=config, backend=backend)
        trainer = _trainer_logits(p, tokens, config=config)
        out.append(dict(depth=depth, prefill_logits=_differ(prefill, trainer[n - 2]),
                        decode_logits=_differ(decode, trainer[n - 1])))
    return out


def layer0_kv(params, config: ModelConfig, tokens, backend: str) -> dict:
    """Layer 0's K/V in the engine's pool (prefilled rows; the decoded row) vs `_layer0_kv`."""
    n = len(tokens)
    _, _, (k_pool, v_pool) = _engine_side(params, tokens, config=config, backend=backend)
    # pool [L, P, Hkv, PAGE, D] -> layer 0's tokens in order [N, Hkv, D] (pages 1..W)
    flat = lambda pool: jnp.swapaxes(pool[0, 1:], 1, 2).reshape(-1, *pool.shape[2:3],  # noqa
                                                                  pool.shape[-1])[:n]
    k_engine, v_engine = flat(k_pool), flat(v_pool)
    k_want, v_want = _layer0_kv(params, tokens, config=config)
    return dict(k_prefilled=_differ(k_engine[:n - 1], k_want[:n - 1]),
                v_prefilled=_differ(v_engine[:n - 1], v_want[:n - 1]),
                k_decoded=_differ(k_engine[n - 1:], k_want[n - 1:]),
                v_decoded=_differ(v_engine[n - 1:], v_want[n - 1:]))


def attention_kernels(config: ModelConfig, backend: str, length: int = 45) -> dict:
    """The decode kernel's output for a query at position `length - 1` vs the last row of a
    causal prefill of the whole sequence over the same pages (random q, K, V)."""
    from kernels_pallas import paged_decode_attention, paged_prefill_attention
    hq, hkv, d = config.n_heads, config.n_kv_heads, config.head_dim
    width = -(-length // PAGE)
    dtype = jnp.dtype(config.dtype)
    keys = jax.random.split(jax.random.key(7), 3)
    k = jax.random.normal(keys[0], (width + 1, hkv, PAGE, d), dtype)
    v = jax.random.normal(keys[1], (width + 1, hkv, PAGE, d), dtype)
    q = jax.random.normal(keys[2], (length, hq, d), dtype)
    table = jnp.arange(1, width + 1, dtype=jnp.int32)[None]
    lens = jnp.asarray([length], jnp.int32)
    prefill = jax.jit(functools.partial(paged_prefill_attention, backend=backend))(
        q, k, v, table, jnp.asarray([0, length], jnp.int32), lens)
    decode = jax.jit(functools.partial(paged_decode_attention, backend=backend))(
        q[-1:], k, v, table, lens)
    return _differ(decode[0], prefill[-1])


def logprob(params, config: ModelConfig, tokens, sampling: SamplingParams,
            backend: str) -> dict:
    """The decoded token's recorded log-prob (sample_tokens on the decode logits) vs the
    audit's teacher-forced one (next_token_log_probs over the row plus that token)."""
    _, decode, _ = _engine_side(params, tokens, config=config, backend=backend)
    knobs = sampling.as_arrays()
    drawn, recorded = jax.jit(sample_tokens)(decode[None], jax.random.key(3)[None],
                                             knobs["temperature"], knobs["top_p"],
                                             knobs["top_k"])
    row = np.asarray(list(tokens) + [int(drawn[0])], np.int32)[None]
    audit = next_token_log_probs(params, config, row, sampling)[0, -1]
    return _differ(recorded[0], audit)


def op_rows(config: ModelConfig) -> list[dict]:
    """rms_norm, rotary and log_normaliser on the first r rows of a batch, r in OP_ROWS, vs
    the same rows among OP_ROWS[-1] (each a separate program)."""
    rng = np.random.default_rng(0)
    big = OP_ROWS[-1]
    d, hd, dtype = config.d_model, config.head_dim, jnp.dtype(config.dtype)
    x = jnp.asarray(rng.standard_normal((big, d)), dtype)
    w = jnp.asarray(1 + 0.1 * rng.standard_normal(d), dtype)
    heads = jnp.asarray(rng.standard_normal((big, config.n_heads, hd)), dtype)
    positions = jnp.asarray(rng.integers(0, config.max_seq_len, big), jnp.int32)
    inv_freq = jnp.asarray(config.inv_freq())
    logits = jnp.asarray(4 * rng.standard_normal((big, config.vocab_size)), jnp.float32)
    ops = dict(
        rms_norm=(jax.jit(lambda a: rms_norm(a, w, config.norm_eps)), (x,)),
        rotary=(jax.jit(lambda a, p: rotary(a, rotary_tables(p, inv_freq))),
                (heads, positions)),
        log_normaliser=(jax.jit(log_normaliser), (logits,)))
    out = []
    for name, (fn, args) in ops.items():
        want = np.asarray(fn(*args), np.float32)
        differ = [r for r in OP_ROWS[:-1]
                  if not np.array_equal(np.asarray(fn(*(a[:r] for a in args)), np.float32),
                                        want[:r])]
        out.append(dict(op=name, rows_with_other_bits=differ, rows_tried=list(OP_ROWS[:-1])))
    return out


def probe(params, config: ModelConfig, tokens, *, backend: str,
          sampling: SamplingParams | None = None) -> dict:
    """Every level of the module doc for one sequence (tokens: ints, len >= 3), on the
    engine backend `backend` (xla / pallas / interpret) and this process's
    JAXRL_CACHE_KERNELS. `first_depth`: the smallest depth whose logits differ (None: none)."""
    tokens = jnp.asarray(tokens, jnp.int32)
    if tokens.ndim != 1 or tokens.shape[0] < 3:
        raise ValueError(f"tokens must be a sequence of at least 3 ids, got shape "
                         f"{tokens.shape}")
    sampling = sampling or SamplingParams(n=1, max_new_tokens=1, temperature=1.0)
    depths = depth_rows(params, config, tokens, backend)
    bad = [r["depth"] for r in depths
           if r["prefill_logits"]["differ"] or r["decode_logits"]["differ"]]
    return dict(depths=depths, first_depth=bad[0] if bad else None,
                layer0_kv=layer0_kv(params, config, tokens, backend)
                if config.n_layers else None,
                attention=attention_kernels(config, backend),
                logprob=logprob(params, config, tokens, sampling, backend),
                ops=op_rows(config))


def summary(result: dict) -> str:
    """One line: where the bits part first (or that they never do)."""
    depth = result["first_depth"]
    parts = ["logits equal at every depth" if depth is None else
             f"logits first differ at depth {depth}" + (" (norm / LM head path)"
                                                       if depth == 0 else "")]
    kv = result.get("layer0_kv") or {}
    parts += [f"layer-0 {name} differs in {c['differ']}/{c['of']}"
              for name, c in kv.items() if c["differ"]]
    if result["attention"]["differ"]:
        parts.append(f"decode vs prefill kernel differs in {result['attention']['differ']}/"
                     f"{result['attention']['of']}")
    parts += [f"{o['op']} changes bits at rows {o['rows_with_other_bits']}"
              for o in result["ops"] if o["rows_with_other_bits"]]
    lp = result["logprob"]
    parts.append(f"log-prob {'equal' if not lp['differ'] else 'differs by %.2e' % lp['max_abs']}")
    return "; ".join(parts)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="interpret" if jax.default_backend() == "cpu"
                        else "pallas", help="the engine's attention backend")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    args = parser.parse_args()
    config = ModelConfig.tiny(vocab_size=512, d_model=256, n_layers=2, n_heads=8,
                              n_kv_heads=2, head_dim=64, d_ff=512, max_seq_len=512,
                              dtype=args.dtype)
    params = init_params(config, jax.random.key(0))
    tokens = np.random.default_rng(0).integers(1, 512, 53).tolist()
    result = probe(params, config, tokens, backend=args.backend)
    print(json.dumps(result, indent=1))
    print(summary(result))


if __name__ == "__main__":
    main()
