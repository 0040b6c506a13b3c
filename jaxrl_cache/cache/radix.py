"""Version-keyed radix prefix cache over a reference-counted page pool.

Each policy version owns a separate trie whose edges are page-aligned token chunks and whose
nodes each own one physical page of KV computed by that version's params. A lookup at
version v walks only v's trie, so it can never return a page written under another version.

Ownership: the trie holds one reference to each of its pages, every request one reference to
each page it uses. A trie page with refcount 1 is "cached" (evictable); a page with refcount 0
is free; every other page is "in use". Always: free + cached + in use == num_pages - 1.
A request pins the whole path it matched. `insert` may hang a request's pages below cached
nodes the request does not hold (it continues past a duplicate prefix); such an ancestor
cannot be evicted while a page below it is pinned, so `num_evictable` (what `alloc` may
evict, leaf-first) counts only cached pages with no pinned page below them.

Interrupt safety: every method checks all of its arguments and plans its change first (any
error is raised with nothing changed), then applies it inside `deferred_signals()`, so a
KeyboardInterrupt or SIGTERM handler never sees half an update. A call that hands references
to the caller (`match`, `acquire`, `alloc`) records them in the caller's `Lease` inside that
same step, so no interrupt can fall between taking a reference and recording who holds it;
`release(lease)` gives them all back at once.
"""
from __future__ import annotations

import array
import collections
import dataclasses
import functools
import heapq
import itertools
import struct
from typing import Sequence

import numpy as np

from jaxrl_cache.cache.page_pool import PagePool, as_page_ids, as_page_list
from jaxrl_cache.checks import as_count
from jaxrl_cache.errors import CacheFullError, PinnedPagesError
from jaxrl_cache.interrupts import deferred_signals
from jaxrl_cache.versioning import as_version


@functools.lru_cache(maxsize=4096)
def _pages_format(n: int, size: int) -> struct.Struct:
    """Splits the first n * size bytes into n bytes objects of `size` in one C call."""
    return struct.Struct(f"{size}s" * n)


class _Node:
    __slots__ = ("chunk", "page", "parent", "children", "last_access", "version")

    def __init__(self, chunk, page, parent, version, last_access):
        self.chunk = chunk  # page key: int32 bytes of its page_size tokens (None at a root)
        self.page = page  # physical page id (0 at a root)
        self.parent = parent
        self.children: dict[bytes, _Node] = {}
        self.last_access = last_access
        self.version = version


@dataclasses.dataclass(frozen=True)
class Match:
    pages: np.ndarray  # int32 [n] pinned pages of the matched prefix, in order
    num_tokens: int  # n * page_size


class Lease:
    """The page references one caller holds. Cache calls given a lease add what they hand out
    to it in the same atomic step; `RadixCache.release(lease)` returns them all and empties it
    (releasing an empty lease does nothing, so a retried cleanup is harmless)."""
    __slots__ = ("_parts",)

    def __init__(self):
        self._parts: tuple = ()  # int32 arrays; the tuple is replaced, never mutated

    @property
    def pages(self) -> np.ndarray:
        """int32 [n] every reference held (a page appears once per reference)."""
        return np.concatenate(self._parts) if self._parts else np.zeros(0, np.int32)

    def __len__(self) -> int:
        return sum(p.size for p in self._parts)


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
    the engine serialises every call under its lock. Versions are bounded like every policy
    version (`as_version`: int32 range)."""

    def __init__(self, num_pages: int, page_size: int):
        self.page_size = as_count(page_size, "page_size", minimum=1)
        self.pool = PagePool(num_pages)
        # [P] bool and [P] int32 (trie parent page, 0 under a root), each also as a Python
        # buffer over the same memory for the per-request path (see PagePool._ref)
        self._trie = bytearray(self.pool.num_pages)
        self._in_trie = np.frombuffer(self._trie, bool)
        self._parents = array.array("i", bytes(4 * self.pool.num_pages))
        self._parent = np.frombuffer(self._parents, np.int32)
        self._roots: dict[int, _Node] = {}
        self._nodes: dict[int, dict[int, _Node]] = {}  # version -> page -> node
        self._clock = itertools.count(1)
        self._last_keys: tuple = (None, ())  # (tuple of tokens, its page_keys): peek, acquire
        self._trie_epoch = 0  # bumped by every change of any trie's nodes
        self._last_walk: tuple = (None, 0, -1, [])  # (chunks, version, epoch, path)
        self._counters = dict(lookups=0, lookup_tokens=0, hit_tokens=0, inserted_pages=0,
                              evicted_pages=0, invalidated_pages=0, invalidations=0)

    # ---------------------------------------------------------------- allocation
    @property
    def available_pages(self) -> int:
        """Pages `alloc` can hand out now: free + evictable cached."""
        return self.pool.num_free + self.num_evictable

    def peek(self, version: int, tokens: Sequence[int]) -> int:
        """Pages of the longest cached prefix of `tokens` under `version`; changes nothing
        (no pin, no lookup counted, no LRU stamp)."""
        return len(self._walk(as_version(version), self.page_keys(tokens)))

    @property
    def num_evictable(self) -> int:
        """Cached pages eviction can free now."""
        return int(self._evictable().sum())

    def _evictable(self) -> np.ndarray:
        """bool [P]: cached pages (trie only) with no pinned page below them. A pinned page
        sits under a cached one only where `insert` continued past a duplicate prefix."""
        cached = self._in_trie & (self.pool.refcount == 1)
        up = self._parent[self._in_trie & (self.pool.refcount > 1)]
        up = up[cached[up]]
        while up.size:  # climb through cached ancestors; a pinned one has its own entry
            cached[up] = False
            up = self._parent[up]
            up = up[cached[up]]
        return cached

    def alloc(self, n: int, *, lease: Lease | None = None) -> np.ndarray:
        """n fresh pages (refcount 1, owned by the caller), evicting cached pages LRU
        leaf-first if needed. Raises CacheFullError and changes nothing if impossible."""
        return self._acquire(0, [], [], as_count(n, "n"), lease)[1]

    def acquire(self, version: int, prefixes: Sequence[Sequence[int]], n_fresh: int, *,
                lease: Lease | None = None) -> tuple[list[Match], np.ndarray]:
        """`match` of each prefix plus `alloc(n_fresh)` as one step: returns (matches, fresh
        pages). If the pool cannot supply n_fresh pages once the matched paths are pinned,
        raises CacheFullError having changed nothing (no lookup counted, no LRU stamp)."""
        version = as_version(version)
        if type(prefixes) not in (list, tuple) and (
                isinstance(prefixes, (str, bytes)) or not isinstance(prefixes, Sequence)):
            raise TypeError(f"prefixes must be a sequence of token-id sequences, got "
                            f"{type(prefixes).__name__}")
        chunked = [self.page_keys(p, f"prefixes[{i}]") for i, p in enumerate(prefixes)]
        return self._acquire(version, chunked, [len(p) for p in prefixes],
                             as_count(n_fresh, "n_fresh"), lease)

    def _acquire(self, version: int, chunked: list[list[bytes]], lookup_tokens: list[int],
                 n_fresh: int, lease: Lease | None) -> tuple[list[Match], np.ndarray]:
        if lease is not None and not isinstance(lease, Lease):
            raise TypeError(f"lease must be a Lease or None, got {type(lease).__name__}")
        paths = [self._walk(version, chunks) for chunks in chunked]
        ids = [[node.page for node in path] for path in paths]
        matched = [np.array(pages, np.int32) for pages in ids]
        if n_fresh > self.pool._num_free:  # only then may pinning the paths matter
            pinned = np.concatenate(matched) if matched else np.zeros(0, np.int32)
            evictable = self._evictable()
            evictable = int(evictable.sum()) - np.unique(pinned[evictable[pinned]]).size
            if n_fresh > self.pool.num_free + evictable:
                raise CacheFullError(
                    f"need {n_fresh} KV pages but only {self.pool.num_free + evictable} can be "
                    f"made available ({self.pool.num_free} free + {evictable} evictable "
                    f"cached; {self.pool.num_pages - 1} total). Use a larger pool or a "
                    f"smaller batch.")
        with deferred_signals():
            now, ref = next(self._clock), self.pool._ref
            for path, pages in zip(paths, ids):
                for node in path:
                    node.last_access = now
                for page in pages:
                    ref[page] += 1
            if n_fresh > self.pool._num_free:
                self._evict(n_fresh - self.pool._num_free)
            fresh = self.pool._take(n_fresh)
            self._counters["lookups"] += len(chunked)
            self._counters["lookup_tokens"] += sum(lookup_tokens)
            self._counters["hit_tokens"] += sum(map(len, paths)) * self.page_size
            if lease is not None:
                lease._parts = lease._parts + tuple(matched) + (fresh,)
        return [Match(m, int(m.size) * self.page_size) for m in matched], fresh

    def release(self, pages: np.ndarray | Lease) -> None:
        """Drops the caller's reference to each page (from alloc or match), or every
        reference a lease holds (then empties it)."""
        if isinstance(pages, Lease):
            lease, pages = pages, [p for part in pages._parts for p in part.tolist()]
        else:
            lease, pages = None, as_page_list(pages, self.pool.num_pages)
        ref = self.pool._ref
        if len(set(pages)) == len(pages):  # the usual case
            held = not pages or min(map(ref.__getitem__, pages)) >= 1
        else:
            held = all(ref[p] >= n for p, n in collections.Counter(pages).items())
        if not held:
            raise ValueError(f"released pages that were not held: {pages}")
        with deferred_signals():
            self.pool._decref_list(pages)
            if lease is not None:
                lease._parts = ()

    def evict(self, n: int) -> int:
        """Frees up to n unpinned cached pages, least recently used leaves first."""
        n = as_count(n, "n")
        with deferred_signals():
            return self._evict(n)

    def _evict(self, n: int) -> int:
        leaves = [(node.last_access, id(node), node) for nodes in self._nodes.values()
                  for node in nodes.values()
                  if not node.children and self.pool.refcount[node.page] == 1]
        heapq.heapify(leaves)
        evicted = []
        while leaves and len(evicted) < n:
            _, _, node = heapq.heappop(leaves)
            del node.parent.children[node.chunk]
            del self._nodes[node.version][node.page]
            evicted.append(node.page)
            parent = node.parent
            if (parent.chunk is not None and not parent.children
                    and self.pool.refcount[parent.page] == 1):
                heapq.heappush(leaves, (parent.last_access, id(parent), parent))
        pages = np.asarray(evicted, np.int32)
        self._trie_epoch += 1
        self._in_trie[pages] = False
        self.pool._decref(pages, 1)
        self._counters["evicted_pages"] += len(evicted)
        return len(evicted)

    # ---------------------------------------------------------------- prefix trie
    def page_keys(self, tokens: Sequence[int], name: str = "tokens") -> tuple[bytes, ...]:
        """Hashable key of each full page of `tokens`: its int32 bytes, built in one C-level
        pass (no per-token Python work). Token ids must be integers in [0, 2**31) (a
        sequence of bools is refused, as numpy types it bool)."""
        if type(tokens) is tuple and tokens is self._last_keys[0]:
            return self._last_keys[1]  # immutable and still referenced: same tokens
        if (type(tokens) in (list, tuple) and tokens
                and not isinstance(tokens[0], (bool, np.bool_))):
            try:  # "<I" refuses non-integers, negatives and >= 2**32; the top bytes the rest
                data = struct.pack(f"<{len(tokens)}I", *tokens)
            except Exception:  # the numpy path below names what is wrong
                data = b"\xff" * 4
            if data[3::4].isascii():
                keys = self._split_pages(data)
                if type(tokens) is tuple:
                    self._last_keys = (tokens, keys)
                return keys
        if isinstance(tokens, (str, bytes)) or not isinstance(tokens, (Sequence, np.ndarray)):
            raise TypeError(f"{name} must be a sequence of integer token ids, got "
                            f"{type(tokens).__name__} {tokens!r:.80}")
        arr = np.asarray(tokens)
        if arr.size and (arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer)):
            raise TypeError(f"{name} must be a 1-D sequence of integer token ids, got "
                            f"{tokens!r:.80}")
        if arr.size and (arr.min() < 0 or arr.max() > 2**31 - 1):
            raise ValueError(f"{name}: token ids must be in [0, 2**31), got {tokens!r:.80}")
        return self._split_pages(arr.astype("<i4").tobytes())

    def _split_pages(self, data: bytes) -> tuple[bytes, ...]:
        return _pages_format(len(data) // (4 * self.page_size), 4 * self.page_size).unpack_from(
            data)

    def _walk(self, version: int, chunks: tuple[bytes, ...]) -> list[_Node]:
        """The nodes of the longest cached prefix of `chunks` under `version` (no change).
        While the trie is unchanged the last walk is reused (peek then acquire) or continued
        (acquire of a prompt, then insert of prompt + output)."""
        last, path = self._last_walk, []
        if last[1] == version and last[2] == self._trie_epoch:
            if last[0] is chunks:
                return last[3]
            done = len(last[0])  # the last walk's keys, all cached, prefix these: go on
            if len(last[3]) == done and chunks[:done] == last[0]:
                path = list(last[3])
        node = path[-1] if path else self._roots.get(version)
        for chunk in chunks[len(path):] if node is not None else ():
            node = node.children.get(chunk)
            if node is None:
                break
            path.append(node)
        self._last_walk = (chunks, version, self._trie_epoch, path)
        return path

    def match(self, version: int, tokens: Sequence[int], *,
              lease: Lease | None = None) -> Match:
        """Longest cached page-aligned prefix of `tokens` under `version`, pinned for the
        caller (release the returned pages, or the lease, when done)."""
        version = as_version(version)
        return self._acquire(version, [self.page_keys(tokens)], [len(tokens)], 0, lease)[0][0]

    def insert(self, version: int, tokens: Sequence[int], pages: np.ndarray) -> int:
        """Records the full pages of `tokens` (KV written by `version`) held by the caller.

        pages [>= len(tokens) // page_size] in order. Chunks already cached are left as they
        are (a duplicate page stays the caller's and is freed on release) and insertion
        continues below them: a duplicate holds the same tokens' KV under the same version,
        so what follows is the same whichever copy it was computed against. Returns how many
        pages the trie took.
        """
        version = as_version(version)
        chunks = self.page_keys(tokens)
        pages = as_page_list(pages, self.pool.num_pages)
        if len(pages) < len(chunks):
            raise ValueError(f"{len(chunks)} full pages of tokens but only {len(pages)} pages")
        del pages[len(chunks):]
        ref = self.pool._ref
        if pages and min(map(ref.__getitem__, pages)) < 1:
            raise ValueError(f"insert of pages the caller does not hold: "
                             f"{[p for p in pages if ref[p] < 1]}")
        existing = self._walk(version, chunks)
        new_pages = pages[len(existing):]  # one new node each, below the cached prefix
        if any(map(self._trie.__getitem__, new_pages)) or len(set(new_pages)) < len(new_pages):
            raise ValueError(f"pages {new_pages} include one already cached under another "
                             f"prefix or listed twice")
        with deferred_signals():
            if version not in self._roots:
                self._roots[version] = _Node(None, 0, None, version, 0)
                self._nodes[version] = {}
            parent = existing[-1] if existing else self._roots[version]
            nodes, trie, parents = self._nodes[version], self._trie, self._parents
            now = next(self._clock)
            for node in existing:
                node.last_access = now
            for chunk, page in zip(chunks[len(existing):], new_pages):
                child = _Node(chunk, page, parent, version, now)
                parent.children[chunk] = child
                nodes[page] = child
                trie[page] = 1
                parents[page] = parent.page
                ref[page] += 1
                parent = child
            if new_pages:
                self._counters["inserted_pages"] += len(new_pages)
                self._trie_epoch += 1
        return len(new_pages)

    def invalidate_before(self, version: int, *, held: bool = False) -> int:
        """Drops every entry of versions < `version` and frees their pages; returns how many.

        If a live request still holds any of those pages, raises PinnedPagesError and
        changes nothing: stale KV must never stay reachable behind a reported success.
        held=True: such pages leave the trie (no lookup reaches them again) and stay with the
        requests holding them until released (the engine's kv_policy "keep").
        """
        version = as_version(version)
        return self._drop([v for v in self._roots if v < version], f"before {version}",
                          held=held)

    def clear(self) -> int:
        """Drops every version's entries (used after the KV pool itself was lost)."""
        return self._drop(list(self._roots), "(clear)")

    def _drop(self, stale: list[int], what: str, held: bool = False) -> int:
        if not stale:
            return 0
        pages = np.fromiter((p for v in stale for p in self._nodes[v]), np.int32)
        pinned = pages[self.pool.refcount[pages] > 1]
        if pinned.size and not held:
            raise PinnedPagesError(
                f"cannot invalidate versions {sorted(stale)} {what}: "
                f"{pinned.size} of their {pages.size} pages are held by live requests")
        with deferred_signals():
            self._trie_epoch += 1
            for v in stale:
                del self._roots[v], self._nodes[v]
            self._in_trie[pages] = False
            self.pool._decref(pages, 1)
            self._counters["invalidated_pages"] += int(pages.size)
            self._counters["invalidations"] += 1
        return int(pages.size)

    def reconcile(self, keep_versions) -> None:
        """For a quiescent cache (no request holds a page): drops every namespace not in
        `keep_versions` and rebuilds the pool from the trie (refcount 1 per trie page, every
        other page free). Repairs whatever an interrupted caller left behind."""
        keep = set(keep_versions)
        with deferred_signals():
            self._trie_epoch += 1
            for v in [v for v in self._roots if v not in keep]:
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
                assert self._parent[page] == node.parent.page, "parent index out of date"
        assert seen == set(np.flatnonzero(self._in_trie).tolist())

        def evictable(node) -> tuple[int, bool]:  # (evictable pages in subtree, all cached)
            below = [evictable(c) for c in node.children.values()]
            free_below = all(ok for _, ok in below) and ref[node.page] == 1
            return sum(n for n, _ in below) + free_below, free_below
        assert self.num_evictable == sum(
            sum(evictable(c)[0] for c in root.children.values()) for root in self._roots.values())
