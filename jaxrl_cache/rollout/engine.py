"""RolloutEngine: the host shell around the jitted prefill/decode core.

One lock serialises `rollout` and `sync_weights`. The policy version is read once, under that
lock, and every sample of a rollout is stamped with it. Prefix KV is looked up and inserted
under that version only; a sync to a newer version drops every older entry before it
acknowledges.
"""
from __future__ import annotations

import dataclasses
import operator
import threading
import time
from typing import Sequence

import jax
import numpy as np

from jaxrl_cache.rollout import core as rollout_core
from jaxrl_cache.errors import VersionError
from jaxrl_cache.models import ModelConfig, init_kv_cache, init_params
from jaxrl_cache.cache import CacheStats, RadixCache
from jaxrl_cache.rollout.sampling import SamplingParams
from jaxrl_cache.rollout.types import CacheConfig, RolloutBatch, Sample, WeightAck
from jaxrl_cache.shapes import bucket
from jaxrl_cache.versioning import as_version
from kernels_pallas._common import next_power_of_2, resolve_backend


def _same_leaves(tree, leaves) -> bool:
    """True iff `tree`'s leaves are the very objects in `leaves` (held, so ids stay unique)."""
    mine = jax.tree.leaves(tree)
    return leaves is not None and len(mine) == len(leaves) and all(
        a is b for a, b in zip(mine, leaves))


class RolloutEngine:
    def __init__(self, model_config: ModelConfig, cache_config: CacheConfig = CacheConfig(), *,
                 backend: str = "auto", version=0, device=None):
        self.model_config = model_config
        self.cache_config = cache_config
        self.backend = resolve_backend(backend)
        self.device = device or jax.devices()[0]
        self.cache = RadixCache(cache_config.num_pages, cache_config.page_size)
        self._version = as_version(version)
        self._params = None  # resident params of self._version
        self._params_source = None  # the caller's leaves they came from (identity checks)
        self._lock = threading.Lock()
        self._kv = jax.device_put(init_kv_cache(model_config, cache_config.num_pages,
                                                cache_config.page_size), self.device)
        self._param_shapes = jax.eval_shape(lambda k: init_params(model_config, k),
                                            jax.random.key(0))

    def _cache_key(self, version: int) -> int:
        """The radix namespace of `version`: the version itself (invariant 1). Tests override
        it to reproduce the stale-KV bug of public projects and check the audit catches it."""
        return version

    @property
    def version(self) -> int:
        return self._version

    # ------------------------------------------------------------------ weight sync
    def sync_weights(self, params, version) -> WeightAck:
        """Makes `params` the engine's weights for `version` and acknowledges.

        Waits for any in-flight rollout (same lock). Newer version: params placed on the
        engine's device and resident, every older prefix entry dropped, then the version is
        committed. Same version: idempotent (nothing invalidated). Older: VersionError. If
        anything fails, the previous version, weights and cache stay as they were.
        """
        version = as_version(version)
        with self._lock:
            return self._sync_locked(params, version)

    def _sync_locked(self, params, version: int) -> WeightAck:
        start = time.perf_counter()
        previous = self._version
        if version < previous:
            raise VersionError(f"version {version} is older than the engine's version "
                               f"{previous}; versions only move forward")
        if version == previous and self._params is not None:
            if not _same_leaves(params, self._params_source):
                raise VersionError(
                    f"version {version} is already synced with different params; a weight "
                    f"change must come with a new version (got {version} again)")
            return WeightAck(version, previous, 0, time.perf_counter() - start,
                             tuple(self.cache.versions()))
        self._check_params(params)
        resident = jax.block_until_ready(jax.device_put(params, self.device))
        invalidated = self.cache.invalidate_before(self._cache_key(version))
        # commit: nothing below can fail
        self._params, self._params_source = resident, tuple(jax.tree.leaves(params))
        self._version = version
        return WeightAck(version, previous, invalidated, time.perf_counter() - start,
                         tuple(self.cache.versions()))

    def _check_params(self, params) -> None:
        want = jax.tree.structure(self._param_shapes)
        got = jax.tree.structure(params)
        if got != want:
            raise ValueError(f"params tree does not match the model config: {got} vs {want}")
        for path, a, b in zip(jax.tree_util.tree_leaves_with_path(params),
                              jax.tree.leaves(params), jax.tree.leaves(self._param_shapes)):
            if a.shape != b.shape or a.dtype != b.dtype:
                raise ValueError(f"param {jax.tree_util.keystr(path[0])} is {a.dtype}"
                                 f"{list(a.shape)}, the model config needs {b.dtype}"
                                 f"{list(b.shape)}")

    # ------------------------------------------------------------------ rollout
    def rollout(self, params, version, prompts: Sequence[Sequence[int]],
                sampling: SamplingParams, *, rng: jax.Array) -> RolloutBatch:
        """Generates sampling.n samples per prompt with the params of `version`.

        A newer version first goes through `sync_weights`; the current version proceeds (its
        params must be the ones synced); an older one raises VersionError. Bad prompts and a
        batch the pool cannot hold raise before any work, leaving the engine unchanged.
        """
        version = as_version(version)
        prompts = self._check_prompts(prompts, sampling)
        with self._lock:
            ack = None
            if version > self._version or self._params is None:
                ack = self._sync_locked(params, version)
            elif version < self._version:
                raise VersionError(f"rollout at version {version} but the engine is at "
                                   f"{self._version}; versions only move forward")
            elif not _same_leaves(params, self._params_source):
                raise VersionError(f"params passed for version {version} differ from those "
                                   f"synced for it; bump the version when weights change")
            batch = self._generate(self._params, self._version, prompts, sampling, rng)
            return dataclasses.replace(batch, sync_ack=ack)

    def _check_prompts(self, prompts, sampling: SamplingParams) -> list[tuple]:
        if not isinstance(sampling, SamplingParams):
            raise TypeError(f"sampling must be SamplingParams, got {type(sampling).__name__}")
        if isinstance(prompts, (str, bytes)) or len(prompts) == 0:
            raise ValueError("prompts must be a non-empty list of token-id sequences")
        vocab, limit = self.model_config.vocab_size, self.model_config.max_seq_len
        out = []
        for i, p in enumerate(prompts):
            try:
                p = tuple(operator.index(t) for t in p)
            except TypeError:
                raise TypeError(f"prompt {i} must be a sequence of integer token ids, got "
                                f"{p!r:.80}") from None
            if not p:
                raise ValueError(f"prompt {i} is empty")
            bad = [t for t in p if not 0 <= t < vocab]
            if bad:
                raise ValueError(f"prompt {i} has token ids outside [0, {vocab}): {bad[:5]}")
            if len(p) + sampling.max_new_tokens > limit:
                raise ValueError(f"prompt {i}: {len(p)} tokens + max_new_tokens "
                                 f"{sampling.max_new_tokens} exceeds max_seq_len {limit}")
            out.append(p)
        return out

    def _generate(self, params, version, prompts, sampling: SamplingParams, rng) -> RolloutBatch:
        start = time.perf_counter()
        ps = self.cache_config.page_size
        n_new = sampling.max_new_tokens
        share = self.cache_config.prefix_cache
        key_version = self._cache_key(version)
        # Without sharing, each sample is its own group of one.
        groups = prompts if share else [p for p in prompts for _ in range(sampling.n)]
        per_group = sampling.n if share else 1
        held: list[np.ndarray] = []  # every page reference this call owns
        try:
            matches = [self.cache.match(key_version, p[:-1]) if share else None for p in groups]
            held.extend(m.pages for m in matches if m is not None)
            plan = []
            need = 0
            for p, m in zip(groups, matches):
                cached = 0 if m is None else m.num_tokens
                shared = len(p) // ps  # full prompt pages, shared by the group's samples
                own = -(-(len(p) + n_new - 1) // ps) - shared  # per sample
                plan.append((cached, shared, own))
                need += (shared - cached // ps) + per_group * own
            fresh = self.cache.alloc(need)  # CacheFullError before any device work
            held.append(fresh)
            return self._run(params, version, key_version, groups, matches, plan, fresh,
                             per_group, sampling, rng, start)
        finally:
            for pages in held:
                self.cache.release(pages)
            if any(pool.is_deleted() for pool in jax.tree.leaves(self._kv)):
                # A failure after the pool was donated: its KV is gone, so is every entry.
                self.cache.clear()
                self._kv = jax.device_put(init_kv_cache(
                    self.model_config, self.cache_config.num_pages, ps), self.device)

    def _run(self, params, version, key_version, groups, matches, plan, fresh, per_group,
             sampling, rng, start) -> RolloutBatch:
        ps = self.cache_config.page_size
        cursor = 0

        def take(n):
            nonlocal cursor
            cursor += n
            return fresh[cursor - n:cursor]

        # Page lists: group_pages = cached + newly written full prompt pages (shared);
        # row_pages[r] = group_pages + this sample's own pages.
        row_pages, row_group, copies = [], [], []
        for g, ((cached, shared, own), m) in enumerate(zip(plan, matches)):
            cached_pages = m.pages if m is not None else np.zeros(0, np.int32)
            gp = np.concatenate([cached_pages, take(shared - cached // ps)])
            partial = len(groups[g]) % ps != 0  # then own >= 1 and own[0] holds that page
            for j in range(per_group):
                mine = take(own)
                row_pages.append(np.concatenate([gp, mine]))
                row_group.append(g)
                if partial and j == 0:
                    partial_page = mine[0]  # prefill writes the partial prompt page here
                elif partial:
                    copies.append((partial_page, mine[0]))
        width = bucket(max(len(r) for r in row_pages), 8)

        # ---- paged prefill of each group's uncached prompt tokens (packed)
        q_lens = [len(p) - c for p, (c, _, _) in zip(groups, plan)]
        n_seq = next_power_of_2(len(groups))
        n_tok = next_power_of_2(sum(q_lens))
        tokens = np.zeros(n_tok, np.int32)
        token_seq = np.zeros(n_tok, np.int32)
        token_pos = np.full(n_tok, -1, np.int32)
        cu = np.zeros(n_seq + 1, np.int32)
        kv_lens = np.zeros(n_seq, np.int32)
        table = np.zeros((n_seq, width), np.int32)
        first_row = 0
        for g, (p, (cached, _, _)) in enumerate(zip(groups, plan)):
            lo, hi = cu[g], cu[g] + q_lens[g]
            tokens[lo:hi] = p[cached:]
            token_seq[lo:hi] = g
            token_pos[lo:hi] = np.arange(cached, len(p))
            cu[g + 1] = hi
            kv_lens[g] = len(p)
            table[g, :len(row_pages[first_row])] = row_pages[first_row]
            first_row += per_group
        cu[len(groups) + 1:] = cu[len(groups)]
        logit_index = np.maximum(cu[1:] - 1, 0).astype(np.int32)
        group_logits, self._kv = rollout_core.prefill_step(
            params, self._kv, tokens, token_seq, token_pos, table, cu, kv_lens, logit_index,
            config=self.model_config, backend=self.backend)

        # ---- on-device decode loop for every sample row
        n_rows = next_power_of_2(len(row_pages))
        rows_group = np.full(n_rows, -1, np.int32)
        rows_group[:len(row_group)] = row_group
        rows_pos = np.zeros(n_rows, np.int32)
        rows_pos[:len(row_group)] = [len(groups[g]) for g in row_group]
        rows_table = np.zeros((n_rows, width), np.int32)
        for r, pages in enumerate(row_pages):
            rows_table[r, :len(pages)] = pages
        n_copy = next_power_of_2(max(1, len(copies)))
        copy_src = np.zeros(n_copy, np.int32)
        copy_dst = np.zeros(n_copy, np.int32)
        if copies:
            copy_src[:len(copies)], copy_dst[:len(copies)] = zip(*copies)
        stops = np.full(next_power_of_2(max(1, len(sampling.stop_token_ids))), -1, np.int32)
        stops[:len(sampling.stop_token_ids)] = sampling.stop_token_ids
        out_tok, out_logp, lengths, stopped, steps, self._kv = rollout_core.decode_loop(
            params, self._kv, group_logits, rows_group, rows_pos, rows_table, copy_src,
            copy_dst, stops, **sampling.as_arrays(), key=rng, config=self.model_config,
            backend=self.backend, max_new_tokens=sampling.max_new_tokens)
        out_tok, out_logp, lengths, stopped, steps = jax.device_get(
            (out_tok, out_logp, lengths, stopped, steps))

        # ---- results, then cache the full pages of prompt + output under `version`
        samples = []
        for r, g in enumerate(row_group):
            n = int(lengths[r])
            out = tuple(int(t) for t in out_tok[r, :n])
            seq = groups[g] + out[:-1]  # tokens whose KV was written
            full = len(seq) // ps
            if self.cache_config.prefix_cache:
                self.cache.insert(key_version, seq[:full * ps], row_pages[r][:full])
            samples.append(Sample(
                prompt_ids=groups[g], output_ids=out, output_logprobs=out_logp[r, :n].copy(),
                behavior_version=version, token_versions=np.full(n, version, np.int64),
                cached_tokens=plan[g][0], finish_reason="stop" if stopped[r] else "length",
                group=g if self.cache_config.prefix_cache else g // sampling.n))
        prompt_tokens = sum(len(s.prompt_ids) for s in samples)
        computed = int(sum(q_lens))
        return RolloutBatch(samples=samples, version=version, sampling=sampling,
                            prefill_tokens=computed, reused_tokens=prompt_tokens - computed,
                            cached_tokens=sum(c for c, _, _ in plan) * per_group,
                            decode_steps=int(steps), seconds=time.perf_counter() - start)

    def cache_stats(self) -> CacheStats:
        with self._lock:
            return self.cache.stats()
