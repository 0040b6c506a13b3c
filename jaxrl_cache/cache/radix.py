"""Version-keyed radix prefix cache over a reference-counted page pool.

Each policy version owns a separate trie whose edges are page-aligned token chunks and whose
nodes each own one physical page of KV computed by that version's params. A lookup at
version v walks only v's trie, so it can never return a page written under another version.

Ownership: the trie holds one reference to each of its pages, every request one reference to
each page it uses. A trie page with refcount 1 is "cached" (evictable); a page with refcount 0
is free; every other page is "in use". Always: free + cached + in use == num_pages - 1.
A request pins the whole path it matched and inserts only below pages it holds, so a pinned
node's ancestors are pinned too and every cached page can be evicted leaf-first.
"""
from __future__ import annotations

import dataclasses
import heapq
import itertools
from typing import Sequence

import numpy as np

from jaxrl_cache.errors import CacheFullError, PinnedPagesError
from jaxrl_cache.cache.page_pool import PagePool


class _Node:
    __slots__ = ("chunk", "page", "parent", "children", "last_access", "version")

    def __init__(self, chunk, page, parent, version):
        self.chunk = chunk  # page key: int32 bytes of page_size token ids (None at a root)
        self.page = page  # physical page id (0 at a root)
        self.parent = parent
        self.children: dict[tuple, _Node] = {}
        self.last_access = 0
        self.version = version


@dataclasses.dataclass(frozen=True)
class Match:
    pages: np.ndarray  # int32 [n] pinned pages of the matched prefix, in order
    num_tokens: int  # n * page_size


@dataclasses.dataclass(frozen=True)
class CacheStats:
    total_pages: int  # usable pages (excludes the null page)
    free_pages: int
    cached_pages: int  # in the trie, referenced by no request (evictable)
    in_use_pages: int  # referenced by at least one request
    cached_pages_by_version: dict  # version -> pages in its trie (pinned or not)
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
    the engine serialises every call under its lock."""

    def __init__(self, num_pages: int, page_size: int):
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.page_size = page_size
        self.pool = PagePool(num_pages)
        self._in_trie = np.zeros(num_pages, bool)  # [P]
        self._roots: dict[int, _Node] = {}
        self._nodes: dict[int, dict[int, _Node]] = {}  # version -> page -> node
        self._clock = itertools.count(1)
        self._counters = dict(lookups=0, lookup_tokens=0, hit_tokens=0, inserted_pages=0,
                              evicted_pages=0, invalidated_pages=0, invalidations=0)

    # ---------------------------------------------------------------- allocation
    @property
    def available_pages(self) -> int:
        """Pages `alloc` can hand out now: free + evictable cached."""
        return self.pool.num_free + self.num_evictable

    @property
    def num_evictable(self) -> int:
        return int((self._in_trie & (self.pool.refcount == 1)).sum())

    def alloc(self, n: int) -> np.ndarray:
        """n fresh pages (refcount 1, owned by the caller), evicting cached pages LRU
        leaf-first if needed. Raises CacheFullError and changes nothing if impossible."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} pages")
        available = self.pool.num_free + self.num_evictable
        if n > available:
            raise CacheFullError(
                f"need {n} KV pages but only {available} can be made available "
                f"({self.pool.num_free} free + {self.num_evictable} evictable cached; "
                f"{self.pool.num_pages - 1} total). Use a larger pool or a smaller batch.")
        if n > self.pool.num_free:
            self.evict(n - self.pool.num_free)
        return self.pool.take(n)

    def release(self, pages: np.ndarray) -> None:
        """Drops the caller's reference to each page (from alloc or match)."""
        self.pool.decref(np.asarray(pages, np.int32))

    def evict(self, n: int) -> int:
        """Frees up to n unpinned cached pages, least recently used leaves first."""
        leaves = [(node.last_access, id(node), node) for nodes in self._nodes.values()
                  for node in nodes.values()
                  if not node.children and self.pool.refcount[node.page] == 1]
        heapq.heapify(leaves)
        evicted = []
        while leaves and len(evicted) < n:
            _, _, node = heapq.heappop(leaves)
            self._detach(node)
            evicted.append(node.page)
            parent = node.parent
            if (parent.chunk is not None and not parent.children
                    and self.pool.refcount[parent.page] == 1):
                heapq.heappush(leaves, (parent.last_access, id(parent), parent))
        pages = np.asarray(evicted, np.int32)
        self._in_trie[pages] = False
        self.pool.decref(pages, distinct=True)
        self._counters["evicted_pages"] += len(evicted)
        return len(evicted)

    def _detach(self, node: _Node) -> None:
        del node.parent.children[node.chunk]
        del self._nodes[node.version][node.page]

    # ---------------------------------------------------------------- prefix trie
    def page_keys(self, tokens: Sequence[int]) -> list[bytes]:
        """Hashable key of each full page of `tokens` (its int32 bytes), built in one pass:
        no per-token Python work."""
        ps = self.page_size
        data = np.asarray(tokens, np.int32).tobytes()
        step = 4 * ps
        return [data[i:i + step] for i in range(0, len(data) - step + 1, step)]

    def match(self, version: int, tokens: Sequence[int]) -> Match:
        """Longest cached page-aligned prefix of `tokens` under `version`, pinned for the
        caller (release the returned pages when done)."""
        node = self._roots.get(version)
        pages = []
        now = next(self._clock)
        if node is not None:
            for chunk in self.page_keys(tokens):
                node = node.children.get(chunk)
                if node is None:
                    break
                node.last_access = now
                pages.append(node.page)
        pages = np.asarray(pages, np.int32)
        self.pool.incref(pages)
        self._counters["lookups"] += 1
        self._counters["lookup_tokens"] += len(tokens)
        self._counters["hit_tokens"] += pages.size * self.page_size
        return Match(pages, int(pages.size) * self.page_size)

    def insert(self, version: int, tokens: Sequence[int], pages: np.ndarray) -> int:
        """Records the full pages of `tokens` (KV written by `version`) held by the caller.

        pages [len(tokens) // page_size] in order. Chunks already cached are left as they
        are (a duplicate page stays the caller's and is freed on release) and insertion
        continues below them: the duplicate holds the same tokens' KV under the same version.
        Returns how many pages the trie took.
        """
        chunks = self.page_keys(tokens)
        pages = np.asarray(pages, np.int32)
        if pages.shape[0] < len(chunks):
            raise ValueError(f"{len(chunks)} full pages of tokens but only {pages.shape[0]} pages")
        if version not in self._roots:
            self._roots[version] = _Node(None, 0, None, version)
            self._nodes[version] = {}
        node = self._roots[version]
        now = next(self._clock)
        taken = []
        for chunk, page in zip(chunks, pages.tolist()):
            child = node.children.get(chunk)
            if child is None:
                if self._in_trie[page]:
                    raise ValueError(f"page {page} is already cached under another prefix")
                child = _Node(chunk, page, node, version)
                node.children[chunk] = child
                self._nodes[version][page] = child
                self._in_trie[page] = True
                taken.append(page)
            child.last_access = now
            node = child
        self.pool.incref(np.asarray(taken, np.int32))
        self._counters["inserted_pages"] += len(taken)
        return len(taken)

    def invalidate_before(self, version: int) -> int:
        """Drops every entry of versions < `version` and frees their pages; returns how many.

        If a live request still holds any of those pages, raises PinnedPagesError and
        changes nothing: stale KV must never stay reachable behind a reported success.
        """
        stale = [v for v in self._roots if v < version]
        if not stale:
            return 0
        pages = np.fromiter((p for v in stale for p in self._nodes[v]), np.int32)
        pinned = pages[self.pool.refcount[pages] > 1]
        if pinned.size:
            raise PinnedPagesError(
                f"cannot invalidate versions {sorted(stale)} before {version}: "
                f"{pinned.size} of their {pages.size} pages are held by live requests")
        for v in stale:
            del self._roots[v], self._nodes[v]
        self._in_trie[pages] = False
        self.pool.decref(pages, distinct=True)
        self._counters["invalidated_pages"] += int(pages.size)
        self._counters["invalidations"] += 1
        return int(pages.size)

    def clear(self) -> int:
        """Drops every version's entries (used after the KV pool itself was lost)."""
        return self.invalidate_before(max(self._roots, default=-1) + 1)

    def reconcile(self, keep_version: int) -> None:
        """For a quiescent cache (no request holds a page): drops every namespace but
        `keep_version` and rebuilds the pool from the trie (refcount 1 per trie page, all
        others free). Repairs whatever an interrupted caller left behind."""
        for v in [v for v in self._roots if v != keep_version]:
            for page in self._nodes[v]:
                self._in_trie[page] = False
            del self._roots[v], self._nodes[v]
        self.pool.reset(self._in_trie)

    # ---------------------------------------------------------------- introspection
    def versions(self) -> list[int]:
        return sorted(self._roots)

    def stats(self) -> CacheStats:
        ref = self.pool.refcount[1:]
        trie = self._in_trie[1:]
        cached = int((trie & (ref == 1)).sum())
        return CacheStats(
            total_pages=self.pool.num_pages - 1,
            free_pages=self.pool.num_free,
            cached_pages=cached,
            in_use_pages=int((ref > 0).sum()) - cached,
            cached_pages_by_version={v: len(n) for v, n in sorted(self._nodes.items())},
            **self._counters)

    def check_invariants(self) -> None:
        """Raises AssertionError if page accounting or trie structure is inconsistent."""
        ref = self.pool.refcount
        assert ref[0] == 0, "null page was handed out"
        assert (ref >= 0).all(), "negative refcount"
        free = self.pool._free[:self.pool.num_free]
        assert len(set(free.tolist())) == free.size, "page on the free list twice"
        assert (ref[free] == 0).all() and not self._in_trie[free].any(), "free page in use"
        assert self.pool.num_free == int((ref[1:] == 0).sum()), "page leaked"
        s = self.stats()
        assert s.free_pages + s.cached_pages + s.in_use_pages == s.total_pages
        seen = set()
        for v, nodes in self._nodes.items():
            for page, node in nodes.items():
                assert node.version == v and node.page == page
                assert page not in seen, f"page {page} in the trie twice"
                seen.add(page)
                assert ref[page] >= 1 and self._in_trie[page]
                if ref[page] > 1 and node.parent.chunk is not None:
                    assert ref[node.parent.page] > 1, "pinned page under an unpinned parent"
        assert seen == set(np.flatnonzero(self._in_trie).tolist())
