"""RolloutEngine: dense-equivalence, version-keyed prefix reuse, failures, compilation."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_cache.rollout import core as rollout_core
from jaxrl_cache.rollout import CacheConfig, RolloutEngine
from jaxrl_cache.errors import CacheFullError, VersionError
from jaxrl_cache.rollout.sampling import SamplingParams, behavior_log_probs
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
