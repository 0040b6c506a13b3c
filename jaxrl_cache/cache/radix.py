"""Version-keyed radix prefix cache over a reference-counted page pool.

Each policy version owns a path-compressed trie: an edge is a run of page-aligned token chunks,
each chunk one physical page of KV computed by that version's params. A lookup at version v
walks only v's trie, so it never returns a page written under another version.

Ownership: the trie holds one reference to each of its pages, a request one to each page it
uses (`acquire` takes them, `release` drops them). A trie page with one reference is "cached",
a page with none free, every other page "in use": free + cached + in use == num_pages - 1.
`insert` may hang a request's pages below cached pages the request does not hold (it continues
past a duplicate prefix), so a cached page is evictable only if no page below it is in use.
Eviction takes the oldest version first, least recently used leaves first within it.

Every method checks its arguments before it commits inside `deferred_signals()`; references
an interrupt leaves handed out are repaired by `reconcile` (the engine runs it after each call).
"""
from __future__ import annotations

import dataclasses
import heapq
import itertools
from typing import Collection, Iterator, NamedTuple, Sequence

import numpy as np

from jaxrl_cache.cache.page_pool import PagePool, as_page_ids, as_page_list
from jaxrl_cache.cache.tokens import PackedTokens, pack_tokens, split_pages
from jaxrl_cache.checks import as_count
from jaxrl_cache.errors import CacheFullError, PinnedPagesError
from jaxrl_cache.interrupts import deferred_signals
from jaxrl_cache.versioning import as_version

Tokens = Sequence[int] | PackedTokens


@dataclasses.dataclass(slots=True, eq=False)
class _Node:
    """One edge of the compressed trie: a run of pages sharing one LRU stamp."""
    key: bytes  # int32 bytes of len(pages) * page_size tokens (b"" at a root)
    pages: list  # list[int] physical page ids, one per page of key
    parent: _Node | None
    version: int
    last_access: int
    children: dict = dataclasses.field(default_factory=dict)  # first page's bytes -> _Node


class Match(NamedTuple):
    pages: np.ndarray  # int32 [n] held pages of the matched prefix, in order (read-only)
    num_tokens: int  # n * page_size


_NO_MATCH = Match(np.zeros(0, np.int32), 0)
_NO_MATCH.pages.flags.writeable = False


@dataclasses.dataclass(frozen=True)
class CacheStats:
    total_pages: int  # usable pages (excludes the null page)
    free_pages: int
    cached_pages: int  # in the trie, referenced by no request
    in_use_pages: int  # referenced by at least one request
    cached_pages_by_version: dict  # version -> pages in its trie (held or not)
    lookups: int
    lookup_tokens: int
    hit_tokens: int
    inserted_pages: int
    evicted_pages: int
    invalidated_pages: int
    invalidations: int

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.lookup_tokens if self.lookup_tokens else 0.0


class RadixCache:
    """Page allocator plus version-keyed prefix trie. Host-side bookkeeping, not thread-safe:
    the engine serialises every call under its lock. Versions are int32 (`as_version`)."""

    def __init__(self, num_pages: int, page_size: int):
        self.page_size = as_count(page_size, "page_size", minimum=1)
        self._page_bytes = 4 * self.page_size
        self.pool = PagePool(num_pages)
        self._in_trie = np.zeros(self.pool.num_pages, bool)  # bool [P] page is in a trie
        self._parent = np.zeros(self.pool.num_pages, np.int32)  # int32 [P] (0 under a root)
        self._roots: dict[int, _Node] = {}  # version -> its trie
        self._clock = itertools.count(1)
        self._counters = dict(lookups=0, lookup_tokens=0, hit_tokens=0, inserted_pages=0,
                              evicted_pages=0, invalidated_pages=0, invalidations=0)

    @property
    def available_pages(self) -> int:
        """Pages `alloc` can hand out now: free + evictable cached."""
        return self.pool.num_free + self.num_evictable

    @property
    def num_evictable(self) -> int:
        """Cached pages eviction can free now."""
        return int(self._evictable().sum())

    def _evictable(self) -> np.ndarray:
        """bool [P]: cached pages with no page in use below them."""
        refcount = self.pool.refcount
        cached = self._in_trie & (refcount == 1)
        up = self._parent[self._in_trie & (refcount > 1)]  # above the pages in use
        while (up := up[cached[up]]).size:  # climb through their cached ancestors
            cached[up] = False
            up = self._parent[up]
        return cached

    def peek(self, version: int, tokens: Tokens) -> int:
        """Pages of the longest cached prefix of `tokens` under `version`; changes nothing."""
        return self._walk(as_version(version), self._full_pages(tokens))[1]

    def match(self, version: int, tokens: Tokens) -> Match:
        """The longest cached prefix of `tokens` under `version`, pages held for the caller."""
        return self.acquire(version, [PackedTokens.of(tokens)], 0)[0][0]

    def alloc(self, n: int) -> np.ndarray:
        """int32 [n] fresh pages (the caller's), evicting cached pages if needed."""
        return self.acquire(0, [], n)[1]

    def acquire(self, version: int, prefixes: Sequence[Tokens],
                n_fresh: int) -> tuple[list[Match], np.ndarray]:
        """`match` of each prefix plus `alloc(n_fresh)` as one step: returns (matches, int32
        [n_fresh] fresh pages). Raises CacheFullError, changing nothing (no lookup counted,
        no LRU stamp), if the pool cannot supply n_fresh pages once the matches are held."""
        version = as_version(version)
        if type(prefixes) not in (list, tuple) and (
                isinstance(prefixes, (str, bytes)) or not isinstance(prefixes, Sequence)):
            raise TypeError(f"prefixes must be a sequence of token-id sequences, got "
                            f"{type(prefixes).__name__}")
        packed = [PackedTokens.of(p, f"prefixes[{i}]") for i, p in enumerate(prefixes)]
        n_fresh = as_count(n_fresh, "n_fresh")
        data = [self._full_pages(p) for p in packed]
        walks = [self._walk(version, d) for d in data]
        matches = [self._match_of(path, n) for path, n, _ in walks]
        pool, held = self.pool, [page for m in matches for page in m.pages.tolist()]
        if n_fresh > pool.num_free:  # only then may holding the matched pages matter
            evictable = self._evictable()
            evictable = int(evictable.sum()) - len({page for page in held if evictable[page]})
            if n_fresh > pool.num_free + evictable:
                raise CacheFullError(
                    f"need {n_fresh} KV pages but only {pool.num_free + evictable} can be made "
                    f"available ({pool.num_free} free + {evictable} evictable cached; "
                    f"{pool.num_pages - 1} total). Use a larger pool or a smaller batch.")
        with deferred_signals():
            now = next(self._clock)
            for i, walk in enumerate(walks):  # an earlier prefix may have split this path
                self._touch(*(self._walk(version, data[i]) if i and walk[0] else walk), now)
            if held:  # before evicting: a held page is not evictable
                pool.incref(held)
            if n_fresh > pool.num_free:
                self._evict(n_fresh - pool.num_free)
            fresh = pool.take(n_fresh)
            counters = self._counters
            counters["lookups"] += len(packed)
            counters["lookup_tokens"] += sum(map(len, packed)) >> 2
            counters["hit_tokens"] += sum(m.num_tokens for m in matches)
        return matches, fresh

    def release(self, pages: np.ndarray) -> None:
        """pages int32 [n]: drops the caller's reference to each (from alloc or match;
        repeats allowed). Raises ValueError, changing nothing, if one was not held."""
        self.pool.decref(pages)

    def evict(self, n: int) -> int:
        """Frees up to n evictable cached pages, in eviction order; returns how many."""
        n = as_count(n, "n")
        with deferred_signals():
            return self._evict(n)

    def _evict(self, n: int) -> int:
        def leaf(node):  # heap entry: the oldest version first, then least recently used
            return node.version, node.last_access, id(node), node

        ref, size = self.pool.refcount, self._page_bytes
        leaves = [leaf(node) for node in self._nodes(*self._roots)
                  if not node.children and ref[node.pages[-1]] == 1]
        heapq.heapify(leaves)
        evicted = []
        while leaves and len(evicted) < n:
            node = heapq.heappop(leaves)[-1]
            pages = node.pages
            keep = len(pages)
            while keep and len(evicted) < n and ref[pages[keep - 1]] == 1:
                keep -= 1
                evicted.append(pages[keep])
            if keep:
                del pages[keep:]
                node.key = node.key[:keep * size]
                continue
            parent = node.parent
            del parent.children[node.key[:size]]
            if parent.pages and not parent.children and ref[parent.pages[-1]] == 1:
                heapq.heappush(leaves, leaf(parent))
        self._in_trie[evicted] = False
        self.pool.decref(evicted)
        self._counters["evicted_pages"] += len(evicted)
        return len(evicted)

    def page_keys(self, tokens: Tokens, name: str = "tokens") -> tuple[bytes, ...]:
        """Hashable key of each full page of `tokens`: its int32 bytes."""
        return split_pages(self._full_pages(tokens, name), self._page_bytes)

    def _full_pages(self, tokens: Tokens, name: str = "tokens") -> bytes:
        """int32 bytes of the full pages of `tokens` (a PackedTokens is taken as it is)."""
        data = tokens if type(tokens) is PackedTokens else pack_tokens(tokens, name)
        return data[:len(data) - len(data) % self._page_bytes]

    def _nodes(self, *versions: int) -> Iterator[_Node]:
        """Every node of these versions' tries below the roots, parents before children."""
        stack = [node for v in versions for node in self._roots[v].children.values()]
        while stack:
            node = stack.pop()
            stack += node.children.values()
            yield node

    def _walk(self, version: int, data: bytes) -> tuple[list[_Node], int, int]:
        """(nodes, n, start): the longest cached prefix of the full pages `data` under
        `version` is n pages, held by `nodes` in order, the last possibly only in part, whose
        key begins at byte `start` of data. Changes nothing."""
        node, path, start, done = self._roots.get(version), [], 0, 0
        size, end = self._page_bytes, len(data)
        while node and done < end and (child := node.children.get(data[done:done + size])):
            path.append(child)
            start, key = done, child.key
            if data.startswith(key, start):
                node, done = child, start + len(key)
                continue
            done += size  # children are keyed by their first page; count the others
            while done < end and data.startswith(key[done - start:done - start + size], done):
                done += size
            break
        return path, done // size, start

    def _match_of(self, path: list[_Node], n: int) -> Match:
        """The Match of a walk (see `_walk`): its first n pages."""
        if not n:
            return _NO_MATCH
        pages = np.array([page for node in path for page in node.pages][:n], np.int32)
        pages.flags.writeable = False
        return Match(pages, n * self.page_size)

    def _touch(self, path: list[_Node], n: int, start: int, now: int) -> None:
        """(Inside a commit.) Stamps the nodes of a walk (see `_walk`) with `now`, first
        splitting the last where the walk ends inside it: its other pages become its only
        child, inheriting its children and old stamp. The trie's meaning is unchanged."""
        node, keep = (path or [None])[-1], n - start // self._page_bytes
        if node is not None and keep < len(node.pages):
            cut = keep * self._page_bytes
            tail = _Node(node.key[cut:], node.pages[keep:], node, node.version,
                         node.last_access, node.children)
            node.children = {tail.key[:self._page_bytes]: tail}
            for child in tail.children.values():
                child.parent = tail
            node.key = node.key[:cut]
            del node.pages[keep:]
        for node in path:
            node.last_access = now

    def insert(self, version: int, tokens: Tokens, pages: np.ndarray, *,
               release: np.ndarray | None = None) -> int:
        """Records the full pages of `tokens` (KV written by `version`); returns how many
        pages the trie took. pages int32 [>= len(tokens) // page_size] in order; those past
        the cached prefix must be held by the caller. Chunks already cached stay as they are
        (a duplicate page stays the caller's) and insertion continues below them: a duplicate
        holds the same KV, so what follows is the same whichever copy it was computed against.
        release int32 [m]: then drops these references as `release` does, in the same step
        (a request finishing); if one is not held, raises with nothing inserted."""
        version = as_version(version)
        data = self._full_pages(tokens)
        size, num_pages = self._page_bytes, self.pool.num_pages
        full = len(data) // size
        if type(pages) is not np.ndarray or pages.ndim != 1 or pages.dtype.kind != "i":
            pages = as_page_ids(pages, num_pages)
        if len(pages) < full:
            raise ValueError(f"{full} full pages of tokens but only {len(pages)} pages")
        path, n, start = self._walk(version, data)
        new_pages = as_page_list(pages[n:full], num_pages)  # the only pages the trie reads
        in_trie = self._in_trie  # a few pages: numpy scalars cost less than fancy indexing
        if len(set(new_pages)) < len(new_pages) or any(in_trie[page] for page in new_pages):
            raise ValueError(f"pages {new_pages} include one already cached under another "
                             f"prefix or listed twice")
        with deferred_signals():
            if new_pages:  # the trie's references first (raises if the caller holds none)
                self.pool.incref(new_pages)
            if release is not None:
                try:
                    self.pool.decref(release, "release")
                except (TypeError, ValueError):  # changed nothing: undo the trie's references
                    self.pool.decref(new_pages)
                    raise
            if version not in self._roots:
                self._roots[version] = _Node(b"", [], None, version, 0)
            self._touch(path, n, start, now := next(self._clock))
            if new_pages:
                parent = path[-1] if path else self._roots[version]
                child = _Node(data[n * size:], new_pages, parent, version, now)
                parent.children[data[n * size:(n + 1) * size]] = child
                above = (parent.pages or [0])[-1]
                for page in new_pages:
                    in_trie[page], self._parent[page], above = True, above, page
                self._counters["inserted_pages"] += len(new_pages)
        return len(new_pages)

    def invalidate_before(self, version: int, *, held: bool = False) -> int:
        """Drops every entry of versions < `version` and frees their pages; returns how many.
        If a live request holds one of those pages, raises PinnedPagesError, changing nothing
        (stale KV never stays reachable behind a success); held=True: such pages leave the
        trie and stay with their holders until released (the engine's kv_policy "keep")."""
        version = as_version(version)
        return self._drop([v for v in self._roots if v < version], f"before {version}",
                          held=held)

    def clear(self) -> int:
        """Drops every version's entries (used after the KV pool itself was lost)."""
        return self._drop(list(self._roots), "(clear)")

    def _drop(self, stale: list[int], what: str, held: bool = False) -> int:
        if not stale:
            return 0
        pages = np.array([p for node in self._nodes(*stale) for p in node.pages], np.int32)
        in_use = pages[self.pool.refcount[pages] > 1]
        if in_use.size and not held:
            raise PinnedPagesError(
                f"cannot invalidate versions {sorted(stale)} {what}: "
                f"{in_use.size} of their {pages.size} pages are held by live requests")
        with deferred_signals():  # pages in use that leave the trie stay with their holders
            for v in stale:
                del self._roots[v]
            self._in_trie[pages] = False
            self.pool.decref(pages)
            self._counters["invalidated_pages"] += int(pages.size)
            self._counters["invalidations"] += 1
        return int(pages.size)

    def reconcile(self, keep_versions: Collection[int]) -> None:
        """For a quiescent cache (no request holds a page): drops every version not in
        `keep_versions` and rebuilds the pool from the trie (refcount 1 per trie page, every
        other page free). Repairs whatever an interrupted caller left behind."""
        if isinstance(keep_versions, (str, bytes)) or not isinstance(keep_versions, Collection):
            raise TypeError(f"keep_versions must be a collection of versions, got "
                            f"{type(keep_versions).__name__} {keep_versions!r:.80}")
        keep = {as_version(v, "keep_versions") for v in keep_versions}
        with deferred_signals():
            for v in [v for v in self._roots if v not in keep]:
                self._in_trie[[p for node in self._nodes(v) for p in node.pages]] = False
                del self._roots[v]
            self.pool.reset(self._in_trie)

    def versions(self) -> list[int]:
        return sorted(self._roots)

    def page_entries(self) -> list[tuple[int, int, int, bytes, int]]:
        """(version, page, parent page (0 under a root), page key, LRU stamp) of every
        cached page, sorted: the trie's meaning, whatever runs of pages its nodes hold."""
        size, out = self._page_bytes, []
        for v in self._roots:
            for node in self._nodes(v):
                above = node.parent.pages[-1] if node.parent.pages else 0
                for i, page in enumerate(node.pages):
                    out.append((v, page, above, node.key[i * size:(i + 1) * size],
                                node.last_access))
                    above = page
        return sorted(out)

    def stats(self) -> CacheStats:
        ref, trie = self.pool.refcount[1:], self._in_trie[1:]
        cached = int((trie & (ref == 1)).sum())
        by_version = {v: sum(len(node.pages) for node in self._nodes(v))
                      for v in sorted(self._roots)}
        return CacheStats(total_pages=self.pool.num_pages - 1, free_pages=self.pool.num_free,
                          cached_pages=cached, in_use_pages=int((ref > 0).sum()) - cached,
                          cached_pages_by_version=by_version, **self._counters)

    def check_invariants(self) -> None:
        """Raises AssertionError if page accounting or trie structure is inconsistent."""
        self.pool.check_invariants()
        ref, size = self.pool.refcount, self._page_bytes
        for v in self._roots:
            for node in self._nodes(v):
                assert node.version == v and len(node.key) == size * len(node.pages) > 0
                assert node.parent.children[node.key[:size]] is node, "parent link broken"
        entries = self.page_entries()
        above = {page: up for _, page, up, _, _ in entries}  # from the nodes, not _parent
        assert len(above) == len(entries), "page in the trie twice"
        assert set(above) == set(np.flatnonzero(self._in_trie).tolist()), "trie index stale"
        assert all(self._parent[p] == up for p, up in above.items()), "parent index stale"
        assert (ref[list(above)] >= 1).all(), "trie page without its reference"
        blocked = set()  # pages in use and every page above one
        for page in above:
            if ref[page] > 1:
                while page and page not in blocked:
                    blocked.add(page)
                    page = above[page]
        assert self.num_evictable == sum(ref[p] == 1 and p not in blocked for p in above)
