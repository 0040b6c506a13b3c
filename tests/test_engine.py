"""RolloutEngine: dense-equivalence, version-keyed prefix reuse, failures, compilation."""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from jaxrl_cache.models.dense import Transposed, transpose_pays
from jaxrl_cache.models.llama import PROJECTIONS
from jaxrl_cache.rollout import core as rollout_core
from jaxrl_cache.rollout import CacheConfig, RolloutEngine, SchedulerConfig
from jaxrl_cache.errors import CacheFullError, VersionError
from jaxrl_cache.rl.audit import audit_attribution
from jaxrl_cache.distribution import behavior_log_probs
from jaxrl_cache.rollout.sampling import SamplingParams
from tests.helpers import CONFIG, dense_greedy, dense_logits, varied_params

PS = 8
PROMPTS = [list(range(1, 20)), list(range(5, 13)), [7, 3, 9]]  # ragged, exact page, short
GREEDY = SamplingParams(n=2, max_new_tokens=7, temperature=0.0)


def make_engine(num_pages=96, **kw):
    return RolloutEngine(CONFIG, CacheConfig(num_pages=num_pages, page_size=PS), **kw)


def balanced(engine):
    s = engine.cache_stats()
    engine.cache.check_invariants()
    return s.free_pages + s.cached_pages + s.in_use_pages == s.total_pages and s.in_use_pages == 0


def test_greedy_matches_dense_and_reuses_prefix_within_version():
    params = varied_params(0)
    engine = make_engine()
    first = engine.rollout(params, 0, PROMPTS, GREEDY, rng=jax.random.key(0))
    assert [s.cached_tokens for s in first.samples] == [0] * 6
    for s in first.samples:
        want, want_logp = dense_greedy(params, CONFIG, s.prompt_ids, 7)
        assert list(s.output_ids) == want
        np.testing.assert_allclose(s.output_logprobs, want_logp, atol=1e-4)
        assert s.behavior_version == 0 and (s.token_versions == 0).all()
    # the group's prompt is prefilled once: computed tokens = sum of prompt lengths
    assert first.prefill_tokens == sum(map(len, PROMPTS))
    second = engine.rollout(params, 0, PROMPTS, GREEDY, rng=jax.random.key(1))
    assert second.samples[0].cached_tokens == 16 and second.samples[2].cached_tokens == 0
    assert second.cached_tokens > 0
    assert [s.output_ids for s in second.samples] == [s.output_ids for s in first.samples]
    np.testing.assert_allclose(second.samples[0].output_logprobs,
                               first.samples[0].output_logprobs, atol=1e-5)
    assert balanced(engine)


def test_version_bump_reuses_nothing_and_follows_new_params():
    old, new = varied_params(0), varied_params(1)
    engine = make_engine()
    engine.rollout(old, 0, PROMPTS, GREEDY, rng=jax.random.key(0))
    assert engine.cache_stats().cached_pages_by_version[0] > 0
    cached = engine.cache_stats().cached_pages_by_version[0]
    batch = engine.rollout(new, 1, PROMPTS, GREEDY, rng=jax.random.key(0))
    assert batch.sync_ack.version == 1 and batch.sync_ack.invalidated_pages == cached
    assert engine.cache.versions() == [1]
    for s in batch.samples:
        assert s.cached_tokens == 0 and s.behavior_version == 1
        assert list(s.output_ids) == dense_greedy(new, CONFIG, s.prompt_ids, 7)[0]
    assert balanced(engine)


def test_sampled_logprobs_are_the_behavior_distribution():
    params = varied_params(2)
    engine = make_engine()
    sp = SamplingParams(n=4, max_new_tokens=5, temperature=0.8, top_k=10, top_p=0.95)
    batch = engine.rollout(params, 0, PROMPTS[:2], sp, rng=jax.random.key(3))
    assert len({s.output_ids for s in batch.samples[:4]}) > 1  # the group really samples
    for s in batch.samples:
        logits = dense_logits(params, CONFIG, s.prompt_ids + s.output_ids)[
            len(s.prompt_ids) - 1:-1]
        logp = behavior_log_probs(logits, **sp.as_arrays())
        want = np.asarray(logp[jnp.arange(len(s.output_ids)), jnp.asarray(s.output_ids)])
        np.testing.assert_allclose(s.output_logprobs, want, atol=1e-4)


def test_stop_tokens_end_rows_early():
    params = varied_params(0)
    engine = make_engine()
    want, _ = dense_greedy(params, CONFIG, PROMPTS[0], 7)
    stop = want[2]
    sp = SamplingParams(n=1, max_new_tokens=7, temperature=0.0, stop_token_ids=(stop,))
    s = engine.rollout(params, 0, PROMPTS[:1], sp, rng=jax.random.key(0)).samples[0]
    assert s.finish_reason == "stop" and list(s.output_ids) == want[:want.index(stop) + 1]


def test_single_new_token_on_exact_page_prompt():
    """An exact-page prompt with max_new_tokens=1 needs no page beyond the prompt's."""
    params = varied_params(0)
    engine = make_engine()
    sp = SamplingParams(n=3, max_new_tokens=1, temperature=0.0)
    batch = engine.rollout(params, 0, [list(range(5, 21))], sp, rng=jax.random.key(0))
    want = dense_greedy(params, CONFIG, list(range(5, 21)), 1)[0]
    assert [list(s.output_ids) for s in batch.samples] == [want] * 3
    assert balanced(engine)


def test_prefix_cache_off_computes_every_prompt():
    params = varied_params(0)
    engine = RolloutEngine(CONFIG, CacheConfig(num_pages=96, page_size=PS, prefix_cache=False))
    b = engine.rollout(params, 0, PROMPTS, GREEDY, rng=jax.random.key(0))
    assert b.prefill_tokens == 2 * sum(map(len, PROMPTS)) and b.reused_tokens == 0
    assert [s.group for s in b.samples] == [0, 0, 1, 1, 2, 2]
    assert [list(s.output_ids) for s in b.samples[::2]] == [
        dense_greedy(params, CONFIG, p, 7)[0] for p in PROMPTS]


@pytest.mark.parametrize("prefix_cache", [True, False])
def test_prompts_over_the_prefill_budget_all_decode_from_the_first_chunk(prefix_cache):
    """A prefill budget smaller than the prompts: several packed prefills run before the
    first decode chunk (no tail of rows decoding alone in extra chunks), and each row starts
    from its own prefill's logits (greedy output equal to the dense model)."""
    params = varied_params(0)
    sched = SchedulerConfig(max_num_seqs=8, chunk_steps=4, max_prefill_tokens=10)
    engine = RolloutEngine(CONFIG, CacheConfig(num_pages=96, page_size=PS,
                                               prefix_cache=prefix_cache),
                           scheduler_config=sched)
    b = engine.rollout(params, 0, PROMPTS, GREEDY, rng=jax.random.key(0))
    assert b.prefill_launches >= 3
    assert b.decode_chunks == 2  # 7 new tokens in chunks of 4: every row in both chunks
    for s in b.samples:
        want, want_logp = dense_greedy(params, CONFIG, s.prompt_ids, 7)
        assert list(s.output_ids) == want
        np.testing.assert_allclose(s.output_logprobs, want_logp, atol=1e-4)
    assert balanced(engine)


class TestVersionRules:
    def test_older_version_raises_and_changes_nothing(self):
        engine = make_engine()
        p0, p1 = varied_params(0), varied_params(1)
        engine.rollout(p1, 3, PROMPTS, GREEDY, rng=jax.random.key(0))
        before = engine.cache_stats()
        with pytest.raises(VersionError, match="older"):
            engine.sync_weights(p0, 2)
        with pytest.raises(VersionError, match="versions only move forward"):
            engine.rollout(p0, 2, PROMPTS, GREEDY, rng=jax.random.key(0))
        assert engine.version == 3 and engine.cache_stats() == before

    @pytest.mark.parametrize("bad", [True, 1.0, "1", None, np.float32(2)])
    def test_non_integer_versions_are_type_errors(self, bad):
        with pytest.raises(TypeError, match="integer"):
            make_engine().sync_weights(varied_params(0), bad)

    def test_negative_version(self):
        with pytest.raises(VersionError, match=">= 0"):
            make_engine().sync_weights(varied_params(0), -1)

    def test_same_version_different_params_is_refused(self):
        engine = make_engine()
        engine.sync_weights(varied_params(0), 0)
        with pytest.raises(VersionError, match="differ"):
            engine.rollout(varied_params(1), 0, PROMPTS, GREEDY, rng=jax.random.key(0))

    def test_integer_arrays_are_versions(self):
        engine = make_engine()
        ack = engine.sync_weights(varied_params(0), jnp.int32(4))
        assert ack.version == 4 and engine.version == 4


class TestBadRequests:
    @pytest.mark.parametrize("prompts,match", [
        ([[]], "empty"), ([[1, 2, 999]], "outside"), ([[1] * 95], "max_seq_len"),
        ([], "non-empty")])
    def test_rejected_before_work(self, prompts, match):
        engine = make_engine()
        with pytest.raises(ValueError, match=match):
            engine.rollout(varied_params(0), 0, prompts, GREEDY, rng=jax.random.key(0))
        assert balanced(engine)

    @pytest.mark.parametrize("prompts", [[1, 2, 3], [[1, 2.5]], [["a"]]])
    def test_malformed_prompts_are_type_errors(self, prompts):
        engine = make_engine()
        with pytest.raises(TypeError, match="integer token ids"):
            engine.rollout(varied_params(0), 0, prompts, GREEDY, rng=jax.random.key(0))
        assert balanced(engine)

    def test_small_pool_queues_instead_of_refusing(self):
        """6 pages hold one sample at a time: the scheduler runs them in turn."""
        engine = make_engine(num_pages=6)
        params = varied_params(0)
        batch = engine.rollout(params, 0, PROMPTS, GREEDY, rng=jax.random.key(0))
        assert [list(s.output_ids) for s in batch.samples] == [
            dense_greedy(params, CONFIG, p, 7)[0] for p in PROMPTS for _ in range(2)]
        assert balanced(engine)

    def test_a_sample_that_can_never_fit_is_refused_before_work(self):
        engine = make_engine(num_pages=3)  # 2 usable pages of 8 tokens
        params = varied_params(0)
        with pytest.raises(CacheFullError, match="KV pages"):
            engine.rollout(params, 0, PROMPTS, GREEDY, rng=jax.random.key(0))
        assert balanced(engine) and engine.cache_stats().lookups == 0
        small = SamplingParams(n=1, max_new_tokens=2, temperature=0.0)
        assert engine.rollout(params, 0, [[1, 2, 3]], small, rng=jax.random.key(0)).samples


@pytest.mark.parametrize("after_donation", [False, True])
def test_exception_mid_rollout_releases_everything(monkeypatch, after_donation):
    params = varied_params(0)
    engine = make_engine()
    engine.rollout(params, 0, PROMPTS, GREEDY, rng=jax.random.key(0))
    real = rollout_core.decode_chunk

    def broken(*args, **kwargs):
        if after_donation:
            jax.block_until_ready(real(*args, **kwargs))  # consumes the donated pool
        raise RuntimeError("injected failure")

    monkeypatch.setattr(rollout_core, "decode_chunk", broken)
    with pytest.raises(RuntimeError, match="injected"):
        engine.rollout(params, 0, PROMPTS, GREEDY, rng=jax.random.key(0))
    assert balanced(engine)
    assert not engine._lock.locked()
    monkeypatch.setattr(rollout_core, "decode_chunk", real)
    batch = engine.rollout(params, 0, PROMPTS, GREEDY, rng=jax.random.key(0))
    assert [list(s.output_ids) for s in batch.samples[::2]] == [
        dense_greedy(params, CONFIG, p, 7)[0] for p in PROMPTS]
    assert balanced(engine)


def test_new_versions_and_params_never_recompile():
    engine = make_engine()
    prompts = [list(range(1, 12)), list(range(2, 11))]
    engine.rollout(varied_params(0), 0, prompts, SamplingParams(n=2, max_new_tokens=4),
                   rng=jax.random.key(0))
    sizes = (rollout_core.prefill_step._cache_size(), rollout_core.decode_chunk._cache_size())
    for v in range(1, 4):  # new params, new version, new sampling knobs: same shapes
        sp = SamplingParams(n=2, max_new_tokens=4, temperature=0.5 + 0.1 * v, top_k=v)
        engine.rollout(varied_params(v), v, prompts, sp, rng=jax.random.key(v))
    assert (rollout_core.prefill_step._cache_size(),
            rollout_core.decode_chunk._cache_size()) == sizes


def test_a_smaller_prefill_runs_in_a_compiled_shape_once_then_in_its_own(monkeypatch):
    """A round that prefills fewer tokens / sequences than one before (radix hits, another
    admission split) runs in the compiled larger shape (up to 4x its tokens) the first time:
    nothing compiles. When the same smaller bucket comes again it compiles its own shape
    (steady use pays no padding), and from then on runs in it. Every call's samples carry
    the same bits as on an engine that never saw the larger prefill."""
    sp = SamplingParams(n=2, max_new_tokens=5, temperature=1.0)
    big = [list(range(1 + i, 14 + i)) for i in range(4)]  # 4 sequences, 52 new tokens
    small = [[9, 4, 7, 2, 5, 11, 3, 8, 6, 10, 12, 13, 1]]  # 1 sequence of 13: another
    #   (tokens, seqs) bucket at the same page-table width
    shapes, real_prefill = [], rollout_core.prefill_step

    def prefill_spy(params, kv, tokens, token_seq, token_pos, table, *rest, **kw):
        shapes.append((tokens.shape[0], table.shape[0]))
        return real_prefill(params, kv, tokens, token_seq, token_pos, table, *rest, **kw)

    monkeypatch.setattr(rollout_core, "prefill_step", prefill_spy)
    engine, params = make_engine(), varied_params(0)
    engine.rollout(params, 0, big, sp, rng=jax.random.key(0))
    size = real_prefill._cache_size()
    got = [engine.rollout(params, v, small, sp, rng=jax.random.key(v)) for v in (1, 2, 3)]
    assert shapes == [(64, 4), (64, 4), (16, 1), (16, 1)]
    assert real_prefill._cache_size() == size + 1  # the recurring bucket, once
    for v, batch in zip((1, 2, 3), got):
        fresh = make_engine().rollout(params, v, small, sp, rng=jax.random.key(v))
        for a, b in zip(batch.samples, fresh.samples):
            assert a.output_ids == b.output_ids
            np.testing.assert_array_equal(a.output_logprobs, b.output_logprobs)


class TestScheduler:
    SP = SamplingParams(n=3, max_new_tokens=6, temperature=1.0, stop_token_ids=(5,))

    def test_queued_workload_equals_a_roomy_engine(self):
        """3 slots, a pool for ~2 rows and 2-step chunks run 12 samples with the same
        tokens and logprobs as an engine that holds them all at once (per-sample streams)."""
        params = varied_params(3)
        prompts = PROMPTS + [list(range(30, 47))]
        probe = make_engine().rollout(params, 0, prompts, dataclasses.replace(
            self.SP, stop_token_ids=()), rng=jax.random.key(7))
        # a stop token some samples emit early: rows of mixed lengths
        tokens = [t for s in probe.samples for t in s.output_ids[1:4]]
        sp = dataclasses.replace(self.SP, stop_token_ids=(max(set(tokens), key=tokens.count),))
        roomy = make_engine().rollout(params, 0, prompts, sp, rng=jax.random.key(7))
        tight = RolloutEngine(CONFIG, CacheConfig(num_pages=8, page_size=PS),
                              scheduler_config=SchedulerConfig(max_num_seqs=3, chunk_steps=2))
        batch = tight.rollout(params, 0, prompts, sp, rng=jax.random.key(7))
        assert batch.decode_chunks > 4 and batch.prefill_launches > 2
        assert [(s.group, s.prompt_ids) for s in batch.samples] == [
            (g, tuple(p)) for g, p in enumerate(prompts) for _ in range(3)]
        assert [s.output_ids for s in batch.samples] == [s.output_ids for s in roomy.samples]
        for a, b in zip(batch.samples, roomy.samples):
            np.testing.assert_allclose(a.output_logprobs, b.output_logprobs, atol=1e-5)
            assert a.finish_reason == b.finish_reason
        assert {s.finish_reason for s in batch.samples} == {"stop", "length"}
        assert balanced(tight)

    def test_same_inputs_same_samples(self):
        params = varied_params(3)
        a = make_engine().rollout(params, 0, PROMPTS, self.SP, rng=jax.random.key(1))
        b = make_engine().rollout(params, 0, PROMPTS, self.SP, rng=jax.random.key(1))
        c = make_engine().rollout(params, 0, PROMPTS, self.SP, rng=jax.random.key(2))
        assert [s.output_ids for s in a.samples] == [s.output_ids for s in b.samples]
        assert [s.output_ids for s in a.samples] != [s.output_ids for s in c.samples]

    def test_shared_system_prefix_is_computed_once_and_every_branch_cached(self):
        params = varied_params(0)
        system = list(range(1, 21))  # 2.5 pages
        prompts = [system + [30 + g] * 12 for g in range(4)]  # 32 tokens = 4 pages each
        engine = make_engine()
        first = engine.rollout(params, 0, prompts, GREEDY, rng=jax.random.key(0))
        # prompt 0 computes 32; the others reuse its 2 full system pages: 32 - 16 each
        assert first.prefill_tokens == 32 + 3 * 16
        assert [s.cached_tokens for s in first.samples] == [0, 0] + [16] * 6
        for s in first.samples:
            assert list(s.output_ids) == dense_greedy(params, CONFIG, s.prompt_ids, 7)[0]
        again = engine.rollout(params, 0, prompts, GREEDY, rng=jax.random.key(0))
        assert [s.cached_tokens for s in again.samples] == [24] * 8  # every prompt's branch
        assert again.prefill_tokens == 4 * 8
        assert balanced(engine)


def test_new_min_p_and_penalty_values_never_recompile():
    """min_p and repetition_penalty are traced: once a penalised decode is compiled, other
    values (min_p 0 included) compile nothing (only penalty 1 vs not is static)."""
    engine = make_engine()
    prompts = [list(range(1, 12)), list(range(2, 11))]
    sp = SamplingParams(n=2, max_new_tokens=4, repetition_penalty=1.2, min_p=0.1)
    engine.rollout(varied_params(0), 0, prompts, sp, rng=jax.random.key(0))
    sizes = (rollout_core.prefill_step._cache_size(), rollout_core.decode_chunk._cache_size())
    for v, (penalty, min_p) in enumerate(((1.5, 0.0), (0.7, 0.3)), 1):
        sp = SamplingParams(n=2, max_new_tokens=4, repetition_penalty=penalty, min_p=min_p)
        engine.rollout(varied_params(v), v, prompts, sp, rng=jax.random.key(v))
    assert (rollout_core.prefill_step._cache_size(),
            rollout_core.decode_chunk._cache_size()) == sizes


def test_compiles_once_per_shape_bucket(monkeypatch):
    """Prompt lengths, partial pages, group sizes, prompt counts, max_new_tokens, params,
    versions and sampling knobs vary. Expected compiles: decode once per (table width, shared
    pages) bucket,
    prefill once per (packed tokens, sequences, width) bucket; the second pass, with new
    params, versions, knobs and prompt contents, compiles nothing."""
    engine = make_engine(num_pages=160)
    prefill_shapes, decode_widths = set(), set()
    real_prefill, real_decode = rollout_core.prefill_step, rollout_core.decode_chunk

    def prefill_spy(params, kv, tokens, token_seq, token_pos, table, *rest, **kw):
        prefill_shapes.add((tokens.shape, table.shape))
        return real_prefill(params, kv, tokens, token_seq, token_pos, table, *rest, **kw)

    def decode_spy(*args, **kw):
        decode_widths.add((args[6].shape, args[7].shape))  # page_table, shared_pages
        return real_decode(*args, **kw)

    monkeypatch.setattr(rollout_core, "prefill_step", prefill_spy)
    monkeypatch.setattr(rollout_core, "decode_chunk", decode_spy)
    sizes = real_prefill._cache_size(), real_decode._cache_size()
    calls = [([list(range(1, 12)), list(range(2, 11))], 2, 4),
             ([list(range(1, 17))], 3, 6),  # exact page
             ([list(range(3, 10)), list(range(4, 12)), [5, 6, 7]], 1, 5),
             ([list(range(1, 14))] * 2, 4, 3)]

    def run(first_version, offset):
        for v, (prompts, n, max_new) in enumerate(calls, first_version):
            sp = SamplingParams(n=n, max_new_tokens=max_new, temperature=0.5 + 0.1 * v,
                                top_k=v % 4, top_p=0.9 if v % 2 else 1.0)
            prompts = [[(t + offset) % CONFIG.vocab_size for t in p] for p in prompts]
            engine.rollout(varied_params(v % 3), v, prompts, sp, rng=jax.random.key(v))

    run(0, 0)
    compiled = real_prefill._cache_size() - sizes[0], real_decode._cache_size() - sizes[1]
    assert compiled == (len(prefill_shapes), len(decode_widths))
    run(len(calls), 7)
    assert (real_prefill._cache_size() - sizes[0],
            real_decode._cache_size() - sizes[1]) == compiled


def test_a_new_version_without_prefix_hits_reuses_the_first_prefill_shape():
    """The first call of a version whose prompts hit the cache (the demo's eval before step
    0 cached the chat template's system prompt) compiles its prefill for the prompts whole,
    so the next version's call (no hits: its KV is new) compiles no prefill (the 8 x 8 x 128
    CLI run compiled one at its second step); its samples are a fresh engine's."""
    params, sp = varied_params(1), SamplingParams(n=2, max_new_tokens=4, temperature=1.0)
    system = list(range(1, PS + 1))  # one page; tails of 60 tokens in all: with the
    prompts = [system + [30 + i] * n for i, n in enumerate((14, 15, 15, 16))]  # system
    # cached a call computes under 64 tokens, without it 68 (another power of two)
    engine = make_engine()
    engine.rollout(params, 0, prompts[:1], sp, rng=jax.random.key(0))  # caches the system
    hit = engine.rollout(params, 0, prompts, sp, rng=jax.random.key(1))
    size = rollout_core.prefill_step._cache_size()
    miss = engine.rollout(params, 1, prompts, sp, rng=jax.random.key(2))
    assert hit.prefill_tokens <= 64 < miss.prefill_tokens
    assert rollout_core.prefill_step._cache_size() == size
    alone = make_engine().rollout(params, 1, prompts, sp, rng=jax.random.key(2))
    for a, b in zip(miss.samples, alone.samples):
        assert a.output_ids == b.output_ids
        np.testing.assert_array_equal(a.output_logprobs, b.output_logprobs)


def test_a_prefix_shared_within_the_round_does_not_widen_the_prefill(monkeypatch):
    """Prompts sharing a system prompt within one call (a new version each call, as in
    GRPO: nothing in the trie) prefill it once, and the packed prefill is compiled for the
    tokens computed, not for every prompt whole (that padded 256 chat tokens to 512 on
    every call)."""
    system = list(range(1, 2 * PS + 1))  # two pages, computed once by the first unit
    prompts = [system + [40 + i] * 3 for i in range(4)]  # 19 + 3 x 3 = 28 computed, 76 whole
    shapes, real_prefill = [], rollout_core.prefill_step

    def prefill_spy(params, kv, tokens, *rest, **kw):
        shapes.append(tokens.shape[0])
        return real_prefill(params, kv, tokens, *rest, **kw)

    monkeypatch.setattr(rollout_core, "prefill_step", prefill_spy)
    engine, params = make_engine(), varied_params(2)
    sp = SamplingParams(n=2, max_new_tokens=3, temperature=1.0)
    got = [engine.rollout(params, v, prompts, sp, rng=jax.random.key(v)) for v in (0, 1)]
    assert [b.prefill_tokens for b in got] == [28, 28]
    assert shapes == [32, 32]


def test_prompts_sharing_more_pages_reuse_the_compiled_shared_width():
    """A call whose prompts share more leading pages than an earlier call's sends the shared
    page count compiled before (the rest stay in each row's table): no new decode program,
    and the same samples as an engine that never saw the first call."""
    params, sp = varied_params(1), SamplingParams(n=2, max_new_tokens=5, temperature=1.0)
    few = [list(range(1, 2 * PS + 1)) + [40] * 19, list(range(1, 2 * PS + 1)) + [41] * 19]
    more = [list(range(1, 4 * PS + 1)) + [42] * 3, list(range(1, 4 * PS + 1)) + [43] * 3]
    assert len(few[0]) == len(more[0])  # one table width: only the shared count differs
    engine = make_engine()
    engine.rollout(params, 0, few, sp, rng=jax.random.key(0))
    size = rollout_core.decode_chunk._cache_size()
    batch = engine.rollout(params, 0, more, sp, rng=jax.random.key(1))
    assert rollout_core.decode_chunk._cache_size() == size
    alone = make_engine().rollout(params, 0, more, sp, rng=jax.random.key(1))
    assert [s.output_ids for s in batch.samples] == [s.output_ids for s in alone.samples]
    for a, b in zip(batch.samples, alone.samples):
        np.testing.assert_array_equal(a.output_logprobs, b.output_logprobs)


def test_resident_params_are_copies_of_the_callers_arrays():
    """numpy leaves mutated and jax leaves deleted after the sync change nothing the engine
    computes; the mutated arrays themselves are other params at that version (numpy is
    fingerprinted again, never taken as unchanged by identity): refused."""
    params = varied_params(0)
    want = [dense_greedy(params, CONFIG, p, 7)[0] for p in PROMPTS]
    mine = jax.tree.map(lambda x: np.array(x), params)  # numpy: device_put may alias these
    engine = make_engine()
    engine.sync_weights(mine, 0)
    for leaf in jax.tree.leaves(mine):
        leaf[...] = 0.0
    with pytest.raises(VersionError, match="already synced with different params"):
        engine.rollout(mine, 0, PROMPTS, GREEDY, rng=jax.random.key(0))
    batch = engine.rollout(params, 0, PROMPTS, GREEDY, rng=jax.random.key(0))
    assert [list(s.output_ids) for s in batch.samples[::2]] == want
    other = jax.tree.map(jnp.array, varied_params(1))
    engine.sync_weights(other, 1)
    for leaf in jax.tree.leaves(other):
        leaf.delete()  # e.g. donated to the next train step
    batch = engine.rollout(other, 1, PROMPTS, GREEDY, rng=jax.random.key(0))
    assert [list(s.output_ids) for s in batch.samples[::2]] == [
        dense_greedy(varied_params(1), CONFIG, p, 7)[0] for p in PROMPTS]


def test_released_weights_come_back_at_the_next_call():
    """release_weights frees the resident copy (the synchronous loop's train phase); version
    and prefix cache stay, and the next rollout at that version re-copies the params, hits
    the cache and generates what it did before."""
    params = varied_params(0)
    engine = make_engine()
    first = engine.rollout(params, 0, PROMPTS, GREEDY, rng=jax.random.key(0))
    stats = engine.cache_stats()
    engine.release_weights()
    assert engine._weights.params is None and engine.version == 0
    assert engine.cache_stats() == stats
    again = engine.rollout(params, 0, PROMPTS, GREEDY, rng=jax.random.key(0))
    assert again.cached_tokens > 0
    assert [s.output_ids for s in again.samples] == [s.output_ids for s in first.samples]
    engine.release_weights()
    newer = varied_params(1)
    engine.sync_weights(newer, 1)  # a sync after a release: a normal newer version
    batch = engine.rollout(newer, 1, PROMPTS, GREEDY, rng=jax.random.key(0))
    assert [list(s.output_ids) for s in batch.samples[::2]] == [
        dense_greedy(varied_params(1), CONFIG, p, 7)[0] for p in PROMPTS]


def test_release_with_drop_kv_frees_the_pool_and_the_next_call_rebuilds_it():
    """release_weights(drop_kv=True) (the synchronous loop's train phase): no cached entry
    and no KV pool remain; the next call at a newer version runs on a fresh pool and equals
    the dense model, and one at the same version simply misses the cache."""
    engine = make_engine()
    engine.rollout(varied_params(0), 0, PROMPTS, GREEDY, rng=jax.random.key(0))
    assert engine.cache_stats().cached_pages > 0
    engine.release_weights(drop_kv=True)
    assert engine._runner.kv is None and engine.cache_stats().cached_pages == 0
    assert engine.version == 0 and balanced(engine)
    again = engine.rollout(varied_params(0), 0, PROMPTS, GREEDY, rng=jax.random.key(0))
    assert again.cached_tokens == 0
    engine.release_weights(drop_kv=True)
    newer = varied_params(1)
    batch = engine.rollout(newer, 1, PROMPTS, GREEDY, rng=jax.random.key(0))
    assert [list(s.output_ids) for s in batch.samples[::2]] == [
        dense_greedy(newer, CONFIG, p, 7)[0] for p in PROMPTS]
    assert balanced(engine)
    with pytest.raises(TypeError, match="drop_kv"):
        engine.release_weights(drop_kv=1)


def _untransposed(resident):
    """(the resident params with each `Transposed` as its [in, out] weight, {path: the
    [out, in] transpose}) after checking every transpose is its weight's, in fresh buffers."""
    is_t = lambda x: isinstance(x, Transposed)  # noqa: E731
    transposes = {}

    def plain(path, x):
        if is_t(x):
            np.testing.assert_array_equal(np.asarray(x.t), np.swapaxes(np.asarray(x.w), -1, -2))
            assert x.t.unsafe_buffer_pointer() != x.w.unsafe_buffer_pointer()
            transposes[jax.tree_util.keystr(path)] = x.t
            return x.w
        return x
    return jax.tree_util.tree_map_with_path(plain, resident, is_leaf=is_t), transposes


def test_the_engine_holds_a_transpose_where_it_spares_padding():
    """A single-device engine holds a projection with its [out, in] transpose beside it
    exactly where the few-row dot pads (`transpose_pays`, measured on the running CPU: the
    set differs between CPUs), and rollouts with them equal dense greedy."""
    engine = make_engine()
    ack = engine.sync_weights(varied_params(0), 0)
    held, transposes = _untransposed(engine._weights.params)
    pays = {f"['layers']['{name}']" for name in PROJECTIONS
            if transpose_pays(*varied_params(0)["layers"][name].shape[-2:], "float32")}
    assert set(transposes) == pays
    assert ack.transposed_bytes == sum(t.nbytes for t in transposes.values())
    batch = engine.rollout(varied_params(0), 0, PROMPTS, GREEDY, rng=jax.random.key(0))
    assert [list(s.output_ids) for s in batch.samples[::2]] == [
        dense_greedy(varied_params(0), CONFIG, p, 7)[0] for p in PROMPTS]


def test_a_borrowing_sync_holds_the_callers_arrays_until_released():
    """sync_weights(borrow=True) keeps the caller's arrays (nothing copied: the ack says 0
    bytes) and generates with them; a copying sync reports the params' bytes. Deleting
    borrowed arrays (a donating train step) before release_weights makes the next rollout
    raise one clear error; released first, the donation is harmless."""
    engine = make_engine()
    params = jax.tree.map(jnp.array, varied_params(1))  # fresh device arrays of our own
    copied = engine.sync_weights(varied_params(0), 0)
    assert copied.copied_bytes == sum(x.nbytes for x in jax.tree.leaves(varied_params(0)))
    ack = engine.sync_weights(params, 1, borrow=True)
    assert ack.copied_bytes == 0 and ack.version == 1
    held, transposes = _untransposed(engine._weights.params)
    assert all(a.unsafe_buffer_pointer() == b.unsafe_buffer_pointer() for a, b in zip(
        jax.tree.leaves(held), jax.tree.leaves(params)))  # the very buffers
    assert ack.transposed_bytes == sum(t.nbytes for t in transposes.values())
    batch = engine.rollout(params, 1, PROMPTS, GREEDY, rng=jax.random.key(0))
    assert [list(s.output_ids) for s in batch.samples[::2]] == [
        dense_greedy(varied_params(1), CONFIG, p, 7)[0] for p in PROMPTS]
    jax.tree.map(lambda x: x.delete(), params)  # donated while still borrowed
    with pytest.raises(RuntimeError, match="release_weights"):
        engine.rollout(params, 1, PROMPTS, GREEDY, rng=jax.random.key(0))
    newer = jax.tree.map(jnp.array, varied_params(2))
    engine.sync_weights(newer, 2, borrow=True)
    engine.rollout(newer, 2, PROMPTS, GREEDY, rng=jax.random.key(0))
    engine.release_weights()
    jax.tree.map(lambda x: x.delete(), newer)  # released first: the engine holds nothing
    again = engine.rollout(varied_params(2), 2, PROMPTS, GREEDY, rng=jax.random.key(0))
    assert again.cached_tokens > 0
    with pytest.raises(TypeError, match="borrow must be a bool"):
        engine.sync_weights(varied_params(3), 3, borrow="yes")


def test_non_finite_params_are_refused_at_sync():
    engine = make_engine()
    bad = jax.tree.map(lambda x: x, varied_params(0))
    bad["embed"] = bad["embed"].at[0, 0].set(jnp.nan)
    with pytest.raises(ValueError, match="NaN or Inf"):
        engine.sync_weights(bad, 0)
    assert engine._weights.params is None and engine.version == 0



@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.int32])
def test_weight_check_matches_numpy(dtype):
    """The sync's one-pass check (finite, two bit sums per leaf) against numpy's arithmetic
    mod 2**32; a NaN or Inf anywhere in a float leaf makes it not finite."""
    from jaxrl_cache.rollout.engine import _checked
    rng = np.random.default_rng(0)
    leaves = [rng.normal(size=(37, 5)) * 100, rng.normal(size=(3,)) * 100]
    tree = {"a": jnp.asarray(leaves[0], dtype), "b": jnp.asarray(leaves[1], dtype)}
    finite, fingerprint = _checked(tree)
    want = []
    for x in jax.tree.leaves(tree):
        host = np.asarray(x)
        bits = host.view(f"uint{host.itemsize * 8}").reshape(-1).astype(np.uint64)
        index = np.arange(bits.size, dtype=np.uint64)
        weight = (index * 2654435761 + 1) % 2**32
        want += [int(bits.sum() % 2**32), int((bits * weight % 2**32).sum() % 2**32)]
    assert bool(finite) and np.asarray(fingerprint).tolist() == want
    if dtype != jnp.int32:
        for bad in (jnp.nan, jnp.inf, -jnp.inf):
            assert not bool(_checked({**tree, "a": tree["a"].at[36, 4].set(bad)})[0])

class TestWeakInput:
    """Typed errors naming the argument, raised before any work, engine unchanged."""

    @pytest.mark.parametrize("prompts,error,match", [
        ((p for p in PROMPTS), TypeError, "prompts"), (None, TypeError, "prompts"),
        ("abc", TypeError, "prompts"), (b"abc", TypeError, "prompts"),
        ({1, 2}, TypeError, "prompts"), ([[True, 2]], TypeError, "integer token ids"),
        ([b"ab"], TypeError, "prompt 0"), ([{1, 2}], TypeError, "prompt 0")])
    def test_prompts(self, prompts, error, match):
        engine = make_engine()
        with pytest.raises(error, match=match):
            engine.rollout(varied_params(0), 0, prompts, GREEDY, rng=jax.random.key(0))
        assert balanced(engine) and engine.cache_stats().lookups == 0

    @pytest.mark.parametrize("rng", [None, 3, np.uint32(3), jnp.zeros(3, jnp.uint32),
                                     jax.random.split(jax.random.key(0), 2)])
    def test_rng(self, rng):
        engine = make_engine()
        with pytest.raises(TypeError, match="rng"):
            engine.rollout(varied_params(0), 0, PROMPTS, GREEDY, rng=rng)
        assert engine._weights.params is None

    @pytest.mark.parametrize("stops,error", [((999,), ValueError), (5, TypeError),
                                             ("2", TypeError), ((1.5,), TypeError)])
    def test_stop_ids(self, stops, error):
        with pytest.raises(error, match="stop_token_ids"):
            sp = SamplingParams(n=1, max_new_tokens=3, stop_token_ids=stops)
            make_engine().rollout(varied_params(0), 0, PROMPTS, sp, rng=jax.random.key(0))

    def test_pool_larger_than_memory(self):
        with pytest.raises(ValueError, match="num_pages"):
            RolloutEngine(CONFIG, CacheConfig(num_pages=2**25, page_size=PS))  # 64 GiB

    @pytest.mark.filterwarnings("error")  # refused before JAX flattens it (no warning)
    @pytest.mark.parametrize("bad", [None, 1.5, "x", {"embed": 1}, (i for i in range(2))])
    def test_params(self, bad):
        engine = make_engine()
        with pytest.raises((TypeError, ValueError)):
            engine.sync_weights(bad, 0)
        assert engine._weights.params is None and engine.version == 0


@settings(max_examples=40, deadline=None)
@given(which=st.sampled_from(["params", "version", "prompts", "sampling", "rng"]),
       value=st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70),
                       st.floats(allow_nan=True), st.text(max_size=3), st.binary(max_size=3),
                       st.lists(st.integers(-3, 60), max_size=4),
                       st.lists(st.lists(st.integers(-3, 60), max_size=3), max_size=2),
                       st.sampled_from([{1, 2}, (i for i in range(2)), np.array([1, 2]),
                                        np.float32("nan"), object()])))
def test_junk_at_rollout_and_sync_is_a_typed_error_and_changes_nothing(which, value):
    engine = _JUNK_ENGINE
    before = (engine.version, engine._weights, engine.cache_stats())
    args = dict(params=_JUNK_PARAMS, version=engine.version, prompts=PROMPTS[:1],
                sampling=GREEDY, rng=jax.random.key(0))
    args[which] = value
    try:
        engine.rollout(args["params"], args["version"], args["prompts"], args["sampling"],
                       rng=args["rng"])
    except (TypeError, ValueError, VersionError, CacheFullError):
        assert (engine.version, engine._weights) == before[:2]
        stats = engine.cache_stats()
        assert stats.in_use_pages == 0 and stats.lookups == before[2].lookups
    if which in ("params", "version"):
        try:
            engine.sync_weights(args["params"], args["version"])
        except (TypeError, ValueError, VersionError):
            assert (engine.version, engine._weights) == before[:2]
    engine.cache.check_invariants()


_JUNK_PARAMS = varied_params(0)
_JUNK_ENGINE = make_engine()
_JUNK_ENGINE.sync_weights(_JUNK_PARAMS, 0)


def test_borrowing_host_arrays_copies_them_and_says_so():
    """sync_weights(numpy params, borrow=True): device_put may alias a numpy array on CPU,
    so host leaves are copied, never lent; editing the caller's arrays afterwards changes
    nothing the engine computes (the edited arrays are refused at that version, the synced
    values still served); the ack names the copied leaves and splits the bytes."""
    engine = make_engine()
    host = jax.tree.map(np.array, varied_params(1))  # writable numpy leaves
    mixed = {**host, "embed": jnp.array(host["embed"])}  # one device leaf, lendable
    ack = engine.sync_weights(mixed, 1, borrow=True)
    total = sum(x.nbytes for x in jax.tree.leaves(host))
    assert ack.lent_bytes == host["embed"].nbytes and ack.copied_bytes == total - ack.lent_bytes
    assert "['embed']" not in ack.copied_leaves
    assert len(ack.copied_leaves) == len(jax.tree.leaves(host)) - 1
    before = engine.rollout(mixed, 1, PROMPTS, GREEDY, rng=jax.random.key(0))
    for x in jax.tree.leaves(host):
        x *= 3.0  # the caller edits its arrays in place (mixed holds the same objects)
    with pytest.raises(VersionError, match="already synced with different params"):
        engine.rollout(mixed, 1, PROMPTS, GREEDY, rng=jax.random.key(0))
    after = engine.rollout(varied_params(1), 1, PROMPTS, GREEDY, rng=jax.random.key(0))
    assert [s.output_ids for s in after.samples] == [s.output_ids for s in before.samples]
    for a, b in zip(jax.tree.leaves(after.samples[0].output_logprobs),
                    jax.tree.leaves(before.samples[0].output_logprobs)):
        np.testing.assert_array_equal(a, b)


def test_a_version_keeps_its_params_after_release():
    """A version's weights are fixed once synced, lent or copied: after release_weights()
    (KV kept), other params at that version are refused by the next rollout or sync, so the
    old params' prefix KV can never serve them; the same weights (equal arrays) are
    accepted. replace=True allows other params only with nothing of the version cached."""
    engine = make_engine()
    engine.sync_weights(varied_params(0), 1, borrow=True)
    engine.rollout(varied_params(0), 1, PROMPTS, GREEDY, rng=jax.random.key(0))
    engine.release_weights()  # drop_kv=False: version-1 KV stays cached
    other = varied_params(5)
    with pytest.raises(VersionError, match="already synced with different params"):
        engine.rollout(other, 1, PROMPTS, GREEDY, rng=jax.random.key(0))
    with pytest.raises(VersionError, match="already synced with different params"):
        engine.sync_weights(other, 1)
    with pytest.raises(VersionError, match="holds KV of version 1"):
        engine.sync_weights(other, 1, replace=True)
    again = engine.rollout(varied_params(0), 1, PROMPTS, GREEDY, rng=jax.random.key(0))
    assert again.cached_tokens > 0 and audit_attribution(again, {1: varied_params(0)}, CONFIG).ok
    engine.release_weights(drop_kv=True)
    ack = engine.sync_weights(other, 1, replace=True)  # nothing of version 1 cached: allowed
    assert ack.version == 1
    fresh = engine.rollout(other, 1, PROMPTS, GREEDY, rng=jax.random.key(0))
    assert fresh.cached_tokens == 0 and audit_attribution(fresh, {1: other}, CONFIG).ok
    with pytest.raises(TypeError, match="replace must be a bool"):
        engine.sync_weights(other, 1, replace="yes")


def test_a_call_in_flight_fixes_the_version_it_was_staged_at():
    """Asynchronous mode: a call at a newer version stages its params; a sync landing at
    that version during the call must bring the same weights (its rows are writing KV of
    them), else VersionError, replace=True included: before, the other params were
    committed and the next call at that version reused the first params' prefix KV."""
    from tests.test_async_stateful import Scripted
    engine = Scripted(CONFIG, CacheConfig(num_pages=96, page_size=PS),
                      scheduler_config=SchedulerConfig(chunk_steps=2), kv_policy="recompute")
    engine.sync_weights(varied_params(0), 0)
    mine, other, refused = varied_params(1), varied_params(7), []

    def sync_other():
        for replace in (False, True):
            with pytest.raises(VersionError) as e:
                engine.sync_weights(other, 1, replace=replace)
            refused.append(str(e.value))
        assert engine.sync_weights(mine, 1).version == 1  # the call's own weights: fine

    engine.script = [None, sync_other]
    batch = engine.rollout(mine, 1, PROMPTS, GREEDY, rng=jax.random.key(0))
    engine.script = []
    assert "already synced with different params" in refused[0]
    assert "asynchronous call is in flight" in refused[1]
    assert engine.version == 1 and audit_attribution(batch, {1: mine}, CONFIG).ok
    with pytest.raises(VersionError, match="already synced with different params"):
        engine.rollout(other, 1, PROMPTS, GREEDY, rng=jax.random.key(0))
    again = engine.rollout(mine, 1, PROMPTS, GREEDY, rng=jax.random.key(0))
    assert again.cached_tokens > 0 and audit_attribution(again, {1: mine}, CONFIG).ok


def _f32_shapes(hlo: str) -> set:
    """The shape of every f32 array an HLO text names."""
    import re
    return {tuple(int(d) for d in m.split(",") if d) for m in re.findall(r"f32\[([\d,]*)\]", hlo)}


def test_a_bf16_engine_moves_bits_never_converting_its_pool_or_weights_whole():
    """XLA:CPU has no bf16 scatter, gather or dynamic slice: a bf16 pool written as floats
    was converted WHOLE to fp32 and back at every layer of every decode step (a 2 x 8 x 24
    rollout of SmolLM2: 47 s against 2.1 s in fp32), and the stacked weights the layer scan
    slices likewise. The engine's jitted calls carry both as uint16 bits
    (`kernels_pallas.as_bits16`, `rollout.core`): the forward then gives the same logits and
    writes the same pool bits, and its program holds no fp32 copy of the pool or a stack."""
    from jaxrl_cache.models.llama import decode_forward, init_kv_cache, prefill_forward
    from kernels_pallas import as_bits16, from_bits16
    config = dataclasses.replace(CONFIG, dtype="bfloat16")
    params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), varied_params(0))
    k0, v0 = init_kv_cache(config, 16, PS)
    rng = np.random.default_rng(0)
    pool = (jnp.asarray(rng.standard_normal(k0.shape), jnp.bfloat16),
            jnp.asarray(rng.standard_normal(v0.shape), jnp.bfloat16))
    table = jnp.asarray([[1, 2, 3], [4, 5, 6]], jnp.int32)
    decode = dict(tokens=jnp.asarray([3, 5], jnp.int32), positions=jnp.asarray([9, 17], jnp.int32),
                  page_table=table)
    tokens = jnp.arange(1, 12, dtype=jnp.int32)
    prefill = dict(tokens=tokens, token_seq=jnp.asarray([0] * 6 + [1] * 5, jnp.int32),
                   token_pos=jnp.asarray(list(range(6)) + list(range(5)), jnp.int32),
                   page_table=table, cu_q_lens=jnp.asarray([0, 6, 11], jnp.int32),
                   kv_lens=jnp.asarray([6, 5], jnp.int32),
                   logit_index=jnp.asarray([5, 10], jnp.int32))
    for forward, args in ((decode_forward, decode), (prefill_forward, prefill)):
        def run(kv, weights, bits, forward=forward, args=args):
            if bits:
                kv = jax.tree.map(as_bits16, kv)
                weights = {**weights, "layers": jax.tree.map(as_bits16, weights["layers"])}
            logits, kv = forward(weights, config, kv, backend="xla", **args)
            return logits, jax.tree.map(lambda p: from_bits16(p, jnp.bfloat16), kv)
        plain = jax.jit(functools.partial(run, bits=False))(pool, params)
        as_bits = jax.jit(functools.partial(run, bits=True))
        got = as_bits(pool, params)
        for a, b in zip(jax.tree.leaves(plain), jax.tree.leaves(got)):
            assert a.dtype == b.dtype and np.array_equal(np.asarray(a), np.asarray(b))
        shapes = _f32_shapes(as_bits.lower(pool, params).compile().as_text())
        assert pool[0].shape not in shapes  # nor the flat [L * P, Hkv, ps, D] view:
        assert (pool[0].shape[0] * pool[0].shape[1], *pool[0].shape[2:]) not in shapes
        assert not {w.shape for w in jax.tree.leaves(params["layers"]) if w.ndim == 3} & shapes
