"""Page claims of one admission round: where a unit's pages are reserved.

A unit pins the cached prefix of its context (the radix trie under the run's namespace,
then the prompt pages earlier units of the same round are prefilling: the round's pending
trie) and allocates fresh pages for its rows' worst case (scheduler.unit_page_need). A
claim that does not fit changes nothing. Prompt pages enter the radix trie (`publish`) only
after the prefill that writes them was dispatched.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from jaxrl_cache.cache import PackedTokens
from jaxrl_cache.errors import CacheFullError
from jaxrl_cache.rollout import scheduler


class Round:
    """The claims of one admission round of `run` (a scheduler.Run) at `version` (the
    step's, under its namespace). Every page a returned unit lists is held by its rows (one
    reference each)."""

    def __init__(self, run: scheduler.Run, version: int):
        self.run, self.cache, self.ps, self.share = run, run.cache, run.ps, run.share
        self.version, self.key = version, run.key_of(version)
        self.pending: dict = {}  # page key -> (page, children): prompt pages being prefilled
        self.trie_tokens = 0  # the longest prefix a unit took from the trie (earlier rounds or
        #   calls of this version): what its prefill would also compute a version later

    def unit(self, first: scheduler.Request, rows: int, budget: int | None
             ) -> scheduler.Unit | None:
        """Up to `rows` requests of first's group from `first` on, all with its prompt (fewer
        if pages are short); None, changing nothing, if not even one fits now or the prefill
        budget of this round is spent (budget None: the round's first unit, always within
        budget)."""
        run, g, prompt = self.run, first.group, first.prompt
        old = first.kv_version if first.kv_version not in (None, self.version) else None
        if old is not None and not (self.share and self.cache.peek(
                run.key_of(old), self._head(g, prompt))):
            old = None  # nothing of that version left: re-prefill under the current one
        got = self._claim(g, prompt, rows, first.max_new, budget,
                          key=None if old is None else run.key_of(old))
        if got is None:
            return None
        matched, fresh, m = got
        unit = scheduler.layout_unit(g, prompt, first.index, matched, fresh, m, first.max_new,
                                     self.ps)
        if old is not None:  # continues over older KV: its pages are never shared
            return dataclasses.replace(unit, kv_version=old)
        prefix = unit.rows[0].pages[:len(prompt) // self.ps]
        if m > 1:  # every row holds one reference to each of its prefix pages
            self.cache.pool.incref(np.tile(prefix, m - 1))
        if self.share:
            self._remember(run.packed[g], prefix)
        return unit

    def resume(self, row: scheduler.Row, budget: int | None) -> scheduler.Unit | None:
        """A one-row unit re-prefilling `row`'s context into a new table (None, changing
        nothing, if it does not fit now)."""
        context = row.context
        got = self._claim(row.group, context, 1, row.max_new - len(row.tokens), budget)
        if got is None:
            return None
        matched, fresh, _ = got
        unit = scheduler.resume_unit(row, matched, fresh, self.ps)
        if self.share:
            self._remember(self.run.packed_context(row.group, context),
                           row.pages[:len(context) // self.ps])
        return unit

    def publish(self, units) -> None:
        """The round's prefill is dispatched: its units' full prompt pages may be shared.
        units: (unit, slots) pairs."""
        if not self.share:
            return
        for unit, _ in units:
            if unit.kv_version is not None:
                continue  # written over another version's KV
            full = len(unit.prompt) // self.ps
            self.cache.insert(self.key, self.run.packed_context(unit.group, unit.prompt),
                              unit.rows[0].pages[:full])

    def _claim(self, group, context, rows, n_new, budget, key=None):
        """Pins the cached prefix of `context` (prompt `group` + outputs; trie under `key`,
        default the run's namespace, then this round's pending prefills) and allocates fresh
        pages for up to `rows` rows generating up to n_new tokens each. Returns (matched
        int32 [c], fresh int32 [f], rows granted) or None, changing nothing."""
        cache, ps = self.cache, self.ps
        head = self._head(group, context)
        current = key is None
        key = self.key if current else key
        in_trie = cache.peek(key, head) if self.share else 0
        extra = self._pending_pages(head, in_trie) if current else np.zeros(0, np.int32)
        cached = (in_trie + extra.size) * ps
        if budget is not None and len(context) - cached > budget:
            return None
        shared, own = scheduler.unit_page_need(len(context), cached, rows, n_new, ps)
        available = cache.pool.num_free  # enough for every row: evictable pages not counted
        if shared + rows * own > available:
            available = cache.available_pages - in_trie  # pinning may take evictable pages
        for m in range(rows, 0, -1):
            shared, own = scheduler.unit_page_need(len(context), cached, m, n_new, ps)
            if shared + m * own <= available:
                break
        else:
            return None
        try:
            matches, fresh = cache.acquire(key, [head] if self.share else [],
                                           shared + m * own)
        except CacheFullError:
            return None
        cache.pool.incref(extra)
        if current:
            self.trie_tokens = max(self.trie_tokens, in_trie * ps)
        matched = np.concatenate([matches[0].pages if matches else np.zeros(0, np.int32),
                                  extra]).astype(np.int32)
        return matched, fresh, m

    def _head(self, group, context):
        """What of `context` may come from the cache: all but its last token (always
        computed: its logits start decode), packed; () without sharing."""
        return (self.run.packed_context(group, context).head(len(context) - 1)
                if self.share else ())

    def _pending_pages(self, head: PackedTokens, skip: int) -> np.ndarray:
        """Pages of head's full pages beyond the first `skip` that earlier units of this round
        are prefilling (not yet in the trie; their rows hold them)."""
        node, extra = self.pending, []
        for i, key in enumerate(self.cache.page_keys(head) if self.share else ()):
            entry = node.get(key)
            if entry is None:
                break
            page, node = entry
            if i >= skip:
                extra.append(page)
        return np.asarray(extra, np.int32)

    def _remember(self, prompt: PackedTokens, pages) -> None:
        """pages int32 [p]: the full pages of `prompt` this round prefills."""
        node = self.pending
        for key, page in zip(self.cache.page_keys(prompt), pages.tolist()):
            node = node.setdefault(key, (page, {}))[1]
