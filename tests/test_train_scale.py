"""The trainer at scale, against dense references: chunked log-probs equal the full-logits
ones, packed rows equal separate rows, micro-batching does not change the update, several
updates per batch, loss aggregations, KL, padding waste and what the step compiles."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxrl_cache.models import ModelConfig
from jaxrl_cache.models.llama import forward
from jaxrl_cache.models.lora import LoraConfig
from jaxrl_cache.rl import memory, train
from jaxrl_cache.rl.logprobs import next_token_log_probs, token_log_probs
from jaxrl_cache.rl.packing import (DISTINCT_ALIGN, SHAPE_REUSE, balanced_parts, pack, plan,
                                    scored_columns, shared_prefix)
from jaxrl_cache.rl.batch import group_advantages_no_std, make_batch, pack_batch
from jaxrl_cache.rl.memory import TrainMemoryError, check_memory, estimate_step_bytes
from jaxrl_cache.rl.train import TrainState, optimizer_counts, train_step
from jaxrl_cache.rl.train_config import TrainConfig
from jaxrl_cache.distribution import behavior_log_probs, filter_kind
from jaxrl_cache.rollout.sampling import SamplingParams
from jaxrl_cache.rollout.types import RolloutBatch, Sample
from tests.helpers import CONFIG, prefix_presence, teacher_forced_log_probs, varied_params

SGD = optax.identity()
_dense = jax.jit(teacher_forced_log_probs, static_argnums=1)


def dense_log_probs(params, seq, sp):
    """Reference: f32 [len(seq) - 1] from the full [L, V] logits (right-padded to a multiple
    of 32, invisible to a causal model: one compile for every short sequence)."""
    padded = np.zeros((1, -(-len(seq) // 32) * 32), np.int32)
    padded[0, :len(seq)] = seq
    return np.asarray(_dense(params, CONFIG, jnp.asarray(padded), **sp.as_arrays()))[
        0, :len(seq) - 1]


def _draw(params, prompt, sp, count, rng):
    """`count` tokens sampled from the dense model's warped distribution after `prompt`."""
    seq = list(prompt)
    for _ in range(count):
        padded = np.zeros(32, np.int32)
        padded[:len(seq)] = seq
        padded[len(seq)] = 1  # scored position: log-probs of every next token at len(seq) - 1
        logp = np.asarray(_dense_all(params, jnp.asarray(padded)[None], **sp.as_arrays()))[
            0, len(seq) - 1]
        p = np.exp(logp - logp.max())
        seq.append(int(rng.choice(len(p), p=p / p.sum())))
    return tuple(seq[len(prompt):])


@jax.jit
def _dense_all(params, tokens, temperature, top_p, top_k, min_p, repetition_penalty):
    return behavior_log_probs(forward(params, CONFIG, tokens), temperature, top_p, top_k,
                              min_p, repetition_penalty,
                              prefix_presence(tokens, CONFIG.vocab_size))


def rollout(params, sp, *, groups=2, seed=0, prompt_len=(4, 9), output_len=(1, 12),
            version=0, system=()):
    """Random prompts (each after the tokens `system`), outputs drawn from the dense model,
    behavior log-probs exactly the dense model's (on-policy)."""
    rng = np.random.default_rng(seed)
    samples = []
    for g in range(groups):
        prompt = tuple(system) + tuple(int(t) for t in rng.integers(1, CONFIG.vocab_size,
                                                                    rng.integers(*prompt_len)))
        for _ in range(sp.n):
            out = _draw(params, prompt, sp, int(rng.integers(*output_len)), rng)
            logp = dense_log_probs(params, prompt + out, sp)[len(prompt) - 1:]
            samples.append(Sample(prompt, out, logp.astype(np.float32), version,
                                  np.full(len(out), version), 0, "length", g))
    return RolloutBatch(samples=samples, version=version, sampling=sp, prefill_tokens=0,
                        reused_tokens=0, cached_tokens=0, decode_steps=0, decode_chunks=0,
                        prefill_launches=0, seconds=0.0)


def rewards(batch):
    return [float(s.output_ids[0] % 3 == 0) + 0.1 * len(s.output_ids) for s in batch.samples]


SETTINGS = [SamplingParams(n=4, temperature=1.0),
            SamplingParams(n=4, temperature=0.7, top_k=5),
            SamplingParams(n=4, temperature=0.7, top_k=5, top_p=0.8),
            SamplingParams(n=4, temperature=1.3, top_p=0.9),
            SamplingParams(n=4, temperature=0.0)]


@pytest.mark.parametrize("sp", SETTINGS, ids=lambda sp: filter_kind(
    sp.temperature, sp.top_p, sp.top_k, CONFIG.vocab_size) + f"-t{sp.temperature}")
@pytest.mark.parametrize("chunk", [5, 512])
def test_chunked_log_probs_equal_the_dense_ones(sp, chunk):
    params = varied_params(1)
    tokens = np.random.default_rng(0).integers(1, CONFIG.vocab_size, (3, 20)).astype(np.int32)
    got = np.asarray(next_token_log_probs(params, CONFIG, tokens, sp, chunk=chunk))
    ref = np.stack([dense_log_probs(params, row, sp) for row in tokens])
    finite = np.isfinite(ref)
    np.testing.assert_array_equal(np.isfinite(got), finite)
    np.testing.assert_allclose(got[finite], ref[finite], atol=2e-5)


def test_packed_rows_equal_separate_rows():
    """Three sequences in one row (segments, positions restarting) score as if alone."""
    params, sp = varied_params(2), SETTINGS[1]
    rng = np.random.default_rng(1)
    seqs = [rng.integers(1, CONFIG.vocab_size, n).astype(np.int32) for n in (7, 12, 5)]
    row = np.concatenate(seqs)[None]
    positions = np.concatenate([np.arange(len(s)) for s in seqs])[None]
    segments = np.concatenate([np.full(len(s), k + 1) for k, s in enumerate(seqs)])[None]
    targets = np.concatenate([np.append(s[1:], 0) for s in seqs])[None]
    knobs = sp.as_arrays()
    got = np.asarray(token_log_probs(params, CONFIG, jnp.asarray(row), jnp.asarray(targets),
                                     knobs, kind="top_k", positions=jnp.asarray(positions),
                                     segments=jnp.asarray(segments), chunk=8))[0]
    at = 0
    for s in seqs:
        np.testing.assert_allclose(got[at:at + len(s) - 1], dense_log_probs(params, s, sp),
                                   atol=2e-5)
        at += len(s)


def _packed_pair(params, sp, budget=4096):
    """A GRPO batch (2 prompts of 17-20 tokens x 4 samples) packed with and without
    shared prefixes."""
    batch = make_batch(rollout(params, sp, groups=2, prompt_len=(17, 21)),
                       [float(i % 3) for i in range(8)])
    args = (batch.sequences, batch.prompt_lengths, batch.behavior_logprobs,
            batch.token_versions, batch.advantages,
            [m.astype(np.float32) for m in batch.loss_masks], batch.loss_masks)
    return [pack(*args, parts=[np.arange(8)], token_budget=budget, share_prefixes=share)
            for share in (True, False)]


def _per_sample(packed, values):
    """values [U, M, B, R] -> per weighted position, in sample order (behavior as the key)."""
    keep = np.asarray(packed.weights) > 0
    order = np.lexsort((np.asarray(packed.behavior)[keep],))
    return np.asarray(values)[keep][order]


def test_shared_prefix_rows_keep_every_bit_and_the_gradient():
    """Samples of one prompt lay out its whole TILEs once (parents): fewer computed
    tokens, every sampled token's log-prob the same bits as the recorded (dense, on-policy)
    one and as the unshared packing's, with attention over the whole row or over each
    tile's kv_blocks only, and the same gradient of a weighted log-prob sum."""
    params, sp = varied_params(3), SETTINGS[1]
    shared, alone = _packed_pair(params, sp)
    assert int(np.asarray(shared.parents).max()) > 0
    assert shared.computed_tokens < alone.computed_tokens
    # each child's positions continue after its prefix, whose length is shared_prefix(prompt)
    parents, segments = np.asarray(shared.parents), np.asarray(shared.segments)
    child = parents > 0
    first = child & np.concatenate([np.ones_like(child[..., :1]),
                                    segments[..., 1:] != segments[..., :-1]], -1)
    assert set(np.asarray(shared.positions)[first].tolist()) == {16}
    knobs, kind = sp.as_arrays(), filter_kind(sp.temperature, sp.top_p, sp.top_k,
                                              CONFIG.vocab_size)

    def score(p, packed, gathered=True, distinct=False):
        # gathered: attention on each tile's kv_blocks; distinct: the projections and MLPs
        # on each row's distinct tokens (columns / sources)
        flat = jax.tree.map(lambda x: x.reshape(-1, *x.shape[3:]), packed)
        return token_log_probs(p, CONFIG, flat.tokens, flat.targets, knobs, kind=kind,
                               positions=flat.positions, segments=flat.segments,
                               parents=flat.parents,
                               kv_blocks=flat.kv_blocks if gathered else None,
                               items=flat.items if gathered else None,
                               columns=flat.columns if distinct else None,
                               sources=flat.sources if distinct else None,
                               chunk=8).reshape(packed.tokens.shape)

    for packed in (shared, alone):  # the recorded log-probs are the dense model's
        got = _per_sample(packed, score(params, packed))
        np.testing.assert_allclose(got, _per_sample(packed, packed.behavior), atol=2e-5)
    reference = _per_sample(alone, score(params, alone, gathered=False))
    for packed, gathered, distinct in ((shared, True, False), (shared, False, False),
                                       (alone, True, False), (shared, True, True),
                                       (alone, True, True)):
        np.testing.assert_array_equal(
            _per_sample(packed, score(params, packed, gathered, distinct)), reference)
    loss = lambda p, k, g, d: jnp.sum(score(p, k, g, d) * k.weights * k.advantages)  # noqa
    grads = [jax.grad(loss)(params, packed, gathered, distinct)
             for packed, gathered, distinct in ((shared, True, False), (shared, False, False),
                                                (shared, True, True), (alone, False, False))]
    for other in grads[:3]:
        for a, b in zip(jax.tree.leaves(other), jax.tree.leaves(grads[2])):
            # fp32 sums in another order (the prefix's gradient is summed over its samples)
            scale = float(np.abs(np.asarray(b)).max())
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0,
                                       atol=1e-4 * scale)
    # the prompt tokens each sample repeats in its first TILE are computed once
    def distinct(packed):  # (distinct tokens, sequence columns) over the rows
        live, sources = np.asarray(packed.segments) > 0, np.asarray(packed.sources)
        return (sum(len(set(sources[r][live[r]].tolist())) for r in np.ndindex(live.shape[:3])),
                int(live.sum()))

    assert distinct(shared)[0] < distinct(shared)[1] and distinct(alone)[0] == distinct(alone)[1]
    # a tile lists its prefix's blocks, then its own up to itself, padded with -1
    blocks, segs = np.asarray(shared.kv_blocks)[0, 0], np.asarray(shared.segments)[0, 0]
    for b in range(blocks.shape[0]):
        for tile, listed in enumerate(blocks[b]):
            listed = listed[listed >= 0]
            assert list(listed) == sorted(listed) and (not len(listed) or listed[-1] == tile)
            if segs[b, tile * 16]:
                seen = {int(segs[b, c]) for t in listed for c in range(t * 16, t * 16 + 16)}
                assert int(segs[b, tile * 16]) in seen


def test_distinct_tokens_stand_for_every_column():
    """columns / sources: each row's distinct tokens, each computed at a column holding it;
    every sequence column reads a distinct token of the same token id and position whose
    sequence shares everything before it, no distinct token is listed twice, and the
    log-probs are the bits of the row layout (every column computing its own token)."""
    rng, repeated = np.random.default_rng(5), 0
    for seed in range(4):
        params, sp = varied_params(seed), SETTINGS[seed % len(SETTINGS)]
        # seeds 2, 3: every prompt starts with the same 18 tokens (a system prompt), so
        # samples of different prompts share a prefix and part of their prompt rest
        system = tuple(range(3, 21)) if seed >= 2 else ()
        batch = make_batch(rollout(params, sp, groups=3, seed=seed, output_len=(1, 10),
                                   prompt_len=(1, 4) if system else (14, 21), system=system),
                           list(rng.standard_normal(12)))
        packed = pack_batch(batch, TrainConfig(token_budget=int(rng.choice([128, 256, 4096]))))
        knobs, kind = sp.as_arrays(), filter_kind(sp.temperature, sp.top_p, sp.top_k,
                                                  CONFIG.vocab_size)
        flat = jax.tree.map(lambda x: x.reshape(-1, *x.shape[3:]), packed)
        score = lambda *distinct: np.asarray(token_log_probs(  # noqa: E731
            params, CONFIG, flat.tokens, flat.targets, knobs, kind=kind,
            positions=flat.positions, segments=flat.segments, parents=flat.parents,
            kv_blocks=flat.kv_blocks, columns=distinct[0] if distinct else None,
            sources=distinct[1] if distinct else None))
        live = np.asarray(flat.segments) > 0  # padding columns read any distinct token
        np.testing.assert_array_equal(score(flat.columns, flat.sources)[live], score()[live])
        columns, sources = np.asarray(packed.columns), np.asarray(packed.sources)
        tokens, positions = np.asarray(packed.tokens), np.asarray(packed.positions)
        segments = np.asarray(packed.segments)
        for row in np.ndindex(*tokens.shape[:3]):
            live = segments[row] > 0
            distinct = len(set(sources[row][live].tolist()))
            listed = columns[row][:distinct]
            assert len(set(listed.tolist())) == distinct and (segments[row][listed] > 0).all()
            at = columns[row][sources[row]]  # the column each column reads
            np.testing.assert_array_equal(tokens[row][at[live]], tokens[row][live])
            np.testing.assert_array_equal(positions[row][at[live]], positions[row][live])
            parents = np.asarray(packed.parents)

            def history(c):  # the tokens column c's computation depends on, in order
                seg, par = segments[row][c], parents[row][c]
                before = np.flatnonzero(segments[row] == par) if par else np.array([], int)
                own = np.flatnonzero(segments[row][:c + 1] == seg)
                return tokens[row][np.concatenate([before, own])].tolist()

            for c in np.flatnonzero(live & (at != np.arange(len(live)))):
                assert history(c) == history(at[c]) and len(history(c)) == positions[row][c] + 1
                repeated += 1
    assert repeated > 0  # some prompt tokens were computed once for several samples


def test_kv_blocks_need_packed_rows():
    """kv_blocks without segments, or on a row that is not whole key blocks, columns
    without sources or kv_blocks: one clear error, not a failure inside the layer scan."""
    from jaxrl_cache.models.llama import hidden_states
    params, tokens = varied_params(0), jnp.ones((1, 32), jnp.int32)
    blocks = jnp.zeros((1, 2, 2), jnp.int32)
    with pytest.raises(ValueError, match="kv_blocks needs segments"):
        hidden_states(params, CONFIG, tokens, kv_blocks=blocks)
    with pytest.raises(ValueError, match="multiple of 16"):
        hidden_states(params, CONFIG, tokens[:, :20], segments=tokens[:, :20],
                      kv_blocks=blocks)
    with pytest.raises(ValueError, match="columns and sources go together"):
        hidden_states(params, CONFIG, tokens, segments=tokens, columns=tokens[:, :8])
    with pytest.raises(ValueError, match="columns and sources go together"):
        hidden_states(params, CONFIG, tokens, segments=tokens, columns=tokens[:, :8],
                      sources=jnp.zeros_like(tokens))


def test_shared_prefix_plans():
    """shared_prefix keeps the prompt's last token with each sample; a group longer than a
    row splits into units, each with its own copy of the prefix; GRPO groups of long prompts
    pack into fewer tokens than the sequences' own lengths."""
    assert [shared_prefix(p) for p in (1, 16, 17, 43, 48, 49)] == [0, 0, 16, 32, 32, 48]
    lengths = np.array([96] * 8 + [48])  # 8 samples sharing 64 tokens, one alone
    width, micro, per_micro, rows = plan([lengths], 256, groups_per_part=[[(64, range(8))]])
    units = [u for r in rows[0] for u in r]
    assert sorted(i for _, m in units for i in m) == list(range(9))
    for row in rows[0]:
        assert sum(p + sum(lengths[i] - p for i in m) for p, m in row) <= width
    assert {p for p, m in units if len(m) > 1} == {64} and len(units) > 2
    rng = np.random.default_rng(0)
    prompts = np.repeat(rng.integers(100, 400, 8), 8)
    lengths = (prompts + rng.integers(1, 257, 64) + 15) // 16 * 16
    groups = [(shared_prefix(int(prompts[g * 8])), range(g * 8, g * 8 + 8)) for g in range(8)]
    width, micro, per_micro, _ = plan([lengths], 4096, groups_per_part=[groups])
    assert micro * per_micro * width < 0.75 * lengths.sum()


def test_scored_columns_score_only_those_positions():
    """The LM head on the scored columns alone: the same log-probs there as the full pass,
    0 elsewhere; gradients of a loss on those positions equal too. scored_columns lists
    each row's weighted columns in order, padded with R."""
    weights = np.zeros((2, 3, 40), np.float32)
    weights[0, 1, [3, 4, 9]] = 0.5
    weights[1, 2, 30:40] = 1.0
    cols = scored_columns(weights, 32)
    assert cols.shape == (2, 3, 32)
    assert cols[0, 1, :4].tolist() == [3, 4, 9, 40] and (cols[0, 0] == 40).all()
    assert cols[1, 2, :10].tolist() == list(range(30, 40))
    narrow = scored_columns(weights, 10)  # as few as the fullest row
    assert (narrow == cols[..., :10]).all()
    for k in (9, 41):  # fewer than a row scores, more than R
        with pytest.raises(ValueError, match="scored columns"):
            scored_columns(weights, k)
    params, sp = varied_params(3), SamplingParams(temperature=0.8)
    rng = np.random.default_rng(2)
    tokens = jnp.asarray(rng.integers(1, CONFIG.vocab_size, (3, 40)), jnp.int32)
    targets = jnp.roll(tokens, -1, axis=1)
    knobs, kind = sp.as_arrays(), "none"
    mask = jnp.asarray(weights[1])

    def loss(p, scored):
        logp = token_log_probs(p, CONFIG, tokens, targets, knobs, kind=kind, chunk=16,
                               scored=scored)
        return (logp * mask).sum(), logp

    (full_loss, full), full_grad = jax.value_and_grad(loss, has_aux=True)(params, None)
    (cut_loss, cut), cut_grad = jax.value_and_grad(loss, has_aux=True)(
        params, jnp.asarray(cols[1]))
    keep = np.asarray(mask) > 0
    np.testing.assert_allclose(np.asarray(cut)[keep], np.asarray(full)[keep], atol=2e-5)
    assert (np.asarray(cut)[~keep] == 0).all()
    np.testing.assert_allclose(cut_loss, full_loss, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(cut_grad), jax.tree.leaves(full_grad)):
        np.testing.assert_allclose(a, b, atol=1e-5)


def _state(seed=0, lr=1e-2, tx=None):
    return TrainState.create(varied_params(seed), tx or optax.adam(1.0), config=CONFIG,
                             lr_schedule=lr)


@pytest.mark.parametrize("loss_type", ["grpo"])
def test_micro_batches_do_not_change_the_update(loss_type):
    """Token budgets of the whole batch, 1/4 and 1/16 of it: equal params (fp32). "grpo"
    (per-sequence weights) is the aggregation a wrong split would break first; the three
    aggregations' values are checked against numpy below."""
    sp = dataclasses.replace(SETTINGS[1], max_new_tokens=12)
    rollouts = rollout(varied_params(0), sp, groups=4)
    batch = make_batch(rollouts, rewards(rollouts))
    total = pack_batch(batch, TrainConfig(token_budget=4096)).tokens.size
    results = []
    for budget in (total, total // 4, total // 16):
        cfg = TrainConfig(token_budget=max(budget, 32), loss_type=loss_type)
        shape = pack_batch(batch, cfg).tokens.shape
        state, m = train_step(_state(tx=SGD), batch, cfg)
        results.append((shape, state.params, float(m["loss"])))
    assert len({shape[1] for shape, _, _ in results}) == 3  # 1, ~4, ~16 micro-batches
    for _, params, loss in results[1:]:
        # the loss is a sum of O(1) terms that cancel (group-normalised advantages at ratio
        # 1): its value is fp32 rounding, ~terms x eps, and a split only reorders the sum
        np.testing.assert_allclose(loss, results[0][2], rtol=1e-5, atol=2e-6)
        for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(results[0][1])):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_loss_types_against_numpy():
    """At the first update the ratio is 1, so the loss is -sum(weight x advantage): token
    mean (dapo), sequence mean of token means (grpo), token sum / (N x max_new_tokens)."""
    sp = dataclasses.replace(SETTINGS[0], max_new_tokens=12)
    rollouts = rollout(varied_params(0), sp, groups=3, seed=3)
    batch = make_batch(rollouts, rewards(rollouts), advantages=group_advantages_no_std)
    adv, lens = batch.advantages.astype(np.float64), np.array(
        [len(b) for b in batch.behavior_logprobs])
    r = np.array(rewards(rollouts))
    np.testing.assert_allclose(adv, r - np.repeat(r.reshape(3, 4).mean(1), 4), atol=1e-6)
    expected = dict(dapo=-(adv * lens).sum() / lens.sum(), grpo=-adv.mean(),
                    dr_grpo=-(adv * lens).sum() / (len(lens) * sp.max_new_tokens))
    for loss_type, value in expected.items():
        _, m = train_step(_state(tx=SGD), batch, loss_type=loss_type)
        np.testing.assert_allclose(float(m["loss"]), value, rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(float(m["ratio_mean"]), 1.0, atol=1e-5)


def test_kl_k3_against_the_dense_reference():
    sp = dataclasses.replace(SETTINGS[0], max_new_tokens=12)
    params, ref = varied_params(0), varied_params(5)
    rollouts = rollout(params, sp, seed=4)
    batch = make_batch(rollouts, rewards(rollouts))
    kls = []
    for s in rollouts.samples:
        seq, p = s.prompt_ids + s.output_ids, len(s.prompt_ids)
        delta = dense_log_probs(ref, seq, sp)[p - 1:] - dense_log_probs(params, seq, sp)[p - 1:]
        kls.append(np.exp(delta) - delta - 1)
    kl = np.concatenate(kls)
    _, plain = train_step(_state(tx=SGD), batch)
    _, m = train_step(_state(tx=SGD), batch, kl_beta=0.5, ref_params=ref)
    np.testing.assert_allclose(float(m["kl"]), kl.mean(), rtol=1e-4)
    np.testing.assert_allclose(float(m["loss"]) - float(plain["loss"]), 0.5 * kl.mean(),
                               rtol=1e-4)
    with pytest.raises(ValueError, match="kl_beta > 0 needs ref_params"):
        train_step(_state(), batch, kl_beta=0.5)
    for knobs in (dict(top_k=5), dict(top_p=0.9)):  # the reference's -inf: refused up front
        truncated = dataclasses.replace(batch, sampling=dataclasses.replace(sp, **knobs))
        with pytest.raises(ValueError, match="kl_beta > 0 with top-k / top-p sampling"):
            train_step(_state(), truncated, kl_beta=0.5, ref_params=ref)


def test_several_updates_per_batch_advance_the_version():
    """4 mini-batches x 2 epochs: 8 updates, 8 versions, lr evaluated at each."""
    sp = dataclasses.replace(SETTINGS[1], max_new_tokens=12)
    rollouts = rollout(varied_params(0), sp, groups=4)
    batch = make_batch(rollouts, rewards(rollouts))
    schedule = optax.linear_schedule(1e-2, 1e-3, 20)
    state = TrainState.create(varied_params(0), config=CONFIG, lr_schedule=schedule, version=3)
    state, m = train_step(state, batch, mini_batches=4, epochs=2)
    assert int(state.version) == int(m["version"]) == 11
    assert optimizer_counts(state.opt_state) == [11]
    np.testing.assert_allclose(np.asarray(m["per_update"]["lr"]),
                               [float(schedule(v)) for v in range(3, 11)], rtol=1e-6)
    # tokens per update: each mini-batch's own samples, in order, both epochs
    parts = balanced_parts(np.array([len(s) for s in batch.sequences]), 4)
    assert sorted(np.concatenate(parts).tolist()) == list(range(16))
    counts = [sum(len(batch.behavior_logprobs[i]) for i in p) for p in parts]
    assert np.asarray(m["per_update"]["tokens"]).tolist() == counts * 2
    with pytest.raises(ValueError, match="mini_batches=32 exceeds the batch's 16 samples"):
        train_step(state, batch, mini_batches=32)


def test_decoupled_proximal_is_the_params_before_the_first_update():
    """Fresh samples, 4 updates: the importance weight proximal/behavior stays 1 at every
    update (proximal = the params the batch was sampled with, scored once), while the ratio
    current/proximal moves off 1 after the first update; plain PPO-clip's ratio (against
    behavior) is the same ratio here, and with a large step it clips."""
    sp = dataclasses.replace(SETTINGS[0], max_new_tokens=12)
    rollouts = rollout(varied_params(0), sp, groups=4, seed=6)
    batch = make_batch(rollouts, rewards(rollouts))
    _, dec = train_step(_state(lr=3e-2), batch, mini_batches=4, correction="decoupled")
    _, plain = train_step(_state(lr=3e-2), batch, mini_batches=4)
    d, p = jax.device_get(dec["per_update"]), jax.device_get(plain["per_update"])
    np.testing.assert_allclose(d["is_weight_mean"], 1.0, atol=1e-5)
    np.testing.assert_allclose(d["ratio_mean"][0], 1.0, atol=1e-5)
    assert np.abs(d["ratio_mean"][1:] - 1).min() > 1e-3
    np.testing.assert_allclose(d["ratio_mean"], p["ratio_mean"], rtol=1e-4)
    np.testing.assert_allclose(d["loss"], p["loss"], rtol=1e-4, atol=1e-6)
    assert p["clip_fraction"][0] == 0 and p["clip_fraction"][1:].max() > 0.1


def test_padding_waste_on_a_grpo_batch():
    """64 samples, prompts of 20-80 tokens, outputs uniform in 1..256: computed / real
    tokens <= 1.1 at the default budget (1 or 4 mini-batches), a quarter of the batch, and a
    budget above the batch. (A mini-batch just over the budget is the worst case: two
    micro-batches of half a budget each, up to ~1.35 here.)"""
    rng = np.random.default_rng(0)
    prompts = np.repeat(rng.integers(20, 81, 8), 8)
    lengths = prompts + rng.integers(1, 257, 64)
    for budget, parts in ((4096, 1), (4096, 4), (int(lengths.sum()) // 4, 1),
                          (int(lengths.sum()) * 2, 1), (int(lengths.sum()) * 2, 4)):
        if True:
            split = [lengths[p] for p in balanced_parts(lengths, parts)]
            width, micro, per_micro, _ = plan(split, budget)
            assert per_micro * width <= max(budget, width)
            ratio = parts * micro * per_micro * width / lengths.sum()
            assert ratio <= 1.1, (budget, parts, ratio)
    with pytest.raises(ValueError, match="a sample of 300 tokens exceeds the token budget "
                                         r"\(256 per micro-batch\); raise token_budget"):
        plan([np.array([300, 20])], 256)


def test_plan_reuses_compiled_shapes():
    """Small GRPO batches of random lengths: with the shapes packed before as `known`, every
    plan still holds each sequence once, within the budget, at most SHAPE_REUSE x the
    tightest cost, and the run compiles far fewer distinct shapes."""
    rng = np.random.default_rng(1)
    known, tightest = set(), set()
    for _ in range(40):
        lengths = rng.integers(15, 21, 16) + rng.integers(1, 25, 16)
        best = plan([lengths], 4096)
        width, micro, per_micro, rows = plan([lengths], 4096, known=known)
        members = [[i for _, unit in r for i in unit] for r in rows[0]]
        assert sorted(i for m in members for i in m) == list(range(16))
        assert all(sum(lengths[m]) <= width for m in members)
        assert len(rows[0]) <= micro * per_micro and per_micro * width <= 4096
        assert micro * per_micro * width <= SHAPE_REUSE * best[1] * best[2] * best[0]
        known.add((width, micro, per_micro))
        tightest.add(best[:3])
    assert len(known) <= len(tightest) // 2, (known, tightest)


def _compiled_text(sp):
    rollouts = rollout(varied_params(0), sp, groups=1)
    batch = make_batch(rollouts, rewards(rollouts))
    state = _state()
    cfg = TrainConfig(remat="full")  # train_step resolves "auto" before this
    packed = pack_batch(batch, cfg)
    knobs = sp.as_arrays()
    kind = filter_kind(sp.temperature, sp.top_p, sp.top_k, CONFIG.vocab_size)
    nums = train.step_numbers(cfg)
    return train._train_jit.lower(state.params, state.opt_state, state.frozen, state.version, packed, None,
                                  None, knobs, jnp.ones(1, jnp.float32), nums, jnp.float32(jnp.inf),
                                  tx=state.tx,
                                  config=CONFIG, kind=kind, cfg=cfg).as_text()


def test_a_sort_is_compiled_only_for_top_p():
    assert "stablehlo.sort" not in _compiled_text(SETTINGS[0])
    assert "stablehlo.sort" not in _compiled_text(SETTINGS[1])  # top_k, with or without top-p: top_k
    assert "stablehlo.sort" in _compiled_text(SETTINGS[3])


def test_bf16_compute_keeps_fp32_params_and_matches_fp32():
    sp = dataclasses.replace(SETTINGS[0], max_new_tokens=12)
    rollouts = rollout(varied_params(0), sp, seed=7)
    batch = make_batch(rollouts, rewards(rollouts))
    s32, m32 = train_step(_state(tx=SGD), batch)
    s16, m16 = train_step(_state(tx=SGD), batch, compute_dtype="bfloat16", remat="dots")
    assert {x.dtype for x in jax.tree.leaves(s16.params)} == {jnp.dtype("float32")}
    np.testing.assert_allclose(float(m16["loss"]), float(m32["loss"]), rtol=0.05, atol=1e-3)
    np.testing.assert_allclose(float(m16["grad_norm"]), float(m32["grad_norm"]), rtol=0.1)


def test_a_step_that_cannot_fit_says_so_before_any_work(monkeypatch):
    """One line with the numbers and the setting to change; the state is untouched."""
    smol = ModelConfig(vocab_size=49152, d_model=576, n_layers=30, n_heads=9, n_kv_heads=3,
                       head_dim=64, d_ff=1536, max_seq_len=2048)
    need = estimate_step_bytes(smol, TrainConfig())
    assert need["state"] == 8 * 4 * 134_515_008  # params, grads, Adam, temporaries, no donation
    check_memory(smol, TrainConfig(), available=need["total"])
    with pytest.raises(TrainMemoryError, match=r"train step needs ~\d+\.\d GiB \(state .* for "
                       r"micro-batches of 4096 tokens\), .* available; lower token_budget "
                       r"\(--token-budget\) to about \d+"):
        check_memory(smol, TrainConfig(), available=int(need["state"] / 1.2))
    with pytest.raises(TrainMemoryError, match="the state alone does not fit"):
        check_memory(smol, TrainConfig(), available=need["state"] // 4)
    sp = dataclasses.replace(SETTINGS[0], max_new_tokens=12)
    rollouts = rollout(varied_params(0), sp, groups=1)
    batch = make_batch(rollouts, rewards(rollouts))
    state = _state()
    monkeypatch.setattr(memory, "available_bytes", lambda: 1024)
    with pytest.raises(TrainMemoryError, match="lower token_budget|state alone"):
        train_step(state, batch)
    assert int(state.version) == 0


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_lora_memory_estimate_counts_the_state_a_lora_train_state_holds(dtype):
    """With LoRA the state is the frozen base once (+ a bf16 copy under bf16 compute over an
    fp32 base) plus the adapters x 5 (x 8 without donation); activations as full FT."""
    config = dataclasses.replace(CONFIG, dtype=dtype)
    lora = LoraConfig(rank=4, targets="all-linear")
    params = jax.tree.map(lambda x: x.astype(dtype), varied_params(0))
    state = TrainState.create(params, config=config, lora=lora)
    nbytes = lambda tree: sum(x.nbytes for x in jax.tree.leaves(tree))  # noqa: E731
    est = estimate_step_bytes(config, TrainConfig(donate=True), lora=lora)
    assert est["frozen"] == nbytes(state.frozen)  # base + the f32 scale
    assert est["trainable"] == nbytes(state.params)
    assert 2 * est["trainable"] <= nbytes(state.opt_state) <= 2 * est["trainable"] + 64
    assert est["state"] == est["frozen"] + 5 * est["trainable"]
    assert estimate_step_bytes(config, TrainConfig(), lora=lora)["state"] == \
        est["frozen"] + 8 * est["trainable"]
    assert est["activations"] == estimate_step_bytes(config, TrainConfig(donate=True))[
        "activations"]
    bf16 = estimate_step_bytes(config, TrainConfig(donate=True, compute_dtype="bfloat16"),
                               lora=lora)
    cast = (nbytes(state.frozen) - 4) // 2 if dtype == "float32" else 0  # bf16 base copy
    assert bf16["frozen"] == est["frozen"] + cast
    smol = ModelConfig(vocab_size=49152, d_model=576, n_layers=30, n_heads=9, n_kv_heads=3,
                       head_dim=64, d_ff=1536, max_seq_len=2048)
    full = estimate_step_bytes(smol, TrainConfig())
    check_memory(smol, TrainConfig(), available=full["total"] // 2, lora=lora)
    with pytest.raises(TrainMemoryError):
        check_memory(smol, TrainConfig(), available=full["total"] // 2)


def test_shape_follows_the_prompts_not_the_sampled_lengths():
    """GRPO steps on the same prompts whose samples stop at other lengths (1 token up to
    max_new_tokens) pack into one shape [U, M, B, R] and one scored width K, planned for
    prompt + max_new_tokens: after the first step no new length recompiles the train step
    (the CLI demo on SmolLM2 compiled it in 4 of 5 steps). Every sequence is still packed
    whole, its tokens and weights where the unplanned packing puts them."""
    from jaxrl_cache.rl.packing import pack
    rng = np.random.default_rng(3)
    prompts = np.repeat(rng.integers(40, 50, 2), 8)  # 2 prompts x 8 samples
    max_new, shapes = 24, set()
    for step in range(12):
        outs = rng.integers(1, max_new + 1, 16)
        sequences = [rng.integers(1, 40, p + o) for p, o in zip(prompts, outs)]
        per_out = [np.ones(o, np.float32) for o in outs]
        args = (sequences, prompts, per_out, [np.zeros(o, np.int32) for o in outs],
                np.ones(16, np.float32), per_out, [np.ones(o, np.int32) for o in outs])
        packed = pack(*args, parts=[np.arange(16)], token_budget=4096,
                      reserve=prompts + max_new)
        shapes.add((packed.tokens.shape, packed.scored.shape, packed.items.shape))
        assert float(packed.weights.sum()) == outs.sum()
        # items: each row's (tile, key block) pairs holding a listed TILE, in order, then -1
        filled = np.asarray(packed.kv_blocks)[..., ::4] >= 0
        for row in np.ndindex(filled.shape[:3]):
            items = np.asarray(packed.items)[row]
            pairs = np.flatnonzero(filled[row])
            np.testing.assert_array_equal(items[:len(pairs)], pairs)
            assert (items[len(pairs):] == -1).all()
        seqs = [np.asarray(packed.tokens[0, 0, b])[np.asarray(packed.segments[0, 0, b]) == k]
                for b in range(packed.tokens.shape[2]) for k in range(1, 17)]
        assert sorted(map(tuple, (s for s in seqs if len(s)))) == \
            sorted(map(tuple, sequences))
        # the scored columns are exactly the weighted ones
        cols = np.asarray(packed.scored)
        kept = np.take_along_axis(np.pad(np.asarray(packed.weights), [(0, 0)] * 3 + [(0, 1)]),
                                  cols, -1)
        assert kept.sum() == outs.sum()
    assert len(shapes) == 1, shapes


def test_auto_remat_saves_the_dots_when_they_fit(monkeypatch):
    """remat "auto": "dots" when its estimate takes at most half the memory, "full" short of
    memory or with the memory unknown; explicit policies pass through. The "dots" estimate
    holds each layer's weight matmul outputs per token beside its input; an auto step trains
    like a full one (and resolves to "dots" on a machine with room)."""
    smol = ModelConfig(vocab_size=49152, d_model=576, n_layers=30, n_heads=9, n_kv_heads=3,
                       head_dim=64, d_ff=1536, max_seq_len=2048)
    auto = TrainConfig()
    dots = estimate_step_bytes(smol, dataclasses.replace(auto, remat="dots"))
    full = estimate_step_bytes(smol, dataclasses.replace(auto, remat="full"))
    per_token = 30 * 4 * (3 * 576 + 15 * 64 + 2 * 1536)  # input, q k v, o, gate, up, down
    assert dots["activations"] - full["activations"] == 4096 * (per_token - 30 * 4 * 576)
    assert estimate_step_bytes(smol, auto) == full
    resolve = lambda have: memory.resolve_remat(smol, auto, available=have).remat  # noqa
    roomy = 2 * dots["total"]
    assert resolve(roomy) == "dots" and resolve(roomy - 1) == "full"
    small = dataclasses.replace(auto, token_budget=512)  # the estimate follows the budget
    assert memory.resolve_remat(smol, small, available=roomy - 1).remat == "dots"
    monkeypatch.setattr(memory, "available_bytes", lambda: None)
    assert resolve(None) == "full"
    for given in ("full", "dots", "none"):
        cfg = dataclasses.replace(auto, remat=given)
        assert memory.resolve_remat(smol, cfg, available=1) is cfg

    chosen, real = [], memory.resolve_remat
    monkeypatch.setattr(memory, "available_bytes", lambda: 2**40)
    monkeypatch.setattr(train, "resolve_remat",
                        lambda *a, **k: chosen.append(real(*a, **k).remat) or real(*a, **k))
    sp = dataclasses.replace(SETTINGS[0], max_new_tokens=12)
    rollouts = rollout(varied_params(0), sp, seed=7)
    batch = make_batch(rollouts, rewards(rollouts))
    s_auto, m_auto = train_step(_state(tx=SGD), batch)
    s_full, m_full = train_step(_state(tx=SGD), batch, remat="full")
    assert chosen == ["dots", "full"]
    np.testing.assert_allclose(float(m_auto["loss"]), float(m_full["loss"]), rtol=1e-5)
    for a, b in zip(jax.tree.leaves(s_auto.params), jax.tree.leaves(s_full.params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)


def test_grpo_groups_plan_for_distinct_tokens():
    """8 prompts of 45 tokens x 8 samples of 128 (the 8 x 8 x 128 benchmark's shape): the
    packer's choice computes at most 10% more token rows than the batch's distinct tokens
    (each prompt once, each output once). Planning by columns chose rows of 320 (a prefix
    and two samples): 10,560 rows for 8,552 distinct tokens."""
    rng = np.random.default_rng(0)
    sequences, prompt_lengths = [], []
    for _ in range(8):
        prompt = list(rng.integers(1, 1000, 45))
        for _ in range(8):
            sequences.append(prompt + list(rng.integers(1, 1000, 128)))
            prompt_lengths.append(45)
    per_output = [np.zeros(128, np.float32) for _ in sequences]
    packed = pack(sequences, np.array(prompt_lengths), per_output, [np.zeros(128, np.int32)] * 64,
                  np.zeros(64, np.float32), [np.ones(128, np.float32)] * 64,
                  [np.ones(128, bool)] * 64, parts=[np.arange(64)], token_budget=4096)
    distinct = 8 * 45 + 64 * 128
    live, sources = np.asarray(packed.segments) > 0, np.asarray(packed.sources)
    listed = sum(len(set(sources[r][live[r]].tolist())) for r in np.ndindex(live.shape[:3]))
    assert distinct <= listed <= packed.computed_tokens <= 1.1 * distinct
    # attention computes the key blocks the rows' tiles fill, not every tile's longest list:
    # here a prefix of 2 TILEs and samples of 9 see 1-3 blocks of a 3-block list (0.61x)
    filled = int((np.asarray(packed.kv_blocks)[..., ::4] >= 0).sum())
    padded = int(np.prod(packed.kv_blocks.shape[:-1])) * packed.kv_blocks.shape[-1] // 4
    assert filled <= packed.items.size <= 1.1 * filled < 0.75 * padded


def test_distinct_width_is_the_planned_count_rounded_to_a_tile():
    """A GRPO group as the CLI's 2 x 8 x 24 chat run has it: a 43-token prompt, 8 samples
    planned for 24 new tokens each (reserve), so 43 + 8 x 24 = 235 distinct tokens a row:
    the projections run on N = 240 of them (DISTINCT_ALIGN), not 256, and every sampled
    token is laid out and scored within that width."""
    rng = np.random.default_rng(3)
    prompt = list(rng.integers(1, 1000, 43))
    outs = [24, 12, 24, 16, 24, 24, 7, 24]  # as sampled (at most the 24 planned)
    sequences = [prompt + list(rng.integers(1, 1000, o)) for o in outs]
    packed = pack(sequences, np.full(8, 43), [np.zeros(o, np.float32) for o in outs],
                  [np.zeros(o, np.int32) for o in outs], np.zeros(8, np.float32),
                  [np.ones(o, np.float32) for o in outs], [np.ones(o, bool) for o in outs],
                  parts=[np.arange(8)], token_budget=4096, reserve=np.full(8, 43 + 24))
    assert DISTINCT_ALIGN == 16 and packed.columns.shape[-1] == 240
    live, sources = np.asarray(packed.segments) > 0, np.asarray(packed.sources)
    listed = [len(set(sources[r][live[r]].tolist())) for r in np.ndindex(live.shape[:3])]
    assert sum(listed) == 43 + sum(outs)  # the prompt once, each output token once
    assert np.asarray(packed.weights > 0).sum() == sum(outs)  # every sampled token scored


def _grpo_like(rng, outs, prompt_len=45, group=8):
    """Sequences of len(outs) / group prompts of prompt_len tokens, sample i with outs[i]
    output tokens; the pack() arguments for them (weights 1 on every output token)."""
    sequences, prompts = [], []
    for g in range(len(outs) // group):
        prompt = list(rng.integers(1, 1000, prompt_len))
        for o in outs[g * group:(g + 1) * group]:
            sequences.append(np.array(prompt + list(rng.integers(1, 1000, o)), np.int32))
            prompts.append(prompt_len)
    per_out = [np.ones(o, np.float32) for o in outs]
    return (sequences, np.array(prompts), per_out, [np.zeros(o, np.int32) for o in outs],
            np.ones(len(outs), np.float32), per_out, [np.ones(o, np.int32) for o in outs])


def test_sampled_lengths_are_laid_out_densely_in_the_planned_shape():
    """8 prompts x 8 samples reserved 128 new tokens, sampled shorter (as a policy that
    stops at EOS): the shape is the one planned for 128 each (no recompile), but the
    samples fill its first micro-batches and the rest hold padding alone (the train step
    skips those), each row within the shape's distinct-token, scored and pair widths.
    Before, each sample kept its reserved columns: all 4 micro-batches computed."""
    rng = np.random.default_rng(0)
    full = _grpo_like(rng, [128] * 64)
    planned = pack(*full, parts=[np.arange(64)], token_budget=4096,
                   reserve=full[1] + 128)
    for seed in range(4):
        rng = np.random.default_rng(seed)
        outs = np.where(rng.random(64) < 0.2, 128, rng.integers(15, 60, 64))
        args = _grpo_like(rng, list(outs))
        packed = pack(*args, parts=[np.arange(64)], token_budget=4096, reserve=args[1] + 128)
        assert jax.tree.map(np.shape, packed) == jax.tree.map(np.shape, planned)
        weights = np.asarray(packed.weights)
        assert weights.sum() == outs.sum()
        used = (weights > 0).any(axis=(-1, -2))[0]  # [M]: micro-batches with a scored token
        assert used.sum() < used.size and used[:used.sum()].all()  # a prefix of them
        assert (np.asarray(packed.segments)[0, ~used] == 0).all()  # the rest: padding
        # every sample whole, once, each in one row
        segments, tokens = np.asarray(packed.segments), np.asarray(packed.tokens)
        parents, sources = np.asarray(packed.parents), np.asarray(packed.sources)
        found = []
        for row in np.ndindex(segments.shape[:3]):
            for k in set(segments[row].tolist()) - {0}:
                seq = tokens[row][segments[row] == k]
                if (parents[row][segments[row] == k] > 0).any():  # after a shared prefix
                    p = parents[row][segments[row] == k][0]
                    seq = np.concatenate([tokens[row][segments[row] == p], seq])
                elif (parents[row] == k).any():
                    continue  # the shared prefix itself
                found.append(tuple(seq))
                # its distinct tokens are listed: every column maps into `columns`
                assert (sources[row][segments[row] == k] < packed.columns.shape[-1]).all()
        assert sorted(found) == sorted(map(tuple, args[0]))


def test_padding_micro_batches_are_skipped(monkeypatch):
    """A micro-batch of padding alone (no weight > 0) is not computed: one appended to a
    batch, its weights NaN (not > 0, and NaN in the loss were it computed), leaves the
    step's params and metrics bit for bit those of the batch without it."""
    sp = dataclasses.replace(SETTINGS[1], max_new_tokens=12)
    rollouts = rollout(varied_params(0), sp, groups=4)
    batch = make_batch(rollouts, rewards(rollouts))
    cfg = TrainConfig(token_budget=64)
    plain, plain_m = train_step(_state(tx=SGD), batch, cfg)

    def padded(*a, **kw):
        packed = pack_batch(*a, **kw)
        assert packed.tokens.shape[1] > 1  # a scan over micro-batches
        extra = jax.tree.map(lambda x: jnp.zeros_like(x[:, :1]), packed)
        extra = extra.replace(weights=jnp.full_like(extra.weights, jnp.nan),
                              kv_blocks=extra.kv_blocks - 1, items=extra.items - 1)
        return jax.tree.map(lambda a, b: jnp.concatenate([a, b], 1), packed, extra)

    monkeypatch.setattr(train, "pack_batch", padded)
    skipped, skipped_m = train_step(_state(tx=SGD), batch, cfg)
    for a, b in zip(jax.tree.leaves(skipped.params), jax.tree.leaves(plain.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    for key in ("loss", "grad_norm", "audit_diff_max", "tokens"):
        np.testing.assert_array_equal(np.asarray(skipped_m[key]), np.asarray(plain_m[key]))


def test_widths_are_one_compiled_tuple():
    """The scored, key-list, distinct-token and pair widths (K, KM, N, W) are taken as one
    tuple compiled before with the shape (the one computing least that holds the batch),
    never a mix of two: each width's smallest compiled value, picked apart, would give a
    program no step compiled."""
    rng = np.random.default_rng(0)
    args = _grpo_like(rng, [int(o) for o in rng.integers(15, 60, 16)])
    widths = lambda p: (p.scored.shape[-1], p.kv_blocks.shape[-1],  # noqa: E731
                        p.columns.shape[-1], p.items.shape[-1])
    first = pack(*args, parts=[np.arange(16)], token_budget=4096, reserve=args[1] + 128)
    k, km, n, w = widths(first)
    _, micro, rows, width = first.tokens.shape
    seen = {(k + 64, km, n, w), (k, km, n + 64, w + 16)}  # both hold it; (k, km, n, w) is new
    packed = pack(*args, parts=[np.arange(16)], token_budget=4096, reserve=args[1] + 128,
                  known={(width, micro, rows): seen})
    assert packed.tokens.shape == first.tokens.shape
    assert widths(packed) == (k + 64, km, n, w)  # the one with fewer distinct-token rows


def test_trim_after_compiles_registers_once_and_trims_after_long_compiles(monkeypatch):
    """The listener is registered once however often it is asked for; it trims the heap
    after a compile of TRIM_AFTER_COMPILE_SECONDS or more, not after a short one or another
    event."""
    from jax._src import monitoring
    trims = []
    monkeypatch.setattr(memory, "trim_host_memory", lambda: trims.append(1))
    memory.trim_after_compiles()
    memory.trim_after_compiles()
    assert monitoring._event_duration_secs_listeners.count(memory._trim_after_compile) == 1
    long = memory.TRIM_AFTER_COMPILE_SECONDS
    jax.monitoring.record_event_duration_secs(memory.COMPILE_EVENT, long / 10)
    jax.monitoring.record_event_duration_secs("/jax/other", long)
    assert trims == []
    jax.monitoring.record_event_duration_secs(memory.COMPILE_EVENT, long)
    assert trims == [1]
    monkeypatch.undo()
    memory.trim_host_memory()  # the real one: malloc_trim on glibc, a no-op elsewhere
