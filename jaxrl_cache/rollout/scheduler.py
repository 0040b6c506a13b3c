"""Continuous-batching bookkeeping on the host (no model, no device): page math, unit
layouts, and a call's queue and slots (`Run`: admission, resume, version stamping, and the
record of what each core call computed). The arrays a core call takes are packed next to
it, in runner.py.

A rollout call is a queue of requests (`Request`: sample j of prompt g, in prompt order; or
an episode's next turn, rollout/episodes.py). Requests are admitted in order into a fixed
number of decode slots as pages allow, a *unit* at a time: up to n consecutive samples of
one prompt that share its prefill. Between decode chunks finished rows retire and waiting
requests are admitted.

Page policy: a sample's worst case (prompt + max_new_tokens - 1 positions) is reserved at
admission, so a running row never waits for a page and nothing is preempted or recomputed.
The price is lower concurrency when outputs stop early; pages a row did not use return to
the pool when it retires.

Page layout of a row (every page listed is held by the row: one reference each):
    [matched prefix pages | shared prompt pages of its unit | own pages]
own[0] holds the partial last prompt page when the prompt does not end on a page boundary:
the unit's first row prefills it, the others get a copy (`copies`).
"""
from __future__ import annotations

import collections
import dataclasses
from typing import NamedTuple, Sequence

import numpy as np

from jaxrl_cache.cache import PackedTokens, RadixCache
from jaxrl_cache.shapes import page_width_bucket
from kernels_pallas import next_power_of_2


def pages_for(num_tokens: int, page_size: int) -> int:
    return -(-num_tokens // page_size)


def row_pages(prompt_len: int, max_new_tokens: int, page_size: int) -> int:
    """Pages one sample needs: KV of prompt + every output token but the last."""
    return pages_for(prompt_len + max_new_tokens - 1, page_size)


class Request(NamedTuple):
    """One row to generate: `prompt` (its whole context) then up to `max_new` tokens."""
    group: int  # prompt g of the call, or episode e (`Run.packed` is keyed by it)
    index: int  # Row.index: its place in the output and its PRNG stream
    prompt: tuple
    max_new: int
    kv_version: int | None = None  # kv_policy "keep", an episode's next turn: the version
    #   whose cached KV of `prompt` it may continue over (None: the run's current version)


@dataclasses.dataclass
class Row:
    """One sample in flight: its table, what it generated, and how it ended."""
    index: int  # position in the call's output (prompt order, then sample order)
    group: int  # index of its prompt in the call
    prompt: tuple
    pages: np.ndarray  # int32 [n] every page of its table
    cached_tokens: int  # prompt tokens whose KV came from the radix cache
    max_new: int  # tokens it may emit (the call's max_new_tokens, or an episode's budget)
    fresh: bool = True  # next token still to be drawn from the prefill logits
    tokens: list = dataclasses.field(default_factory=list)
    logprobs: list = dataclasses.field(default_factory=list)
    finish_reason: str | None = None
    # Asynchronous mode: versions may change between chunks while the row runs.
    token_versions: list = dataclasses.field(default_factory=list)  # one per token
    mixed: list = dataclasses.field(default_factory=list)  # bool per token (kv_policy keep)
    kv_now: set = dataclasses.field(default_factory=set)  # versions that wrote its table's KV
    kv_versions: set = dataclasses.field(default_factory=set)  # ... over the row's life
    resume: bool = False  # its KV was dropped at a weight update: re-prefill before decoding

    @property
    def context(self) -> tuple:
        """Prompt + every token emitted so far (what a resumed row re-prefills)."""
        return self.prompt + tuple(self.tokens)


@dataclasses.dataclass(frozen=True)
class Unit:
    """Samples of one prompt admitted together: one prefill of the uncached prompt tail."""
    group: int
    prompt: tuple
    cached_tokens: int  # page-aligned prefix served by the radix cache
    rows: tuple  # Row, ...; rows[0] prefills, the others copy its partial page
    kv_version: int | None = None  # the older version whose cached KV the prefix is (kv_policy
    #   "keep": its tokens are then mixed; its pages never enter the trie); None: the run's

    @property
    def new_tokens(self) -> int:
        return len(self.prompt) - self.cached_tokens


def unit_page_need(prompt_len: int, cached_tokens: int, rows: int, max_new_tokens: int,
                   page_size: int) -> tuple[int, int]:
    """(shared, own): fresh full prompt pages for the unit, fresh pages per row."""
    full = prompt_len // page_size
    shared = full - cached_tokens // page_size
    own = row_pages(prompt_len, max_new_tokens, page_size) - full
    return shared, own


def layout_unit(group: int, prompt: tuple, first_index: int, matched: np.ndarray,
                fresh: np.ndarray, rows: int, max_new_tokens: int, page_size: int) -> Unit:
    """Splits `fresh` pages (from the allocator) into the unit's rows' tables.

    matched int32 [c] pinned radix pages; fresh int32 [shared + rows * own].
    """
    cached = matched.size * page_size
    shared, own = unit_page_need(len(prompt), cached, rows, max_new_tokens, page_size)
    if fresh.size != shared + rows * own:
        raise ValueError(f"unit needs {shared + rows * own} fresh pages, got {fresh.size}")
    prefix = np.concatenate([matched, fresh[:shared]]).astype(np.int32)
    out = tuple(Row(index=first_index + j, group=group, prompt=prompt,
                    pages=np.concatenate([prefix, fresh[shared + j * own:shared + (j + 1) * own]]),
                    cached_tokens=cached, max_new=max_new_tokens) for j in range(rows))
    return Unit(group=group, prompt=prompt, cached_tokens=cached, rows=out)


def resume_unit(row: Row, matched: np.ndarray, fresh: np.ndarray, page_size: int) -> Unit:
    """A running row whose KV was dropped (kv_policy "recompute") as a one-row unit that
    re-prefills its context (prompt + tokens so far) into a new table; the row then draws
    its next token from that prefill's logits.

    matched int32 [c] pinned radix pages of the context; fresh int32 [need] from the allocator.
    """
    context = row.context
    laid = layout_unit(row.group, context, row.index, matched, fresh, 1,
                       row.max_new - len(row.tokens), page_size)
    row.pages, row.fresh, row.resume = laid.rows[0].pages, True, False
    return dataclasses.replace(laid, rows=(row,))


def apply_chunk(slots: list, tokens: np.ndarray, logprobs: np.ndarray, counts: np.ndarray,
                stopped: np.ndarray, version: int) -> list[int]:
    """Appends a chunk's output to its rows; returns the slots whose rows finished.

    tokens int32 [B, k], logprobs f32 [B, k], counts int32 [B] tokens emitted this chunk,
    stopped bool [B] the last of them is a stop token; version: the params' version that ran
    the chunk (it sampled every token and wrote every KV entry of the chunk). A token is
    mixed when the KV it attended to was written by any other version too.
    """
    done = []
    for i, row in enumerate(slots):
        if row is None or row.resume:
            continue
        n = int(counts[i])
        if n:
            row.kv_now.add(version)
            row.kv_versions.add(version)
        row.tokens.extend(tokens[i, :n].tolist())
        row.logprobs.extend(logprobs[i, :n].tolist())
        row.token_versions.extend([version] * n)
        row.mixed.extend([row.kv_now != {version}] * n)
        row.fresh = row.fresh and n == 0
        if stopped[i]:
            row.finish_reason = "stop"
        elif len(row.tokens) >= row.max_new:
            row.finish_reason = "length"
        if row.finish_reason is not None:
            done.append(i)
    return done


def keep_tokens(row: Row, n: int) -> None:
    """Drops the row's output past its first n tokens, with every per-token record (a stop
    string found by the host after the chunk ran past it)."""
    for per_token in (row.tokens, row.logprobs, row.token_versions, row.mixed):
        del per_token[n:]


def written_outputs(row: Row) -> list:
    """Outputs whose KV the row's pages hold after its prompt's: every one but the last."""
    return row.tokens[:-1]


class Run:
    """One rollout call's host state: its queue, decode slots, finished rows and counters.

    `weights` (.version, .params) is what the call generates with now: each step reads it
    once and passes that value's version to admission (stamped on every row's KV), to
    `apply` (on every token) and to retirement; in asynchronous mode a commit between two
    steps replaces it (`on_update`), never a step. `key_of` maps a version to its radix namespace (the
    engine's `_cache_key`, the only place that mapping is written). max_tokens: the longest
    context + output any row may reach (its page-table width). episodes: an
    episodes.Driver whose environments add requests as turns finish (None: single-turn).
    """

    def __init__(self, weights, requests: list[Request], sampling, rng, *, cache: RadixCache,
                 page_size: int, share: bool, num_slots: int, max_prefill_tokens: int,
                 max_policy_lag: int, key_of, max_tokens: int, text=None, episodes=None):
        self.weights, self.sampling, self.rng = weights, sampling, rng
        self.start_version = weights.version
        self.cache, self.ps, self.share, self.key_of = cache, page_size, share, key_of
        self.max_prefill_tokens, self.max_policy_lag = max_prefill_tokens, max_policy_lag
        self.slots: list = [None] * num_slots
        # Without sharing, each sample is a unit of its own (a baseline).
        self.waiting: collections.deque = collections.deque()
        self.packed: dict[int, PackedTokens] = {}  # group -> its latest context, packed
        self.episodes = episodes
        self._enqueue(requests)
        self.width = page_width_bucket(pages_for(max_tokens - 1, page_size))
        self.finished: dict[int, Row] = {}
        self.computed = self.steps = self.chunks = self.prefills = 0
        self.recomputed = 0  # context tokens re-prefilled after weight updates
        self.updates = 0  # weight updates that landed while this call ran
        self.stops = np.full(next_power_of_2(max(1, len(sampling.stop_token_ids))), -1,
                             np.int32)  # int32 [K] stop ids, -1 padded
        self.stops[:len(sampling.stop_token_ids)] = sampling.stop_token_ids
        self.knobs = sampling.as_arrays()
        self.penalised = sampling.repetition_penalty != 1  # decode tracks context tokens
        self.fresh_logits = None  # f32 [B', V] logits of the last prefill (runner.py)
        self.text = text  # text.RowText: decoded outputs, stop strings (None: ids only)

    def packed_context(self, group: int, tokens: Sequence[int]) -> PackedTokens:
        """tokens (group's latest context, then outputs) in the cache's form: only what
        follows that context is converted."""
        packed = self.packed[group]
        n = packed.num_tokens
        return packed if len(tokens) == n else packed.extend(tokens[n:])

    def _enqueue(self, requests) -> None:
        """Queues requests; a group's context is packed once, a later one (an episode's
        next turn) extends the previous."""
        for r in requests:
            if self.share:
                known = r.group in self.packed
                self.packed[r.group] = (self.packed_context(r.group, r.prompt) if known
                                        else PackedTokens.of(r.prompt))
            self.waiting.append(r)

    @property
    def idle(self) -> bool:
        """Nothing queued and no row in a slot."""
        return not self.waiting and all(r is None for r in self.slots)

    @property
    def done(self) -> bool:
        return self.idle and (self.episodes is None or not self.episodes.pending)

    def await_work(self) -> None:
        """Episodes: while only environments are working, waits until one has answered
        (`admit` queues what the answers lead to)."""
        if self.episodes is not None and self.idle and self.episodes.pending:
            self.episodes.wait()

    def on_update(self, weights, drop_kv: bool) -> int:
        """A weight sync to `weights` (the engine's committed value) lands between two
        steps: the run adopts it unless it is at or past its version. drop_kv (kv_policy
        "recompute"): every running row lets go of its pages and will re-prefill its context
        with the new params before its next token; returns the tokens that will be
        recomputed. Otherwise ("keep") rows continue over their old KV (their next tokens
        are flagged mixed). A version the run is already at or past (its own staged one)
        does not concern it."""
        if weights.version <= self.weights.version:
            return 0
        self.weights = weights
        self.updates += 1
        if not drop_kv:
            return 0
        tokens = 0
        for row in self.slots:
            if row is not None and not row.resume:
                self.cache.release(row.pages)
                row.pages, row.resume, row.kv_now = np.zeros(0, np.int32), True, set()
                tokens += len(row.context)
        return tokens

    def admit(self, claims) -> list[tuple[Unit, list[int]]]:
        """Re-prefills rows whose KV an update dropped, then admits waiting samples in order
        while slots and pages allow (one unit per prompt run). claims: this round's
        page_claims.Round (prompt pages of earlier units are shared by later ones).
        Returns (unit, slot of each of its rows) pairs, stamped with `claims.version`."""
        units, budget = [], self.max_prefill_tokens
        version = claims.version
        if self.episodes is not None:  # environments that answered: their next turns
            self._enqueue(self.episodes.ready())
        for slot, row in enumerate(self.slots):
            if row is None or not row.resume:
                continue
            unit = claims.resume(row, budget if units else None)
            if unit is None:
                return units  # what does not fit waits; resumes go before new samples
            row.kv_now = {version}
            row.kv_versions.add(version)
            units.append((unit, [slot]))
            budget -= unit.new_tokens
            self.recomputed += unit.new_tokens
        free = [i for i, r in enumerate(self.slots) if r is None]
        while self.waiting and free and budget > 0:
            first, rows = self.waiting[0], 1
            if self.share:
                while (rows < len(free) and rows < len(self.waiting)
                       and self.waiting[rows].group == first.group):
                    rows += 1
            unit = claims.unit(first, rows, budget if units else None)
            if unit is None:
                break
            for row in unit.rows:
                row.kv_now = {version} | ({unit.kv_version} - {None})
                row.kv_versions = set(row.kv_now)
            for _ in range(len(unit.rows)):
                self.waiting.popleft()
            taken, free = free[:len(unit.rows)], free[len(unit.rows):]
            for slot, row in zip(taken, unit.rows):
                self.slots[slot] = row
            units.append((unit, taken))
            budget -= unit.new_tokens
        return units

    def record_prefill(self, logits, tokens: int) -> None:
        """A packed prefill's result (runner.Runner.prefill): the logits fresh rows start
        decoding from, and the prompt tokens it computed."""
        self.fresh_logits = logits
        self.computed += tokens
        self.prefills += 1

    def record_chunk(self, slots: list, chunk: tuple, steps: int, version: int) -> list[int]:
        """A decode chunk's output (tokens, logprobs, counts, stopped; see apply_chunk)
        stamped with `version`, the version whose params ran it. Returns the slots whose
        rows finished."""
        self.steps += steps
        self.chunks += 1
        return apply_chunk(slots, *chunk, version)

    def release_all(self) -> None:
        """On the way out (success or failure): drop every reference a running row holds;
        environments still working are left to finish on their threads."""
        for i, row in enumerate(self.slots):
            if row is not None:
                self.slots[i] = None
                self.cache.release(row.pages)
        if self.episodes is not None:
            self.episodes.close()
