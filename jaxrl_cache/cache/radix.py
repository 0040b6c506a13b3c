"""Version-keyed radix prefix cache over a reference-counted page pool.

Each policy version owns a separate trie whose edges are page-aligned token chunks and whose
nodes each own one physical page of KV computed by that version's params. A lookup at
version v walks only v's trie, so it can never return a page written under another version.

Ownership: the trie holds one reference to each of its pages, every request one reference to
each page it uses (a request holding a Lease holds its matched path as one pin instead;
`page_refcounts()` counts pins as references). A trie page with one reference is "cached"
(evictable); a page with none is free; every other page is "in use". Always: free + cached +
in use == num_pages - 1.
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
import dataclasses
import functools
import heapq
import itertools
import struct
from typing import Collection, NamedTuple, Sequence

import numpy as np

from jaxrl_cache.cache.page_pool import PagePool, as_page_ids, as_page_list
from jaxrl_cache.checks import as_count
from jaxrl_cache.errors import CacheFullError, PinnedPagesError
from jaxrl_cache.interrupts import deferred_signals
from jaxrl_cache.versioning import MAX_VERSION, as_version


@functools.lru_cache(maxsize=4096)
def _uint32s(n: int) -> struct.Struct:
    """Packs n little-endian uint32s."""
    return struct.Struct(f"<{n}I")


@functools.lru_cache(maxsize=4096)
def _pages_format(n: int, size: int) -> struct.Struct:
    """Splits the first n * size bytes into n bytes objects of `size` in one C call."""
    return struct.Struct(f"{size}s" * n)


def _pack(tokens: Sequence[int], name: str) -> bytes:
    """int32 little-endian bytes of token ids, each an integer in [0, 2**31): one C-level
    pass for a list or tuple of ints, numpy for the rest (which also names what is wrong; a
    sequence of bools is refused, as numpy types it bool)."""
    if type(tokens) in (list, tuple) and tokens and type(tokens[0]) is int:
        try:  # "<I" refuses non-integers, negatives and >= 2**32; the top bytes the rest
            data = _uint32s(len(tokens)).pack(*tokens)
        except Exception:  # the numpy path below names what is wrong
            data = b"\xff" * 4
        if data[3::4].isascii():
            return data
    if isinstance(tokens, (str, bytes)) or not isinstance(tokens, (Sequence, np.ndarray)):
        raise TypeError(f"{name} must be a sequence of integer token ids, got "
                        f"{type(tokens).__name__} {tokens!r:.80}")
    arr = np.asarray(tokens)
    if arr.size and (arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer)):
        raise TypeError(f"{name} must be a 1-D sequence of integer token ids, got "
                        f"{tokens!r:.80}")
    if arr.size and (arr.min() < 0 or arr.max() > 2**31 - 1):
        raise ValueError(f"{name}: token ids must be in [0, 2**31), got {tokens!r:.80}")
    return arr.astype("<i4").tobytes()


def _readonly(arr: np.ndarray) -> np.ndarray:
    """arr, made read-only: page ids handed out are also what a Lease records (and a
    matched chain is shared by every match of it)."""
    arr.flags.writeable = False
    return arr


_NO_PAGES = _readonly(np.zeros(0, np.int32))


class PackedTokens(bytes):
    """Token ids as the int32 bytes the trie keys its pages by, checked once. Every cache call
    that takes tokens takes one of these as it is, so a caller that packs a prompt once
    (`PackedTokens.of`) and extends it by each sample's output (`extend` converts only the
    new tokens) does no per-token Python work on the prompt again. Build it only with `of`
    and `extend`."""
    __slots__ = ()

    @classmethod
    def of(cls, tokens: Sequence[int], name: str = "tokens") -> PackedTokens:
        """tokens: ints in [0, 2**31) (list, tuple or 1-D integer array)."""
        return tokens if type(tokens) is cls else cls(_pack(tokens, name))

    def extend(self, tokens: Sequence[int], name: str = "tokens") -> PackedTokens:
        """These tokens followed by `tokens`."""
        data = _pack(tokens, name)
        return PackedTokens(self + data) if data else self

    def head(self, n: int) -> PackedTokens:
        """The first n tokens."""
        return PackedTokens(self[:4 * as_count(n, "n")])

    @property
    def num_tokens(self) -> int:
        return len(self) >> 2

    def tolist(self) -> list[int]:
        return array.array("i", self).tolist()

    def __repr__(self) -> str:
        return f"PackedTokens({self.tolist()!r:.80})"


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
    pages: np.ndarray  # int32 [n] pinned pages of the matched prefix, in order (read-only)
    num_tokens: int  # n * page_size


_NO_MATCH = Match(_NO_PAGES, 0)


class Lease:
    """The page references one caller holds. Cache calls given a lease add what they hand out
    to it in the same atomic step; `RadixCache.release(lease)` returns them all and empties it
    (releasing an empty lease does nothing, so a retried cleanup is harmless). A matched path
    is held as one pin on its last page (see `RadixCache`), not one reference per page."""
    __slots__ = ("_parts", "_pins")

    def __init__(self):
        # the tuples are replaced, never mutated: sequences of page ids, and
        # (cache, last page of a pinned path, the cache's pin epoch when pinned)
        self._parts: tuple = ()
        self._pins: tuple = ()

    def _expanded(self) -> list:
        return [*self._parts, *(cache._path_to(last) for cache, last, _ in self._pins)]

    @property
    def pages(self) -> np.ndarray:
        """int32 [n] every reference held (a page appears once per reference)."""
        return np.fromiter(itertools.chain.from_iterable(self._expanded()), np.int32)

    def __len__(self) -> int:
        return sum(map(len, self._expanded()))


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
        self._page_bytes = 4 * self.page_size
        self.pool = PagePool(num_pages)
        # [P] bool and [P] int32 (trie parent page, 0 under a root), each also as a Python
        # buffer over the same memory for the per-request path (see PagePool._ref)
        self._trie = bytearray(self.pool.num_pages)
        self._in_trie = np.frombuffer(self._trie, bool)
        self._parents = array.array("i", bytes(4 * self.pool.num_pages))
        self._parent = np.frombuffer(self._parents, np.int32)
        self._roots: dict[int, _Node] = {}
        self._nodes: dict[int, dict[int, _Node]] = {}  # version -> page -> node holding it
        self._clock = itertools.count(1)
        self._epoch = 0  # bumped by every change of any trie's structure
        # the last walk: (data, version, epoch, nodes, pages matched, byte where the last
        # node's key begins)
        self._last_walk: tuple = (b"", 0, -1, [], 0, 0)
        self._counters = dict(lookups=0, lookup_tokens=0, hit_tokens=0, inserted_pages=0,
                              evicted_pages=0, invalidated_pages=0, invalidations=0)
        # lease pins not yet in the pool's refcounts: last page of a path -> count; each
        # stands for one reference to every page from the root down to that page
        self._pins: dict[int, int] = {}
        self._pin_epoch = 0  # bumped by every flush of the pins into the refcounts
        self._matches: dict[int, Match] = {}  # see _match_of

    # ---------------------------------------------------------------- allocation
    @property
    def available_pages(self) -> int:
        """Pages `alloc` can hand out now: free + evictable cached."""
        return self.pool.num_free + self.num_evictable

    def peek(self, version: int, tokens: Sequence[int] | PackedTokens) -> int:
        """Pages of the longest cached prefix of `tokens` under `version`; changes nothing
        (no pin, no lookup counted, no LRU stamp)."""
        if type(version) is not int or not 0 <= version <= MAX_VERSION:  # per request
            version = as_version(version)
        return self._walk(version, self._token_bytes(tokens)[0])[1]

    @property
    def num_evictable(self) -> int:
        """Cached pages eviction can free now."""
        return int(self._evictable().sum())

    def _evictable(self) -> np.ndarray:
        """bool [P]: cached pages (trie only) with no pinned page below them. A pinned page
        sits under a cached one only where `insert` continued past a duplicate prefix."""
        refcount = self.page_refcounts()
        cached = self._in_trie & (refcount == 1)
        up = self._parent[self._in_trie & (refcount > 1)]
        up = up[cached[up]]
        while up.size:  # climb through cached ancestors; a pinned one has its own entry
            cached[up] = False
            up = self._parent[up]
            up = up[cached[up]]
        return cached

    def alloc(self, n: int, *, lease: Lease | None = None) -> np.ndarray:
        """n fresh pages (refcount 1, owned by the caller), evicting cached pages LRU
        leaf-first if needed. Raises CacheFullError and changes nothing if impossible."""
        return self._acquire(0, [], 0, as_count(n, "n"), lease)[1]

    def acquire(self, version: int, prefixes: Sequence[Sequence[int] | PackedTokens],
                n_fresh: int, *, lease: Lease | None = None) -> tuple[list[Match], np.ndarray]:
        """`match` of each prefix plus `alloc(n_fresh)` as one step: returns (matches, fresh
        pages). If the pool cannot supply n_fresh pages once the matched paths are pinned,
        raises CacheFullError having changed nothing (no lookup counted, no LRU stamp)."""
        if type(version) is not int or not 0 <= version <= MAX_VERSION:  # per request
            version = as_version(version)
        if type(prefixes) not in (list, tuple) and (
                isinstance(prefixes, (str, bytes)) or not isinstance(prefixes, Sequence)):
            raise TypeError(f"prefixes must be a sequence of token-id sequences, got "
                            f"{type(prefixes).__name__}")
        data, tokens = [], 0
        for i, prefix in enumerate(prefixes):
            packed, length = self._token_bytes(prefix, i)
            data.append(packed)
            tokens += length
        return self._acquire(version, data, tokens, as_count(n_fresh, "n_fresh"), lease)

    def _acquire(self, version: int, data: list[bytes], lookup_tokens: int, n_fresh: int,
                 lease: Lease | None) -> tuple[list[Match], np.ndarray]:
        if lease is not None and not isinstance(lease, Lease):
            raise TypeError(f"lease must be a Lease or None, got {type(lease).__name__}")
        walks = [self._walk(version, d) for d in data]
        matches, lasts, hit_tokens = [], [], 0
        for path, n, start in walks:
            match, last = self._match_of(path, n, start)
            matches.append(match)
            lasts.append(last)
            hit_tokens += match.num_tokens
        if n_fresh > self.pool._num_free:  # only then may pinning the paths matter
            pinned = np.concatenate([m.pages for m in matches] + [_NO_PAGES])
            evictable = self._evictable()
            evictable = int(evictable.sum()) - np.unique(pinned[evictable[pinned]]).size
            if n_fresh > self.pool.num_free + evictable:
                raise CacheFullError(
                    f"need {n_fresh} KV pages but only {self.pool.num_free + evictable} can be "
                    f"made available ({self.pool.num_free} free + {evictable} evictable "
                    f"cached; {self.pool.num_pages - 1} total). Use a larger pool or a "
                    f"smaller batch.")
        pool, ref, pins = self.pool, self.pool._ref, self._pins
        with deferred_signals():
            now = next(self._clock)
            for i, (path, n, start) in enumerate(walks):
                if path:
                    if i:  # an earlier prefix may have split a node of this path
                        path, n, start = self._walk(version, data[i])
                    keep = n - start // self._page_bytes
                    if keep < len(path[-1].pages):  # the walk ends inside its last node
                        self._split(path[-1], keep)
                        self._still_walked(data[i])
                    for node in path:
                        node.last_access = now
                    if lease is None:
                        for page in matches[i].pages.tolist():
                            ref[page] += 1
                    else:  # one pin for the whole path
                        last = lasts[i]
                        pins[last] = pins.get(last, 0) + 1
                        lease._pins += ((self, last, self._pin_epoch),)
            if n_fresh > pool._num_free:
                self._evict(n_fresh - pool._num_free)
            fresh = pool._take(n_fresh)
            counters = self._counters
            counters["lookups"] += len(data)
            counters["lookup_tokens"] += lookup_tokens
            counters["hit_tokens"] += hit_tokens
            if lease is not None:
                lease._parts += (fresh,)
        return matches, _readonly(np.frombuffer(fresh, np.int32))

    def release(self, pages: np.ndarray | Lease) -> None:
        """Drops the caller's reference to each page (from alloc or match), or every
        reference a lease holds (then empties it)."""
        plan = self._plan_release(pages)
        with deferred_signals():
            self._apply_release(*plan)

    def _plan_release(self, pages: np.ndarray | Lease, name: str = "pages") -> tuple:
        """(lease or None, page sequences to drop a reference from, {last page: pins to
        drop}); checks the pins (the pages are checked as they are dropped)."""
        unpin = {}  # last page -> pins to drop
        if not isinstance(pages, Lease):
            return None, (as_page_list(pages, self.pool.num_pages, name),), unpin
        lease, parts = pages, pages._parts
        for cache, last, epoch in lease._pins:
            if cache is not self:
                raise ValueError("release of a lease that holds pins of another cache")
            if epoch == self._pin_epoch:
                unpin[last] = unpin.get(last, 0) + 1
            else:  # flushed since: the path's pages hold one reference each
                parts += (self._path_to(last),)
        for last, k in unpin.items():
            if self._pins.get(last, 0) < k:
                raise ValueError(f"released a pin that was not held (the path ending at "
                                 f"page {last})")
        return lease, parts, unpin

    def _apply_release(self, lease: Lease | None, parts: tuple, unpin: dict) -> None:
        """(Inside a commit.) One pass: if a page was not held the pool undoes it all and
        this raises with nothing changed."""
        if not self.pool._decref_parts(parts):
            raise ValueError(f"released pages that were not held: "
                             f"{list(itertools.chain.from_iterable(parts))}")
        if lease is not None:
            pins = self._pins
            for last, k in unpin.items():
                if pins[last] == k:
                    del pins[last]
                else:
                    pins[last] -= k
            lease._parts = lease._pins = ()

    def _path_to(self, last: int) -> list[int]:
        """The pages from the root down to trie page `last` (parent links stay valid while
        any reference holds the path)."""
        path, parents = [], self._parents
        while last:
            path.append(last)
            last = parents[last]
        path.reverse()
        return path

    def page_refcounts(self) -> np.ndarray:
        """int32 [P] references per page, lease pins included (a copy: pool.refcount counts a
        pin only once something needed the pool's own counts, see `_flush_pins`)."""
        refcount = self.pool.refcount.copy()
        for last, k in self._pins.items():
            refcount[self._path_to(last)] += k
        return refcount

    def _flush_pins(self) -> None:
        """(Inside a commit.) Turns every pin into one reference per page of its path, so
        eviction and invalidation can read the pool's refcounts; the leases holding them
        release pages from then on (their pin epoch is older)."""
        if self._pins:
            ref = self.pool._ref
            for last, k in self._pins.items():
                for page in self._path_to(last):
                    ref[page] += k
            self._pins = {}
            self._pin_epoch += 1

    def evict(self, n: int) -> int:
        """Frees up to n unpinned cached pages: the oldest version namespace first, least
        recently used leaves first within it."""
        n = as_count(n, "n")
        with deferred_signals():
            return self._evict(n)

    def _evict(self, n: int) -> int:
        self._flush_pins()
        ref, size = self.pool._ref, self._page_bytes
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
        pages = np.asarray(evicted, np.int32)
        self._epoch += 1
        self._matches.clear()
        self._in_trie[pages] = False
        self.pool._decref(pages, 1)
        self._counters["evicted_pages"] += len(evicted)
        return len(evicted)

    # ---------------------------------------------------------------- prefix trie
    def page_keys(self, tokens: Sequence[int] | PackedTokens,
                  name: str = "tokens") -> tuple[bytes, ...]:
        """Hashable key of each full page of `tokens`: its int32 bytes (see `_token_bytes`)."""
        data = self._token_bytes(tokens, name)[0]
        return _pages_format(len(data) // self._page_bytes, self._page_bytes).unpack_from(data)

    def _token_bytes(self, tokens: Sequence[int] | PackedTokens,
                     name: str | int = "tokens") -> tuple[bytes, int]:
        """(int32 bytes of the full pages of `tokens`, number of tokens); a PackedTokens is
        taken as it is."""
        if type(tokens) is not PackedTokens:
            tokens = _pack(tokens, name if type(name) is str else f"prefixes[{name}]")
        cut = len(tokens) % self._page_bytes
        return (tokens[:len(tokens) - cut] if cut else tokens), len(tokens) >> 2

    def _walk(self, version: int, data: bytes) -> tuple[list[_Node], int, int]:
        """(nodes, n, start): the longest cached prefix of the full pages `data` under
        `version` is n pages, held by `nodes` in order, the last possibly only in part, whose
        key begins at byte `start` of data (no change). While
        no trie changed, the last walk is reused for the same data (peek, then acquire),
        continued for data that extends it (acquire of a prompt, then insert of prompt +
        output) and cut for data that begins it (the next sample's prompt)."""
        last_data, last_version, epoch, path, n, start = self._last_walk
        size = self._page_bytes
        if epoch == self._epoch and last_version == version:
            if data.startswith(last_data):
                if last_data is data or n * size < len(last_data):  # stops where it stopped
                    return path, n, start
                if path:
                    path = path.copy()
                    return self._descend(version, data, path, path[-1], start, n * size)
            elif last_data.startswith(data):  # a prefix (the prompt of the last insert)
                n = min(n, len(data) // size)
                keep, start, end = [], 0, 0
                for node in path:
                    if end >= n * size:
                        break
                    keep.append(node)
                    start, end = end, end + len(node.key)
                self._last_walk = (data, version, epoch, keep, n, start)
                return keep, n, start
        return self._descend(version, data, [], self._roots.get(version), 0, 0)

    def _descend(self, version: int, data: bytes, path: list[_Node], node: _Node | None,
                 start: int, done: int) -> tuple[list[_Node], int, int]:
        """Continues a walk at `node` (the last of `path`, or a root), whose key begins at
        byte `start` of data and is known to match up to byte `done`."""
        if node is None:
            return path, 0, 0
        size, end, key = self._page_bytes, len(data), node.key
        while True:
            if len(key) > done - start:  # part of the node is not yet compared
                if data.startswith(key, start):
                    done = start + len(key)
                else:  # count how many more of its pages match
                    while (done < end and done - start < len(key)
                           and data.startswith(key[done - start:done - start + size], done)):
                        done += size
                    break
            if done >= end:
                break
            child = node.children.get(data[done:done + size])
            if child is None:
                break
            path.append(child)
            node, key, start = child, child.key, done
            done += size  # children are keyed by their first page
        self._last_walk = (data, version, self._epoch, path, done // size, start)
        return path, done // size, start

    def _still_walked(self, data: bytes) -> None:
        """After `_split` cut the last node of data's walk at the walk's end: the walk is
        still exact (its nodes end where it ends), so it stays reusable."""
        last = self._last_walk
        if last[0] is data:
            self._last_walk = (data, last[1], self._epoch) + last[3:]

    def _match_of(self, path: list[_Node], n: int, start: int) -> tuple[Match, int]:
        """(the Match of a walk (see `_walk`), its last page or 0). Memoised by last page: a
        trie page's chain of ancestors changes only when pages leave the trie (eviction,
        invalidation, reconcile), which empties the memo; a Match is immutable."""
        if not n:
            return _NO_MATCH, 0
        last = path[-1].pages[n - start // self._page_bytes - 1]
        match = self._matches.get(last)
        if match is None:
            if len(self._matches) >= 4096:
                self._matches.clear()
            chain = _readonly(np.array(self._path_to(last), np.int32))
            match = self._matches[last] = Match(chain, n * self.page_size)
        return match, last

    def _split(self, node: _Node, keep: int) -> None:
        """(Inside a commit.) Cuts the last node of a walk after its first `keep` pages (the
        walk's; fewer than it holds): its other pages become its only child, inheriting its
        children. The trie's meaning is unchanged."""
        self._epoch += 1
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

    def match(self, version: int, tokens: Sequence[int] | PackedTokens, *,
              lease: Lease | None = None) -> Match:
        """Longest cached page-aligned prefix of `tokens` under `version`, pinned for the
        caller (release the returned pages, or the lease, when done)."""
        version = as_version(version)
        data, length = self._token_bytes(tokens)
        return self._acquire(version, [data], length, 0, lease)[0][0]

    def insert(self, version: int, tokens: Sequence[int] | PackedTokens,
               pages: np.ndarray, *, release: np.ndarray | Lease | None = None) -> int:
        """Records the full pages of `tokens` (KV written by `version`).

        pages [>= len(tokens) // page_size] in order; those past the cached prefix (the ones
        the trie takes) must be held by the caller. Chunks already cached are left as they
        are (a duplicate page stays the caller's and is freed on release) and insertion
        continues below them: a duplicate holds the same tokens' KV under the same version,
        so what follows is the same whichever copy it was computed against. Returns how many
        pages the trie took.

        release: then drop these references as `release(release)` does, in the same step (a
        request finishing: cache its pages, let go of them); if it holds a page that is not
        held, raises with nothing inserted.
        """
        if type(version) is not int or not 0 <= version <= MAX_VERSION:  # per request
            version = as_version(version)
        data = self._token_bytes(tokens)[0]
        size = self._page_bytes
        full = len(data) // size
        if type(pages) is not np.ndarray or pages.ndim != 1 or pages.dtype.kind != "i":
            pages = as_page_ids(pages, self.pool.num_pages)
        if len(pages) < full:
            raise ValueError(f"{full} full pages of tokens but only {len(pages)} pages")
        path, n, start = self._walk(version, data)
        # one new node holds them, below the cached prefix (the only pages the trie reads)
        new_pages = pages[n:full].tolist()
        ref, trie, num_pages = self.pool._ref, self._trie, self.pool.num_pages
        clash = len(set(new_pages)) < len(new_pages)
        for page in new_pages:  # one pass; the errors name every offending page
            if clash or not 0 < page < num_pages or ref[page] < 1 or trie[page]:
                as_page_list(new_pages, num_pages)  # raises for an id out of range
                if any(ref[p] < 1 for p in new_pages):
                    raise ValueError(f"insert of pages the caller does not hold: "
                                     f"{[p for p in new_pages if ref[p] < 1]}")
                raise ValueError(f"pages {new_pages} include one already cached under another "
                                 f"prefix or listed twice")
        plan = None if release is None else self._plan_release(release, "release")
        with deferred_signals():
            for page in new_pages:  # the trie's references first: a release never frees them
                ref[page] += 1
            if plan is not None:
                try:
                    self._apply_release(*plan)
                except ValueError:
                    for page in new_pages:
                        ref[page] -= 1
                    raise
            if version not in self._roots:
                self._roots[version] = _Node(b"", [], None, version, 0)
                self._nodes[version] = {}
            now = next(self._clock)
            keep = n - start // size  # pages of the walk's last node it covers
            cut = path and keep < len(path[-1].pages)
            if cut:
                self._split(path[-1], keep)
            for node in path:
                node.last_access = now
            if new_pages:
                self._epoch += 1
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
                # the walk of data now ends at the new node (kept for the next walk)
                self._last_walk = (data, version, self._epoch, path + [child], full, n * size)
            elif cut:
                self._still_walked(data)
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
        pinned = pages[self.page_refcounts()[pages] > 1]
        if pinned.size and not held:
            raise PinnedPagesError(
                f"cannot invalidate versions {sorted(stale)} {what}: "
                f"{pinned.size} of their {pages.size} pages are held by live requests")
        with deferred_signals():
            self._flush_pins()  # pinned pages that leave the trie stay with their holders
            self._epoch += 1
            self._matches.clear()
            for v in stale:
                del self._roots[v], self._nodes[v]
            self._in_trie[pages] = False
            self.pool._decref(pages, 1)
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
            self._epoch += 1
            self._matches.clear()
            for v in [v for v in self._roots if v not in keep]:
                for page in self._nodes[v]:
                    self._in_trie[page] = False
                del self._roots[v], self._nodes[v]
            self.pool.reset(self._in_trie)
            self._pins = {}
            self._pin_epoch += 1

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
        ref = self.page_refcounts()[1:]
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
        assert (self.pool.refcount >= 0).all(), "negative refcount"
        for last, k in self._pins.items():
            assert k >= 1 and self._in_trie[last], "pin on a page outside the trie"
        ref = self.page_refcounts()
        assert ref[0] == 0, "null page was handed out"
        free = self.pool._free[:self.pool.num_free]
        assert len(set(free.tolist())) == free.size, "page on the free list twice"
        assert (ref[free] == 0).all() and not self._in_trie[free].any(), "free page in use"
        assert self.pool.num_free == int((ref[1:] == 0).sum()), "page leaked"
        s = self.stats()
        assert s.free_pages + s.cached_pages + s.in_use_pages == s.total_pages
        size, seen = self._page_bytes, set()

        def visit(node, v) -> tuple[int, bool]:  # (evictable pages in subtree, all cached)
            below = [visit(c, v) for c in node.children.values()]
            for page in node.pages:
                assert self._nodes[v][page] is node, "page index out of date"
            for key, child in node.children.items():
                assert child.parent is node and child.version == v and child.pages
                assert key == child.key[:size] and len(child.key) == size * len(child.pages)
            free_below, count = all(ok for _, ok in below), sum(n for n, _ in below)
            for page in reversed(node.pages):
                free_below = free_below and ref[page] == 1
                count += free_below
            return count, free_below

        evictable = 0
        for v, root in self._roots.items():
            evictable += visit(root, v)[0]
            for page, node in self._nodes[v].items():
                assert node.version == v and page in node.pages
                assert page not in seen, f"page {page} in the trie twice"
                seen.add(page)
                assert ref[page] >= 1 and self._in_trie[page]
        for _, page, above, _, _ in self.page_entries():
            assert self._parent[page] == above, "parent index out of date"
        assert seen == set(np.flatnonzero(self._in_trie).tolist())
        assert self.num_evictable == evictable
