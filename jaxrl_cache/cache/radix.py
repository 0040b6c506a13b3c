"""Version-keyed radix prefix cache over a reference-counted page pool.

Each policy version owns a separate path-compressed trie: an edge is a run of page-aligned
token chunks, each chunk one physical page of KV computed by that version's params. A lookup
at version v walks only v's trie, so it never returns a page written under another version.

Ownership: the trie holds one reference to each of its pages, a request one reference to each
page it uses (`acquire` takes them, `release` drops them). A trie page with one reference is
"cached", a page with none free, every other page "in use": free + cached + in use ==
num_pages - 1. `insert` may hang a request's pages below cached pages the request does not
hold (it continues past a duplicate prefix), so a cached page is evictable only if no page
below it is in use (`num_evictable`). Eviction takes the oldest version first, least recently
used leaves first within it.

Interrupt safety: every method checks its arguments first (an error changes nothing), then
applies its change inside `deferred_signals()`, so a KeyboardInterrupt never sees half an
update. An interrupt after such a step can still lose the references it handed out; the
engine runs each call in one deferred section and `reconcile`s a quiescent cache after it.
"""
from __future__ import annotations

import array
import dataclasses
import heapq
import itertools
from typing import Collection, NamedTuple, Sequence

import numpy as np

from jaxrl_cache.cache.page_pool import PagePool, as_page_ids, as_page_list
from jaxrl_cache.cache.tokens import PackedTokens, pack_tokens, split_pages
from jaxrl_cache.checks import as_count
from jaxrl_cache.errors import CacheFullError, PinnedPagesError
from jaxrl_cache.interrupts import deferred_signals
from jaxrl_cache.versioning import MAX_VERSION, as_version


def _readonly(arr: np.ndarray) -> np.ndarray:
    """arr, made read-only (the empty match is shared)."""
    arr.flags.writeable = False
    return arr


_NO_PAGES = _readonly(np.zeros(0, np.int32))


class _Node:
    """A run of pages: one edge of the compressed trie. key is the int32 bytes of
    len(pages) * page_size tokens (b"" at a root); children are keyed by their first page's
    bytes. Every page of a node carries the node's LRU stamp."""
    __slots__ = ("key", "pages", "parent", "children", "last_access", "version")

    def __init__(self, key, pages, parent, version, last_access):
        self.key = key
        self.pages = pages  # list[int] physical page ids, one per page of key
        self.parent = parent
        self.children: dict[bytes, _Node] = {}
        self.last_access = last_access
        self.version = version


class Match(NamedTuple):
    pages: np.ndarray  # int32 [n] held pages of the matched prefix, in order (read-only)
    num_tokens: int  # n * page_size


_NO_MATCH = Match(_NO_PAGES, 0)


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
    the engine serialises every call under its lock. Versions are bounded like every policy
    version (`as_version`: int32 range)."""

    def __init__(self, num_pages: int, page_size: int):
        self.page_size = as_count(page_size, "page_size", minimum=1)
        self._page_bytes = 4 * self.page_size
        self.pool = PagePool(num_pages)
        # bool [P] in a trie, int32 [P] trie parent page (0 under a root): Python buffers
        # for the per-request path, numpy views of the same memory for the bulk paths
        self._trie = bytearray(self.pool.num_pages)
        self._in_trie = np.frombuffer(self._trie, bool)
        self._parents = array.array("i", bytes(4 * self.pool.num_pages))
        self._parent = np.frombuffer(self._parents, np.int32)
        self._roots: dict[int, _Node] = {}
        self._nodes: dict[int, dict[int, _Node]] = {}  # version -> page -> node holding it
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
        """Cached pages eviction can free now."""
        return int(self._evictable().sum())

    def _evictable(self) -> np.ndarray:
        """bool [P]: cached pages with no page in use below them (one sits below a cached
        page only where `insert` continued past a duplicate prefix)."""
        refcount = self.pool.refcount
        cached = self._in_trie & (refcount == 1)
        up = self._parent[self._in_trie & (refcount > 1)]
        up = up[cached[up]]
        while up.size:  # climb through cached ancestors; one in use has its own entry
            cached[up] = False
            up = self._parent[up]
            up = up[cached[up]]
        return cached

    def peek(self, version: int, tokens: Sequence[int] | PackedTokens) -> int:
        """Pages of the longest cached prefix of `tokens` under `version`; changes nothing
        (no reference, no lookup counted, no LRU stamp)."""
        if type(version) is not int or not 0 <= version <= MAX_VERSION:  # per request
            version = as_version(version)
        return self._walk(version, self._token_bytes(tokens)[0])[1]

    def match(self, version: int, tokens: Sequence[int] | PackedTokens) -> Match:
        """Longest cached page-aligned prefix of `tokens` under `version`, its pages held for
        the caller (release them when done)."""
        return self.acquire(version, [PackedTokens.of(tokens)], 0)[0][0]

    def alloc(self, n: int) -> np.ndarray:
        """int32 [n] fresh pages (refcount 1, the caller's), evicting cached pages if needed.
        Raises CacheFullError and changes nothing if impossible."""
        return self.acquire(0, [], n)[1]

    def acquire(self, version: int, prefixes: Sequence[Sequence[int] | PackedTokens],
                n_fresh: int) -> tuple[list[Match], np.ndarray]:
        """`match` of each prefix plus `alloc(n_fresh)` as one step: returns (matches, int32
        [n_fresh] fresh pages). If the pool cannot supply n_fresh pages once the matched
        pages are held, raises CacheFullError having changed nothing (no lookup counted, no
        LRU stamp)."""
        if type(version) is not int or not 0 <= version <= MAX_VERSION:  # per request
            version = as_version(version)
        if type(prefixes) not in (list, tuple) and (
                isinstance(prefixes, (str, bytes)) or not isinstance(prefixes, Sequence)):
            raise TypeError(f"prefixes must be a sequence of token-id sequences, got "
                            f"{type(prefixes).__name__}")
        packed = [self._token_bytes(prefix, i) for i, prefix in enumerate(prefixes)]
        n_fresh = as_count(n_fresh, "n_fresh")
        walks = [self._walk(version, data) for data, _ in packed]
        matches = [self._match_of(*walk) for walk in walks]
        pool = self.pool
        if n_fresh > pool.num_free:  # only then may holding the matched pages matter
            held = np.concatenate([m.pages for m in matches] + [_NO_PAGES])
            evictable = self._evictable()
            evictable = int(evictable.sum()) - np.unique(held[evictable[held]]).size
            if n_fresh > pool.num_free + evictable:
                raise CacheFullError(
                    f"need {n_fresh} KV pages but only {pool.num_free + evictable} can be "
                    f"made available ({pool.num_free} free + {evictable} evictable "
                    f"cached; {pool.num_pages - 1} total). Use a larger pool or a "
                    f"smaller batch.")
        with deferred_signals():
            now = next(self._clock)
            for i, (path, n, start) in enumerate(walks):
                if path:
                    if i:  # an earlier prefix may have split a node of this path
                        path, n, start = self._walk(version, packed[i][0])
                    self._end_walk_at_node(path, n, start)
                    for node in path:
                        node.last_access = now
            held = [page for m in matches for page in m.pages.tolist()]
            if held:  # before evicting: a held page is not evictable
                pool.incref(held)
            if n_fresh > pool.num_free:
                self._evict(n_fresh - pool.num_free)
            fresh = pool.take(n_fresh)
            counters = self._counters
            counters["lookups"] += len(packed)
            counters["lookup_tokens"] += sum(length for _, length in packed)
            counters["hit_tokens"] += sum(m.num_tokens for m in matches)
        return matches, fresh

    def release(self, pages: np.ndarray) -> None:
        """pages int32 [n]: drops the caller's reference to each (from alloc or match;
        repeats allowed). Raises ValueError, changing nothing, if one was not held."""
        self.pool.decref(pages)

    def evict(self, n: int) -> int:
        """Frees up to n evictable cached pages: the oldest version namespace first, least
        recently used leaves first within it. Returns how many."""
        n = as_count(n, "n")
        with deferred_signals():
            return self._evict(n)

    def _evict(self, n: int) -> int:
        ref, size = self.pool.refcount, self._page_bytes
        leaves = [(node.version, node.last_access, id(node), node)
                  for nodes in self._nodes.values() for page, node in nodes.items()
                  if page == node.pages[-1] and not node.children and ref[page] == 1]
        heapq.heapify(leaves)
        evicted = []
        while leaves and len(evicted) < n:
            node = heapq.heappop(leaves)[-1]
            pages, nodes = node.pages, self._nodes[node.version]
            keep = len(pages)
            while keep and len(evicted) < n and ref[pages[keep - 1]] == 1:
                keep -= 1
                evicted.append(pages[keep])
                del nodes[pages[keep]]
            if keep:
                del pages[keep:]
                node.key = node.key[:keep * size]
                continue
            parent = node.parent
            del parent.children[node.key[:size]]
            if parent.pages and not parent.children and ref[parent.pages[-1]] == 1:
                heapq.heappush(leaves, (parent.version, parent.last_access, id(parent),
                                        parent))
        self._in_trie[evicted] = False
        self.pool.decref(evicted)
        self._counters["evicted_pages"] += len(evicted)
        return len(evicted)

    # ---------------------------------------------------------------- prefix trie
    def page_keys(self, tokens: Sequence[int] | PackedTokens,
                  name: str = "tokens") -> tuple[bytes, ...]:
        """Hashable key of each full page of `tokens`: its int32 bytes (see `_token_bytes`)."""
        data = self._token_bytes(tokens, name)[0]
        return split_pages(data, self._page_bytes)

    def _token_bytes(self, tokens: Sequence[int] | PackedTokens,
                     name: str | int = "tokens") -> tuple[bytes, int]:
        """(int32 bytes of the full pages of `tokens`, number of tokens); a PackedTokens is
        taken as it is."""
        if type(tokens) is not PackedTokens:
            tokens = pack_tokens(tokens, name if type(name) is str else f"prefixes[{name}]")
        cut = len(tokens) % self._page_bytes
        return (tokens[:len(tokens) - cut] if cut else tokens), len(tokens) >> 2

    def _walk(self, version: int, data: bytes) -> tuple[list[_Node], int, int]:
        """(nodes, n, start): the longest cached prefix of the full pages `data` under
        `version` is n pages, held by `nodes` in order, the last possibly only in part, whose
        key begins at byte `start` of data. Changes nothing."""
        node, path, start, done = self._roots.get(version), [], 0, 0
        size, end = self._page_bytes, len(data)
        while node is not None and done < end:
            child = node.children.get(data[done:done + size])
            if child is None:
                break
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

    def _match_of(self, path: list[_Node], n: int, start: int) -> Match:
        """The Match of a walk (see `_walk`): its first n pages."""
        if not n:
            return _NO_MATCH
        pages = []
        for node in path:
            pages += node.pages
        return Match(_readonly(np.array(pages[:n], np.int32)), n * self.page_size)

    def _end_walk_at_node(self, path: list[_Node], n: int, start: int) -> None:
        """(Inside a commit.) If a walk ends inside its last node, splits that node there:
        its other pages become its only child, inheriting its children (so an LRU stamp
        covers only the pages walked). The trie's meaning is unchanged."""
        node, keep = path[-1], n - start // self._page_bytes
        if keep == len(node.pages):
            return
        cut = keep * self._page_bytes
        tail = _Node(node.key[cut:], node.pages[keep:], node, node.version, node.last_access)
        tail.children, node.children = node.children, {node.key[cut:cut + self._page_bytes]: tail}
        for child in tail.children.values():
            child.parent = tail
        node.key = node.key[:cut]
        del node.pages[keep:]
        nodes = self._nodes[node.version]
        for page in tail.pages:
            nodes[page] = tail

    def insert(self, version: int, tokens: Sequence[int] | PackedTokens,
               pages: np.ndarray, *, release: np.ndarray | None = None) -> int:
        """Records the full pages of `tokens` (KV written by `version`).

        pages int32 [>= len(tokens) // page_size] in order; those past the cached prefix
        (the ones the trie takes) must be held by the caller. Chunks already cached are left
        as they are (a duplicate page stays the caller's and is freed on release) and
        insertion continues below them: a duplicate holds the same tokens' KV under the same
        version, so what follows is the same whichever copy it was computed against. Returns
        how many pages the trie took.

        release int32 [m]: then drop these references as `release(release)` does, in the
        same step (a request finishing); if one is not held, raises with nothing inserted.
        """
        if type(version) is not int or not 0 <= version <= MAX_VERSION:  # per request
            version = as_version(version)
        data = self._token_bytes(tokens)[0]
        size, num_pages = self._page_bytes, self.pool.num_pages
        full = len(data) // size
        if type(pages) is not np.ndarray or pages.ndim != 1 or pages.dtype.kind != "i":
            pages = as_page_ids(pages, num_pages)
        if len(pages) < full:
            raise ValueError(f"{full} full pages of tokens but only {len(pages)} pages")
        path, n, start = self._walk(version, data)
        new_pages = as_page_list(pages[n:full], num_pages)  # the only pages the trie reads
        trie = self._trie
        if len(set(new_pages)) < len(new_pages) or any(trie[page] for page in new_pages):
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
                self._nodes[version] = {}
            now = next(self._clock)
            if path:
                self._end_walk_at_node(path, n, start)
            for node in path:
                node.last_access = now
            if new_pages:
                parent = path[-1] if path else self._roots[version]
                child = _Node(data[n * size:], new_pages, parent, version, now)
                parent.children[data[n * size:(n + 1) * size]] = child
                nodes, parents = self._nodes[version], self._parents
                above = parent.pages[-1] if parent.pages else 0
                for page in new_pages:
                    nodes[page] = child
                    trie[page] = 1
                    parents[page] = above
                    above = page
                self._counters["inserted_pages"] += len(new_pages)
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
        in_use = pages[self.pool.refcount[pages] > 1]
        if in_use.size and not held:
            raise PinnedPagesError(
                f"cannot invalidate versions {sorted(stale)} {what}: "
                f"{in_use.size} of their {pages.size} pages are held by live requests")
        with deferred_signals():  # pages in use that leave the trie stay with their holders
            for v in stale:
                del self._roots[v], self._nodes[v]
            self._in_trie[pages] = False
            self.pool.decref(pages)
            self._counters["invalidated_pages"] += int(pages.size)
            self._counters["invalidations"] += 1
        return int(pages.size)

    def reconcile(self, keep_versions: Collection[int]) -> None:
        """For a quiescent cache (no request holds a page): drops every namespace not in
        `keep_versions` and rebuilds the pool from the trie (refcount 1 per trie page, every
        other page free). Repairs whatever an interrupted caller left behind."""
        if isinstance(keep_versions, (str, bytes)) or not isinstance(keep_versions, Collection):
            raise TypeError(f"keep_versions must be a collection of versions, got "
                            f"{type(keep_versions).__name__} {keep_versions!r:.80}")
        keep = {as_version(v, "keep_versions") for v in keep_versions}
        with deferred_signals():
            for v in [v for v in self._roots if v not in keep]:
                self._in_trie[list(self._nodes[v])] = False
                del self._roots[v], self._nodes[v]
            self.pool.reset(self._in_trie)

    # ---------------------------------------------------------------- introspection
    def versions(self) -> list[int]:
        return sorted(self._roots)

    def page_entries(self) -> list[tuple[int, int, int, bytes, int]]:
        """(version, page, parent page (0 under a root), page key, LRU stamp) of every
        cached page, sorted: the trie's meaning, whatever runs of pages its nodes hold."""
        size, out = self._page_bytes, []
        for v, nodes in self._nodes.items():
            for page, node in nodes.items():
                i = node.pages.index(page)
                above = node.pages[i - 1] if i else (node.parent.pages or [0])[-1]
                out.append((v, page, above, node.key[i * size:(i + 1) * size],
                            node.last_access))
        return sorted(out)

    def stats(self) -> CacheStats:
        ref, trie = self.pool.refcount[1:], self._in_trie[1:]
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
        self.pool.check_invariants()
        ref, size, seen = self.pool.refcount, self._page_bytes, set()

        def visit(node, v) -> tuple[int, bool]:  # (evictable pages in subtree, all cached)
            below = [visit(c, v) for c in node.children.values()]
            for key, child in node.children.items():
                assert child.parent is node and child.version == v and child.pages
                assert key == child.key[:size] and len(child.key) == size * len(child.pages)
            free_below, count = all(ok for _, ok in below), sum(n for n, _ in below)
            for page in reversed(node.pages):
                assert self._nodes[v][page] is node and page not in seen, f"page {page}"
                seen.add(page)
                free_below = free_below and ref[page] == 1
                count += free_below
            return count, free_below

        evictable = sum(visit(root, v)[0] for v, root in self._roots.items())
        indexed = {page for nodes in self._nodes.values() for page in nodes}
        assert seen == indexed == set(np.flatnonzero(self._in_trie).tolist()), "index stale"
        assert (ref[list(seen)] >= 1).all(), "trie page without its reference"
        for _, page, above, _, _ in self.page_entries():
            assert self._parent[page] == above, "parent index out of date"
        assert self.num_evictable == evictable
