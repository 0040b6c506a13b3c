"""The device side of the engine: owns the KV pool, packs a round's arrays (`pack_prefill`,
`pack_decode`) and calls the jitted core (core.prefill_step, core.decode_chunk) with the
params it is handed; it returns what was computed and the run (scheduler.Run) records it.

The pool is donated to every core call and replaced by its result; a call that fails after
donation leaves it deleted (`pool_lost`), and the engine then rebuilds it empty.
"""
from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_cache import parallel
from jaxrl_cache.models import ModelConfig
from jaxrl_cache.models.families import family_of
from jaxrl_cache.rollout import core, scheduler
from jaxrl_cache.rollout.scheduler import Row, Unit
from jaxrl_cache.rollout.types import CacheConfig, SchedulerConfig
from jaxrl_cache.shapes import page_width_floor
from kernels_pallas import next_power_of_2
from kernels_pallas.blocked import KEY_BLOCK


@dataclasses.dataclass(frozen=True)
class PrefillArrays:
    """Packed inputs of one prefill launch (shapes bucketed by the caller's sizes)."""
    tokens: np.ndarray  # int32 [T] new prompt tokens of every unit, packed
    token_seq: np.ndarray  # int32 [T] unit of each token
    token_pos: np.ndarray  # int32 [T] position in its prompt (-1 = padding)
    page_table: np.ndarray  # int32 [S, W] the unit's first row's table
    cu_q_lens: np.ndarray  # int32 [S+1]
    kv_lens: np.ndarray  # int32 [S] prompt lengths
    logit_slot: np.ndarray  # int32 [B] packed token whose logits slot b starts from
    copy_src: np.ndarray  # int32 [B] partial prompt page to copy ... (0 -> 0 = none)
    copy_dst: np.ndarray  # int32 [B] ... into a row's own first page


def pack_prefill(units: list[tuple[Unit, list[int]]], num_tokens: int, num_seqs: int,
                 width: int, num_slots: int, page_size: int) -> PrefillArrays:
    """units: (unit, slot of each of its rows). Sizes T=num_tokens >= sum of new tokens,
    S=num_seqs >= len(units), W=width >= any table, B=num_slots."""
    tokens = np.zeros(num_tokens, np.int32)
    token_seq = np.zeros(num_tokens, np.int32)
    token_pos = np.full(num_tokens, -1, np.int32)
    table = np.zeros((num_seqs, width), np.int32)
    cu = np.zeros(num_seqs + 1, np.int32)
    kv_lens = np.zeros(num_seqs, np.int32)
    logit_slot = np.zeros(num_slots, np.int32)
    copy_src = np.zeros(num_slots, np.int32)
    copy_dst = np.zeros(num_slots, np.int32)
    for s, (unit, slots) in enumerate(units):
        lo, hi = cu[s], cu[s] + unit.new_tokens
        tokens[lo:hi] = unit.prompt[unit.cached_tokens:]
        token_seq[lo:hi] = s
        token_pos[lo:hi] = np.arange(unit.cached_tokens, len(unit.prompt))
        cu[s + 1] = hi
        kv_lens[s] = len(unit.prompt)
        first = unit.rows[0].pages
        table[s, :first.size] = first
        partial = len(unit.prompt) % page_size != 0
        full = len(unit.prompt) // page_size
        for row, slot in zip(unit.rows, slots):
            logit_slot[slot] = hi - 1
            if partial and row is not unit.rows[0]:
                copy_src[slot], copy_dst[slot] = first[full], row.pages[full]
    cu[len(units) + 1:] = cu[len(units)]
    return PrefillArrays(tokens, token_seq, token_pos, table, cu, kv_lens, logit_slot,
                         copy_src, copy_dst)


@dataclasses.dataclass(frozen=True)
class DecodeArrays:
    """Per-slot state sent to one decode chunk."""
    fresh: np.ndarray  # bool [B] first token comes from the prefill logits
    last_token: np.ndarray  # int32 [B] token whose KV the next step writes
    position: np.ndarray  # int32 [B] its position (fresh rows: the prompt length)
    page_table: np.ndarray  # int32 [B, W - S] each row's pages after the shared ones
    shared_pages: np.ndarray  # int32 [S] first pages of every decoding row (shared_prefix)
    budget: np.ndarray  # int32 [B] tokens the row may still emit (0 = empty slot)
    sample_index: np.ndarray  # int32 [B] Row.index (its PRNG stream)
    emitted: np.ndarray  # int32 [B] tokens emitted so far (position in its PRNG stream)


MIN_DECODE_ROWS = 2  # XLA on CPU copies the whole KV pool per layer for a 1-row decode


def slot_bucket(slots: list) -> int:
    """Decode rows to compute: the first of 2, 4, 16, 64, 256, ... covering the last occupied
    slot (capped at the slot count, never below 2), so a call with fewer rows than slots,
    or a draining batch, stops paying for its empty slots; few shapes, one compile each."""
    need = 1 + max((i for i, row in enumerate(slots) if row is not None), default=0)
    rows = MIN_DECODE_ROWS if need <= MIN_DECODE_ROWS else 4
    while rows < need:
        rows *= 4
    return min(rows, max(len(slots), MIN_DECODE_ROWS))


def _next_position(row: Row) -> int:
    """Position whose KV the row's next decode step writes (fresh rows: the prompt length)."""
    return len(row.prompt) + len(row.tokens) - (0 if row.fresh else 1)


def shared_prefix(slots: list, page_size: int) -> int:
    """Leading pages every decoding row's table holds in common (the same physical pages: a
    shared system prompt, one prompt's group), all before any row's next write, so no row
    writes them in the chunk. 0 unless at least two rows decode."""
    live = [row for row in slots if row is not None and not row.resume]
    if len(live) < 2:
        return 0
    n = min(min(_next_position(row) // page_size, row.pages.size) for row in live)
    tables = np.stack([row.pages[:n] for row in live])  # [rows, n]
    return int(np.cumprod((tables == tables[0]).all(axis=0)).sum())


def reach_width(slots: list, width: int, page_size: int, steps: int) -> int:
    """Page-table width a decode chunk of `steps` steps needs (the `xla` backend scores every
    key of the width it is given): the pages up to the furthest position a decoding row
    writes in the chunk, in whole key blocks, rounded up to a power of two of them (few
    shapes), at most the run's `width`. Keys past a row's end add exact zeros in the
    canonical order (`kernels_pallas.blocked`), so cutting them changes no bit; early in a
    long generation a chunk reads a fraction of the table."""
    live = [row for row in slots if row is not None and not row.resume]
    if not live:
        return width
    reach = max(_next_position(row) for row in live) + steps  # positions < reach
    per_block = max(1, KEY_BLOCK // page_size)
    blocks = -(-scheduler.pages_for(reach, page_size) // per_block)
    return min(width, per_block * next_power_of_2(blocks))


def pack_decode(slots: list, width: int, shared: int = 0) -> DecodeArrays:
    """slots: Row or None per decode slot; width: the chunk's table width (a row's pages
    beyond it are cut: `reach_width`). shared: leading pages common to every decoding row
    (<= `shared_prefix`), sent once as shared_pages and cut from page_table (then
    [B, width - shared])."""
    b = len(slots)
    fresh = np.zeros(b, bool)
    last = np.zeros(b, np.int32)
    pos = np.zeros(b, np.int32)
    table = np.zeros((b, width - shared), np.int32)
    shared_pages = np.zeros(shared, np.int32)
    budget = np.zeros(b, np.int32)
    index = np.zeros(b, np.int32)
    emitted = np.zeros(b, np.int32)
    for i, row in enumerate(slots):
        if row is None or row.resume:  # a row waiting to be re-prefilled does not decode
            continue
        n = len(row.tokens)
        fresh[i] = row.fresh
        last[i] = row.tokens[-1] if n else 0
        pos[i] = _next_position(row)
        pages = row.pages[shared:width]
        table[i, :pages.size] = pages
        shared_pages = row.pages[:shared]  # the same in every decoding row
        budget[i] = row.max_new - n
        index[i] = row.index
        emitted[i] = n
    return DecodeArrays(fresh, last, pos, table, shared_pages.astype(np.int32), budget, index,
                        emitted)


def context_presence(slots: list, vocab: int) -> np.ndarray:
    """bool [len(slots), vocab]: the tokens of each decoding row's context (prompt and output
    so far; the repetition penalty's presence), False for empty slots."""
    out = np.zeros((len(slots), vocab), bool)
    for i, row in enumerate(slots):
        if row is not None and not row.resume:
            out[i, list(row.context)] = True
    return out


def _resize_rows(x, rows: int):
    """x [B, V] cut or zero-padded to [rows, V] (decode slots beyond B are empty)."""
    if x.shape[0] >= rows:
        return x[:rows]
    return jnp.pad(x, ((0, rows - x.shape[0]), (0, 0)))


PREFILL_PAD = 4  # a one-off prefill may run in a compiled shape of up to this many times its
#   tokens (`Runner._prefill_shape`)


class Runner:
    """KV pool and device dispatch of one engine (one rollout step at a time: the engine's
    lock). mesh: the pool is sharded tensor-parallel over it, else it lives on `device`."""

    def __init__(self, model_config: ModelConfig, cache_config: CacheConfig,
                 scheduler_config: SchedulerConfig, backend: str, device, mesh):
        self.model_config, self.cache_config = model_config, cache_config
        self.scheduler_config, self.backend = scheduler_config, backend
        self.device, self.mesh = device, mesh
        self.shared_widths: dict[tuple[int, int], set[int]] = {}  # (rows, width) -> shared
        self.prefill_shapes: dict[int, set[tuple[int, int]]] = {}  # width -> (tokens, seqs)
        self.prefill_asks: dict[int, set[tuple[int, int]]] = {}  # width -> buckets asked for
        self._check_pool_fits()
        self.kv = self.fresh_pool()

    def _check_pool_fits(self) -> None:
        """Refuses a KV pool larger than the device's memory (host RAM on CPU) up front."""
        init = family_of(self.model_config).decoder.init_kv_cache
        shapes = jax.eval_shape(lambda: init(self.model_config, self.cache_config.num_pages,
                                             self.cache_config.page_size))
        need = sum(s.size * s.dtype.itemsize for s in jax.tree.leaves(shapes))
        stats = self.device.memory_stats() if hasattr(self.device, "memory_stats") else None
        limit = (stats or {}).get("bytes_limit")
        if limit is None and hasattr(os, "sysconf"):
            limit = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        if limit and need > limit:
            raise ValueError(
                f"CacheConfig.num_pages={self.cache_config.num_pages} needs a KV pool of "
                f"{need / 2**30:.1f} GiB but the device has {limit / 2**30:.1f} GiB; use fewer "
                f"pages")

    def fresh_pool(self):
        """An empty KV pool in the engine's layout."""
        cfg = self.cache_config
        if self.mesh is not None:
            return parallel.engine_kv_cache(self.model_config, cfg.num_pages, cfg.page_size,
                                            self.mesh)
        pool = family_of(self.model_config).decoder.init_kv_cache(
            self.model_config, cfg.num_pages, cfg.page_size)
        return jax.device_put(pool, self.device)

    def release_pool(self) -> None:
        """Frees the KV pool (no page may hold anything a reader needs); the next core call
        starts from a fresh empty one."""
        self.kv = None

    def _pool(self):
        if self.kv is None:
            self.kv = self.fresh_pool()
        return self.kv

    def pool_lost(self) -> bool:
        """True iff a failed core call left the (donated) pool deleted."""
        return any(x.is_deleted() for x in jax.tree.leaves(self.kv))

    def prefill(self, params, run: scheduler.Run, units, trie_tokens: int,
                keep: list[int] | None = None):
        """One packed prefill of the round's units ((unit, slots) pairs) with `params`.
        Returns (the logits its fresh rows start decoding from f32 [slots, V], the prompt
        tokens computed). trie_tokens: the longest prefix a unit took from the radix trie
        (page_claims.Round). keep: slots an earlier prefill of this step filled (their
        logits, run.fresh_logits, are kept)."""
        cfg = self.scheduler_config
        total = sum(u.new_tokens for u, _ in units)
        # what the round computes a version later, when the trie's prefix is new KV once
        room = min(total + trie_tokens, 2 * total, max(total, cfg.max_prefill_tokens))
        tokens, seqs = self._prefill_shape(max(16, next_power_of_2(total)),
                                           next_power_of_2(len(units)), run.width,
                                           max(16, next_power_of_2(room)))
        arrays = pack_prefill(units, tokens, seqs, run.width, cfg.max_num_seqs, run.ps)
        logits, self.kv = core.prefill_step(
            params, self._pool(), *dataclasses.astuple(arrays),
            config=self.model_config, backend=self.backend, mesh=self.mesh)
        if keep:
            earlier = np.zeros((cfg.max_num_seqs, 1), bool)
            earlier[list(keep)] = True
            logits = jnp.where(earlier, run.fresh_logits, logits)
        return logits, total

    def _prefill_shape(self, tokens: int, seqs: int, width: int,
                       room: int) -> tuple[int, int]:
        """(tokens, seqs) of the packed prefill at this table width (padding tokens are
        position -1: no output changes).

        - A compiled shape of exactly `tokens` (and at least `seqs`) runs it.
        - The first time a bucket is asked for, the smallest compiled shape of up to
          PREFILL_PAD x its tokens runs it: a one-off smaller prefill (a later step's radix
          hits, another admission split) compiles nothing.
        - Otherwise (a bucket that recurs, or none fits) it compiles its own shape, of
          `room` tokens where that is more (the same prompts a version later, when the
          prefix the trie served is new KV, then fit it): steady use pays no padding.
        """
        compiled = self.prefill_shapes.setdefault(width, set())
        asked = self.prefill_asks.setdefault(width, set())
        fits = [(t, s) for t, s in compiled if tokens <= t <= PREFILL_PAD * tokens and seqs <= s]
        if fits and (min(fits)[0] == tokens or (tokens, seqs) not in asked):
            asked.add((tokens, seqs))
            return min(fits)
        asked.add((tokens, seqs))
        shape = (max(tokens, room), seqs)
        compiled.add(shape)
        return shape

    def _shared_width(self, rows: int, width: int, most: int) -> int:
        """The shared page count to send, at most `most` (any smaller count is correct:
        the rest stay in every row's table): the largest one decoded before at this
        (rows, width), so prompts that happen to share more pages compile nothing new."""
        seen = self.shared_widths.setdefault((rows, width), set())
        known = [k for k in seen if k <= most]
        shared = max(known) if known else most
        seen.add(shared)
        return shared

    def decode(self, params, run: scheduler.Run) -> tuple[list, tuple, int]:
        """One decode chunk with `params` over the run's first `slot_bucket` slots (every
        live row is there: admission fills the lowest free slots), so empty slots beyond
        cost nothing. Returns (those slots, (tokens int32 [b, k], logprobs f32 [b, k],
        counts int32 [b], stopped bool [b]) on the host, the decode steps run)."""
        cfg = self.scheduler_config
        width = slot_bucket(run.slots)
        slots = run.slots[:width] + [None] * (width - len(run.slots))
        shared = 0  # the kernels read shared pages through every row's table anyway
        table = run.width  # the kernels loop over each row's own blocks only
        if self.backend == "xla":
            table = reach_width(slots, run.width, run.ps, cfg.chunk_steps)
            # at least one column stays per row (a row may only read shared pages)
            shared = self._shared_width(width, table, page_width_floor(
                min(shared_prefix(slots, run.ps), table - 1)))
        arrays = pack_decode(slots, table, shared)
        refill_at = cfg.max_num_seqs + 1
        if run.waiting:
            refill_at = max(1, min(len(run.waiting), cfg.max_num_seqs // 4))
        fresh_logits = run.fresh_logits
        if fresh_logits is None or not arrays.fresh.any():
            fresh_logits = jnp.zeros((width, self.model_config.vocab_size), jnp.float32)
        elif fresh_logits.shape[0] != width:
            fresh_logits = _resize_rows(fresh_logits, width)
        out = core.decode_chunk(
            params, self._pool(), fresh_logits, arrays.fresh,
            arrays.last_token, arrays.position, arrays.page_table, arrays.shared_pages,
            arrays.budget,
            arrays.sample_index, arrays.emitted, run.stops, np.int32(refill_at),
            **run.knobs, key=run.rng,
            presence=context_presence(slots, self.model_config.vocab_size) if run.penalised
            else None, config=self.model_config, backend=self.backend,
            steps=cfg.chunk_steps, mesh=self.mesh)
        *host, self.kv = out
        tokens, logprobs, counts, stopped, steps = jax.device_get(host)
        return slots, (tokens, logprobs, counts, stopped), int(steps)
