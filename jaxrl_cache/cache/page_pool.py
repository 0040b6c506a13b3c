"""Reference-counted physical KV pages: the public bulk operations the radix trie builds on.

Pages are 1..num_pages-1; page 0 is the null page that pads page tables and is never handed
out. A page is free iff its reference count is 0. Every method checks its arguments before it
changes anything and applies the change inside `deferred_signals()`, so a call either
completes or leaves the pool as it was, KeyboardInterrupt included.
"""
from __future__ import annotations

import array

import numpy as np

from jaxrl_cache.checks import as_count
from jaxrl_cache.errors import CacheFullError
from jaxrl_cache.interrupts import deferred_signals


def _integer_array(pages, name: str) -> np.ndarray:
    arr = pages if type(pages) is np.ndarray else np.asarray(
        pages if not isinstance(pages, (str, bytes)) else None)
    if arr.ndim != 1 or not (arr.size == 0 or arr.dtype.kind in "iu"):  # bool refused
        raise TypeError(f"{name} must be a 1-D sequence of integer page ids, got "
                        f"{type(pages).__name__} {pages!r:.80}")
    return arr


def as_page_ids(pages, num_pages: int, name: str = "pages") -> np.ndarray:
    """pages (any 1-D integer sequence) -> int32 [n], each in 1..num_pages-1."""
    arr = _integer_array(pages, name)
    if arr.size and (arr.min() <= 0 or arr.max() >= num_pages):
        raise ValueError(f"{name}: page ids must be in 1..{num_pages - 1}, got {arr}")
    return arr.astype(np.int32)


def as_page_list(pages, num_pages: int, name: str = "pages") -> list[int]:
    """`as_page_ids` as a list of Python ints (for the per-request path: a few dozen pages
    cost less as Python ints than as numpy calls)."""
    if type(pages) is np.ndarray and pages.ndim == 1 and pages.dtype.kind == "i":
        ids = pages.tolist()  # the common case (int32 page arrays), checked inline
    elif type(pages) is list and all(type(p) is int for p in pages):
        ids = pages  # Python ints (the trie's own lists): only the range is left to check
    else:
        ids = _integer_array(pages, name).tolist()
    if ids and (min(ids) <= 0 or max(ids) >= num_pages):
        raise ValueError(f"{name}: page ids must be in 1..{num_pages - 1}, got {ids}")
    return ids


class PagePool:
    """Refcounts of pages 1..num_pages-1 and a stack of the free ones. Always: a page is on the
    free stack (once) iff its refcount is 0, and num_free is the stack's height."""

    def __init__(self, num_pages: int):
        num_pages = as_count(num_pages, "num_pages", minimum=2, maximum=2**31 - 1)  # int32 ids
        self.num_pages = num_pages
        # [P] refcounts and [P - 1] the free stack (top at the end) as Python arrays: the
        # per-request path (a few dozen pages) reads and writes their items far faster than
        # numpy scalars; `refcount` is a read-only numpy view of the counts for callers
        self._ref = array.array("i", bytes(4 * num_pages))
        self.refcount = np.frombuffer(self._ref, np.int32)  # int32 [P], read-only
        self.refcount.flags.writeable = False
        self._stack = array.array("i", range(num_pages - 1, 0, -1))
        self._num_free = num_pages - 1

    @property
    def num_free(self) -> int:
        return self._num_free

    def take(self, n: int) -> np.ndarray:
        """int32 [n] free pages, lowest id first, each now at refcount 1 (held by the
        caller). Raises CacheFullError, changing nothing, if fewer than n are free."""
        n = as_count(n, "n")
        top = self._num_free
        if n > top:
            raise CacheFullError(f"take({n}) with only {top} free pages")
        with deferred_signals():
            pages = self._stack[top - n:top]
            pages.reverse()
            ref = self._ref
            for p in pages:
                ref[p] = 1
            self._num_free = top - n
        return np.frombuffer(pages, np.int32)

    def incref(self, pages: np.ndarray) -> None:
        """pages int32 [n]: one more reference per entry (repeats count twice). Every page
        must already be held (refcount >= 1): a free page is never revived this way. Raises
        ValueError, changing nothing, otherwise."""
        pages = as_page_list(pages, self.num_pages)
        ref = self._ref
        for p in pages:
            if ref[p] < 1:
                raise ValueError(f"incref of free pages (held by no one): "
                                 f"{[p for p in pages if ref[p] < 1]}")
        with deferred_signals():
            for p in pages:
                ref[p] += 1

    def decref(self, pages: np.ndarray, name: str = "pages") -> list[int]:
        """pages int32 [n]: one reference fewer per entry (repeats allowed); returns the pages
        that reached 0, now free. A page never drops below 0: if some entry was not held,
        raises ValueError with nothing changed."""
        pages = as_page_list(pages, self.num_pages, name)
        ref, freed = self._ref, []
        with deferred_signals():  # one pass, undone on the first entry that was not held
            for i, p in enumerate(pages):
                left = ref[p] - 1
                if left < 0:
                    for q in pages[:i]:
                        ref[q] += 1
                    raise ValueError(f"released pages that were not held: {pages}")
                ref[p] = left
                if not left:
                    freed.append(p)
            if freed:
                top = self._num_free
                self._stack[top:top + len(freed)] = array.array("i", freed)
                self._num_free = top + len(freed)
        return freed

    def reset(self, held: np.ndarray) -> None:
        """held bool [P]: sets refcount 1 on held pages and frees every other page (one
        commit); page 0 is never held."""
        refcount = held.astype(np.int32)
        refcount[0] = 0
        idle = np.flatnonzero(refcount[1:] == 0)[::-1].astype(np.int32) + 1
        with deferred_signals():
            self._ref[:] = array.array("i", refcount.tobytes())
            self._stack[:idle.size] = array.array("i", idle.tobytes())
            self._num_free = int(idle.size)

    def check_invariants(self) -> None:
        """Raises AssertionError unless the free stack holds exactly the pages at refcount 0,
        once each, and page 0 is never handed out."""
        ref, free = self.refcount, np.frombuffer(self._stack, np.int32)[:self._num_free]
        assert (ref >= 0).all(), "negative refcount"
        assert ref[0] == 0, "null page was handed out"
        assert len(set(free.tolist())) == free.size, "page on the free list twice"
        assert (free > 0).all() and (ref[free] == 0).all(), "free page in use"
        assert self._num_free == int((ref[1:] == 0).sum()), "page leaked"
