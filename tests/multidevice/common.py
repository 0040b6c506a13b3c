"""Shared inputs of the multi-device tests and the multi-host program: a tiny model (8 query
heads, 2 kv heads: tensor axes up to 8, kv heads copied beyond 2), a training batch and a
paged prefill of two prompts followed by greedy decode steps."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxrl_cache.models import ModelConfig, init_params
from jaxrl_cache.rl.batch import TrainBatch, make_batch
from jaxrl_cache.rl.train import TrainState
from jaxrl_cache.rollout.sampling import SamplingParams
from jaxrl_cache.rollout.types import RolloutBatch, Sample
from tests.helpers import teacher_forced_log_probs

CONFIG = ModelConfig.tiny(vocab_size=32, n_layers=1, d_model=32, n_heads=8, n_kv_heads=2,
                          head_dim=8, d_ff=64)
NUM_PAGES, PAGE_SIZE = 8, 4
# Adam with a large eps: a first step g / (|g| + eps) is then well conditioned, so fp32
# reduction-order noise in g stays noise in the params (with eps=1e-8 a near-zero gradient's
# sign decides a full lr step).
TX = optax.scale_by_adam(eps=1e-1)
SAMPLING = SamplingParams(max_new_tokens=29)  # temperature 1, no top-k / top-p


def params(seed: int = 0):
    """Varied weights (scaled up so greedy decoding does not collapse to one token)."""
    p = init_params(CONFIG, jax.random.key(seed))
    return jax.tree.map(lambda x: x * 8.0 if x.ndim >= 2 else x, p)


def train_state(seed: int = 0) -> TrainState:
    return TrainState.create(params(seed), TX, config=CONFIG, lr_schedule=1e-2)


def train_batch(n: int = 8, seed: int = 0) -> TrainBatch:
    """n samples through make_batch: 17 to 32 tokens (one per packed row of 32, so 8 samples
    fill a data 2 x fsdp 4 mesh row for row), prompts of 3 to 6 tokens. Behavior log-probs
    are the dense model's under slightly different params (params(1)), so ratios differ
    from 1; the advantages are the rewards (normal draws, one group per sample)."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(1, CONFIG.vocab_size, (n, 32)).astype(np.int32)
    behavior = np.asarray(jax.jit(teacher_forced_log_probs, static_argnums=1)(
        params(1), CONFIG, jnp.asarray(tokens), **SAMPLING.as_arrays()))  # causal: prefixes
    samples = []
    for i, (length, prompt) in enumerate(zip(rng.integers(17, 33, n), rng.integers(3, 7, n))):
        seq = [int(t) for t in tokens[i, :length]]
        samples.append(Sample(tuple(seq[:prompt]), tuple(seq[prompt:]),
                              behavior[i, prompt - 1:length - 1], 0,
                              np.zeros(length - prompt, np.int64), 0, "length", i))
    rollout = RolloutBatch(samples=samples, version=0, sampling=SAMPLING, prefill_tokens=0,
                           reused_tokens=0, cached_tokens=0, decode_steps=0, decode_chunks=0,
                           prefill_launches=0, seconds=0.0)
    return make_batch(rollout, rng.normal(size=n), advantages=lambda rewards, groups: rewards)


# Two prompts (5 and 3 tokens) packed for prefill; pages 1-2 and 3-4.
PREFILL = dict(
    tokens=np.array([3, 5, 7, 9, 11, 13, 2, 4], np.int32),
    token_seq=np.array([0] * 5 + [1] * 3, np.int32),
    token_pos=np.array([0, 1, 2, 3, 4, 0, 1, 2], np.int32),
    page_table=np.array([[1, 2, 0], [3, 4, 0]], np.int32),
    cu_q_lens=np.array([0, 5, 8], np.int32),
    kv_lens=np.array([5, 3], np.int32),
    logit_index=np.array([4, 7], np.int32),
)


def greedy(prefill, decode, params, kv_cache, steps: int):
    """Paged prefill of PREFILL, then `steps` greedy decode steps.

    prefill/decode: jitted forwards (params, kv_cache, *arrays) -> (logits, kv_cache).
    Returns (tokens int32 [steps + 1, 2], logits f32 [steps + 1, 2, V], kv_cache).
    """
    logits, kv_cache = prefill(params, kv_cache, *PREFILL.values())
    all_logits, positions = [logits], PREFILL["kv_lens"]
    tokens = [jnp.argmax(logits, -1).astype(jnp.int32)]
    for _ in range(steps):
        logits, kv_cache = decode(params, kv_cache, tokens[-1], positions,
                                  PREFILL["page_table"])
        all_logits.append(logits)
        tokens.append(jnp.argmax(logits, -1).astype(jnp.int32))
        positions = positions + 1
    return np.stack(tokens), np.stack(all_logits), kv_cache


_COLLECTIVE = re.compile(r"= (.*?) (all-reduce|all-gather|reduce-scatter|all-to-all|"
                         r"collective-permute)(?:-start)?\(")


def collectives(compiled_text: str) -> list[tuple[str, tuple[str, ...]]]:
    """(op, its result types without layouts) of every collective in compiled HLO text; XLA
    combines independent collectives into one with a tuple result."""
    return [(op, tuple(re.findall(r"\w+\[[\d,]*\]", types)))
            for types, op in _COLLECTIVE.findall(compiled_text)]
