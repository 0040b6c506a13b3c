"""Exact attribution: the sampler's recorded log-probs are the trainer's, bit for bit, so the
audit compares bits and catches stale KV after one update at real learning rates.

Detection power on the demo's built-in model (the real model: tests/test_real_model.py,
slow): after ONE `train_step` at lr 1e-6 (TRL's default) or 1e-7 from version 0, an engine
whose cache ignores versions serves version-0 prefix KV to the version-1 rollout; every
sample that reused it is flagged, and an honest engine's samples (over a thousand) never
are. With the old 2e-3 tolerance these updates were invisible.
"""
import dataclasses
import os

import jax
import numpy as np
import optax
import pytest
from hypothesis import given, settings, strategies as st

from jaxrl_cache.app.demo import builtin_model_config
from jaxrl_cache.models import init_params
from jaxrl_cache.rl.audit import AUDIT_TOLERANCE, audit_attribution
from jaxrl_cache.rl.batch import make_batch
from jaxrl_cache.rl.train import AttributionFailure, TrainState, train_step
from jaxrl_cache.rollout.engine import RolloutEngine
from jaxrl_cache.rollout.sampling import SamplingParams
from jaxrl_cache.rollout.types import CacheConfig, SchedulerConfig

CONFIG = builtin_model_config(vocab_size=40)
SYSTEM = [int(t) for t in np.random.default_rng(0).integers(3, 40, 40)]  # shared prefix
PROMPTS = [SYSTEM + [5 + i, 9, 11 + i] for i in range(4)]
SP = SamplingParams(n=4, max_new_tokens=16, temperature=1.0)


class VersionBlindEngine(RolloutEngine):
    """The bug the library exists to prevent: one cache namespace for every version."""

    def _cache_key(self, version):
        return 0


def _engine(cls=RolloutEngine):
    return cls(CONFIG, CacheConfig(num_pages=256, page_size=8))


@pytest.fixture(scope="module")
def params0():
    return init_params(CONFIG, jax.random.key(0))


def _one_update(params, batch, lr: float):
    """Version 1: one real GRPO train_step (AdamW, non-constant rewards) from version 0."""
    state = TrainState.create(params, optax.adamw(1.0, weight_decay=0.0), config=CONFIG,
                              lr_schedule=lr)
    rewards = [float(i % 3 == 0) for i in range(len(batch.samples))]
    new, metrics = train_step(state, make_batch(batch, rewards), audit_tolerance=0.0)
    assert float(metrics["ratio_max"]) == 1.0  # fresh samples: the first ratio is exactly 1
    assert float(metrics["logprob_mismatch_max"]) == float(metrics["logprob_mismatch_kl"]) == 0
    assert int(new.version) == 1
    return new.params


@pytest.mark.parametrize("lr", [1e-6, 1e-7])
def test_one_update_at_a_real_learning_rate_flags_every_stale_sample(params0, lr):
    blind, honest = _engine(VersionBlindEngine), _engine()
    first = blind.rollout(params0, 0, PROMPTS, SP, rng=jax.random.key(1))
    assert audit_attribution(first, {0: params0}, CONFIG).ok
    params1 = _one_update(params0, first, lr)
    changed = sum(int(np.sum(np.asarray(a) != np.asarray(b)))
                  for a, b in zip(jax.tree.leaves(params0), jax.tree.leaves(params1)))
    assert changed > 0  # the update moved bits
    for engine in (blind, honest):
        engine.sync_weights(params1, 1)
    stale = blind.rollout(params1, 1, PROMPTS, SP, rng=jax.random.key(2))
    reused = [i for i, s in enumerate(stale.samples) if s.cached_tokens > 0]
    assert len(reused) == len(stale.samples) == 16  # every sample reused version-0 KV
    report = audit_attribution(stale, {1: params1}, CONFIG)
    assert report.exact and report.tolerance == AUDIT_TOLERANCE == 0.0
    assert report.flagged == tuple(reused), (lr, report.max_abs_diff)
    fresh = honest.rollout(params1, 1, PROMPTS, SP, rng=jax.random.key(2))
    assert audit_attribution(fresh, {1: params1}, CONFIG).ok
    # asynchronous RL: a trainer one update further scores the version-1 tokens itself, on
    # its packed micro-batches (train_step(audit_params=...)): the same stale samples refused
    later = TrainState.create(params1, optax.adamw(1.0), config=CONFIG, lr_schedule=lr,
                              version=2)
    rewards = [float(i % 3 == 0) for i in range(len(stale.samples))]
    with pytest.raises(AttributionFailure, match=r"version\(s\) \[1\]"):
        train_step(later, make_batch(stale, rewards), max_policy_lag=1, audit_tolerance=0.0,
                   audit_params={1: params1})
    _, metrics = train_step(later, make_batch(fresh, rewards), max_policy_lag=1,
                            audit_tolerance=0.0, audit_params={1: params1})
    assert float(metrics["logprob_mismatch_max"]) == 0.0


def test_honest_engine_flags_none_of_a_thousand_samples(params0):
    """1,024 samples over calls that mix prefix hits, group sizes, lengths and temperature,
    top-k / top-p and greedy settings: every recorded bit reproduces."""
    engine = _engine()
    rng = np.random.default_rng(1)
    settings = [SamplingParams(n=8, max_new_tokens=12, temperature=1.0),
                SamplingParams(n=8, max_new_tokens=9, temperature=0.7, top_k=8, top_p=0.9),
                SamplingParams(n=8, max_new_tokens=6, temperature=1.3, top_p=0.8),
                SamplingParams(n=8, max_new_tokens=5, temperature=0.0)]
    total = flagged = 0
    call = 0
    while total < 1024:
        prompts = [SYSTEM[:int(rng.integers(0, 41))] + [int(t) for t in
                                                        rng.integers(3, 40, rng.integers(1, 9))]
                   for _ in range(4)]
        batch = engine.rollout(params0, 0, prompts, settings[call % 4],
                               rng=jax.random.key(call))
        report = audit_attribution(batch, {0: params0}, CONFIG)
        total += report.num_samples
        flagged += len(report.flagged)
        call += 1
    assert total >= 1024 and flagged == 0


# Property: whatever the batch, the schedule or the packing, every recorded log-prob is the
# trainer's bit for bit. Engines are cached per shape knobs (each compiles its own programs).
_ENGINES: dict = {}


def _scheduled_engine(page_size: int, slots: int, chunk: int, prefill: int):
    key = (page_size, slots, chunk, prefill)
    if key not in _ENGINES:
        _ENGINES[key] = RolloutEngine(
            CONFIG, CacheConfig(num_pages=384, page_size=page_size),
            scheduler_config=SchedulerConfig(max_num_seqs=slots, chunk_steps=chunk,
                                             max_prefill_tokens=prefill))
    return _ENGINES[key]


SETTINGS = [SamplingParams(n=1, max_new_tokens=8, temperature=1.0),
            SamplingParams(n=1, max_new_tokens=8, temperature=0.8, top_k=6, top_p=0.9),
            SamplingParams(n=1, max_new_tokens=8, temperature=1.2, top_p=0.7),
            SamplingParams(n=1, max_new_tokens=8, temperature=0.7),
            SamplingParams(n=1, max_new_tokens=8, temperature=0.0)]


@pytest.mark.parametrize("temperature", [0.6, 0.7, 0.9, 1.3])
def test_any_temperature_reproduces_bit_for_bit(params0, temperature):
    """A temperature that is not a power of two, without top-k / top-p: logits / t must be
    one IEEE division in the sampler and in the trainer (XLA turned it into a product that
    one program fused into an FMA with the log-softmax: 1-2 ulp apart at t = 0.7)."""
    sampling = dataclasses.replace(SP, temperature=temperature)
    batch = _engine().rollout(params0, 0, PROMPTS, sampling, rng=jax.random.key(3))
    report = audit_attribution(batch, {0: params0}, CONFIG)
    assert report.ok and report.max_abs_diff == 0.0, report
    state = TrainState.create(params0, optax.sgd(1.0), config=CONFIG, lr_schedule=1e-3)
    rewards = [float(i % 2) for i in range(len(batch.samples))]
    _, metrics = train_step(state, make_batch(batch, rewards), audit_tolerance=0.0)
    assert float(metrics["logprob_mismatch_max"]) == 0.0


# examples drawn (test_invariant_kernels' interpret-mode run draws fewer under `make test`)
EXAMPLES = int(os.environ.get("JAXRL_EXACTNESS_EXAMPLES", "6"))


@settings(max_examples=EXAMPLES, deadline=None, derandomize=True)
@given(page_size=st.sampled_from([4, 8, 16]), slots=st.sampled_from([3, 16]),
       chunk=st.sampled_from([1, 5, 16]), prefill=st.sampled_from([12, 2048]),
       n=st.integers(1, 4), setting=st.integers(0, len(SETTINGS) - 1),
       prefixes=st.lists(st.integers(0, 40), min_size=1, max_size=5),
       repeat=st.booleans(), budget=st.sampled_from([64, 256, 4096]),
       mini_batches=st.integers(1, 2), seed=st.integers(0, 2**16))
def test_every_token_reproduces_bit_for_bit(params0, page_size, slots, chunk, prefill, n,
                                            setting, prefixes, repeat, budget, mini_batches,
                                            seed):
    """Batch composition (prompts sharing a drawn part of one system prompt, group size),
    decode slots (admission rounds when the batch exceeds them), decode chunk, page size,
    prefill budget, prefix hits (a repeated call), micro-batch token budget and mini-batches:
    the audit (dense, one row per sample) and the train step (packed micro-batches) both
    reproduce every recorded log-prob exactly."""
    rng = np.random.default_rng(seed)
    engine = _scheduled_engine(page_size, slots, chunk, prefill)
    prompts = [SYSTEM[:p] + [int(t) for t in rng.integers(3, 40, rng.integers(1, 6))]
               for p in prefixes]
    sampling = dataclasses.replace(SETTINGS[setting], n=n)
    batches = [engine.rollout(params0, 0, prompts, sampling, rng=jax.random.key(seed + k))
               for k in range(1 + repeat)]
    for batch in batches:
        report = audit_attribution(batch, {0: params0}, CONFIG)
        assert report.ok and report.max_abs_diff == 0.0, report
    state = TrainState.create(params0, optax.sgd(1.0), config=CONFIG, lr_schedule=1e-3)
    samples = len(batches[-1].samples)
    _, metrics = train_step(state, make_batch(batches[-1], [float(i % 2) for i in
                                                            range(samples)]),
                            token_budget=budget, mini_batches=min(mini_batches, samples),
                            audit_tolerance=0.0)
    assert float(metrics["logprob_mismatch_max"]) == 0.0
    assert int(metrics["audit_checked_tokens"]) > 0


# Gemma's math on the demo's shapes: GeGLU, norms by 1 + w, embeddings x sqrt(d_model)
GEMMA = dataclasses.replace(CONFIG, family="gemma", embed_scale=True, norm_plus_one=True,
                            mlp_act="gelu_tanh", out_bias=True)


@pytest.mark.parametrize("family", ["llama", "gemma"])
def test_a_tied_lm_head_reproduces_bit_for_bit(family):
    """The demo's model has its own LM head; Hugging Face models such as SmolLM2 tie it (the
    dot over the embedding [V, d], contracted on its last axis). The same paths on a tied
    head: decode, packed prefill in small budgets, a cached prefix (the repeated call),
    micro-batches and mini-batches; audit and train step both reproduce every token. Gemma:
    its family's math (norm weights drawn away from 0) through the same paths."""
    config = dataclasses.replace(GEMMA if family == "gemma" else CONFIG, tie_embeddings=True)
    params = init_params(config, jax.random.key(3))
    assert "lm_head" not in params
    if family == "gemma":
        norms = ("attn_norm", "mlp_norm")
        drawn = jax.random.normal(jax.random.key(4), (len(norms),
                                                      *params["layers"]["attn_norm"].shape))
        params = {**params, "final_norm": params["final_norm"] + 0.3, "layers": {
            **params["layers"], **{n: 0.3 * d for n, d in zip(norms, drawn)}}}
    engine = RolloutEngine(config, CacheConfig(num_pages=256, page_size=4),
                           scheduler_config=SchedulerConfig(max_num_seqs=3, chunk_steps=5,
                                                            max_prefill_tokens=12))
    prompts = [SYSTEM[:p] + [7 + i, 9] for i, p in enumerate((3, 17, 40))]
    batches = [engine.rollout(params, 0, prompts, SETTINGS[1 + k], rng=jax.random.key(k))
               for k in range(2)]
    assert batches[1].cached_tokens > 0
    for batch in batches:
        report = audit_attribution(batch, {0: params}, config)
        assert report.ok and report.max_abs_diff == 0.0, report
    state = TrainState.create(params, optax.sgd(1.0), config=config, lr_schedule=1e-3)
    samples = len(batches[1].samples)
    _, metrics = train_step(state, make_batch(batches[1], [float(i % 2) for i in
                                                           range(samples)]),
                            token_budget=64, mini_batches=2, audit_tolerance=0.0)
    assert float(metrics["logprob_mismatch_max"]) == 0.0
    assert int(metrics["audit_checked_tokens"]) > 0


def test_decode_chunks_read_only_the_key_blocks_they_reach(params0, monkeypatch):
    """A long generation's early decode chunks get a page table cut to the key blocks their
    rows reach (`runner.reach_width`), later ones the whole width: every recorded log-prob
    still has the trainer's bits."""
    from jaxrl_cache.rollout import runner
    widths = []
    pack = runner.pack_decode
    monkeypatch.setattr(runner, "pack_decode",
                        lambda slots, width, shared=0: widths.append(width) or pack(
                            slots, width, shared))
    engine = RolloutEngine(CONFIG, CacheConfig(num_pages=256, page_size=4),
                           scheduler_config=SchedulerConfig(max_num_seqs=8, chunk_steps=8))
    sampling = SamplingParams(n=2, max_new_tokens=100, temperature=1.0)
    batch = engine.rollout(params0, 0, [SYSTEM[:21], SYSTEM[3:30]], sampling,
                           rng=jax.random.key(11))
    assert max(len(s.output_ids) for s in batch.samples) == 100
    # 16 pages of 4 per key block, a table of 32 pages (126 positions): the first chunks
    # read one key block, the later ones the whole table; the 27-token prompt's rows cross
    # position 64 inside a chunk (58..65), so a width cut to where a chunk starts breaks bits
    assert widths[0] == 16 and widths[-1] == 32 and widths == sorted(widths), widths
    report = audit_attribution(batch, {0: params0}, CONFIG)
    assert report.ok and report.max_abs_diff == 0.0, report


@pytest.mark.parametrize("remat", ["full", "dots", "none"])
def test_every_remat_policy_reproduces_the_sampler(params0, remat):
    """The remat policy ("auto" picks "dots" when it fits) changes what the backward
    keeps, never the forward's bits: engine samples (a computed and a cached prefix), split
    over several micro-batches, pass the tolerance-0 gate with mismatch exactly 0."""
    engine = _engine()
    calls = [engine.rollout(params0, 0, PROMPTS, SP, rng=jax.random.key(k)) for k in (5, 6)]
    assert calls[1].cached_tokens > 0
    batch = dataclasses.replace(calls[0], samples=calls[0].samples + calls[1].samples)
    state = TrainState.create(params0, optax.sgd(1e-3), config=CONFIG)
    rewards = [float(i % 3 == 0) for i in range(len(batch.samples))]
    _, metrics = train_step(state, make_batch(batch, rewards), audit_tolerance=0.0,
                            remat=remat, token_budget=256)
    assert int(metrics["audit_checked_tokens"]) == sum(len(s.output_ids) for s in batch.samples)
    assert float(metrics["logprob_mismatch_max"]) == 0.0
    assert float(metrics["ratio_max"]) == 1.0


PENALISED = [SamplingParams(n=3, max_new_tokens=14, temperature=0.7, min_p=0.1),
             SamplingParams(n=3, max_new_tokens=14, temperature=1.0, repetition_penalty=1.3),
             SamplingParams(n=3, max_new_tokens=14, temperature=0.9, top_k=8, top_p=0.9,
                            min_p=0.05, repetition_penalty=0.8),
             SamplingParams(n=2, max_new_tokens=14, temperature=0.0, repetition_penalty=1.5)]


@pytest.mark.parametrize("sampling", PENALISED, ids=["min_p", "penalty", "all", "greedy"])
def test_min_p_and_repetition_penalty_reproduce_bit_for_bit(params0, sampling):
    """min-p and the repetition penalty are part of the distribution both sides compute: the
    sampler's presence carried through decode chunks of 5 steps (admission rounds of 3
    slots, a repeated call served from the prefix cache) and the trainer's, built per
    position from packed rows with shared prefixes (small budgets, two mini-batches), give
    the recorded log-probs bit for bit, in the audit and in the train step."""
    engine = _scheduled_engine(8, 3, 5, 2048)
    prompts = [SYSTEM[:p] + [7 + i, 9, 7 + i] for i, p in enumerate((3, 17, 40))]
    batches = [engine.rollout(params0, 0, prompts, sampling, rng=jax.random.key(k))
               for k in range(2)]
    assert batches[1].cached_tokens > 0
    for batch in batches:
        report = audit_attribution(batch, {0: params0}, CONFIG)
        assert report.ok and report.max_abs_diff == 0.0, report
    both = dataclasses.replace(batches[0], samples=batches[0].samples + batches[1].samples)
    state = TrainState.create(params0, optax.sgd(1.0), config=CONFIG, lr_schedule=1e-3)
    rewards = [float(i % 2) for i in range(len(both.samples))]
    _, metrics = train_step(state, make_batch(both, rewards), token_budget=128,
                            mini_batches=2, audit_tolerance=0.0)
    assert float(metrics["logprob_mismatch_max"]) == 0.0
    assert int(metrics["audit_checked_tokens"]) > 0


def test_the_penalty_changes_the_distribution(params0):
    """The same keys with and without the penalty: the recorded log-probs differ (the
    knob reaches the sampler), and a penalised sample repeats its context's tokens less."""
    engine = _engine()
    plain, penalised = (engine.rollout(params0, 0, PROMPTS, dataclasses.replace(
        SP, repetition_penalty=r), rng=jax.random.key(7)) for r in (1.0, 3.0))
    repeats = lambda b: np.mean([np.isin(s.output_ids, s.prompt_ids).mean()  # noqa: E731
                                 for s in b.samples])
    assert repeats(penalised) < repeats(plain)
