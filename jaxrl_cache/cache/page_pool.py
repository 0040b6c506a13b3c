"""Reference-counted physical KV pages with vectorised bulk alloc/free.

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
    else:
        ids = _integer_array(pages, name).tolist()
    if ids and (min(ids) <= 0 or max(ids) >= num_pages):
        raise ValueError(f"{name}: page ids must be in 1..{num_pages - 1}, got {ids}")
    return ids


class PagePool:
    def __init__(self, num_pages: int):
        num_pages = as_count(num_pages, "num_pages", minimum=2, maximum=2**31 - 1)  # int32 ids
        self.num_pages = num_pages
        # [P] refcounts and [P - 1] the free stack (top at the end), each a Python array and
        # a numpy view of the same memory: the per-request path (a few dozen pages) loops
        # over the Python arrays, whose items Python code reads and writes far faster than
        # numpy scalars or numpy calls on tiny arrays; bulk paths use the numpy views
        self._ref = array.array("i", bytes(4 * num_pages))
        self.refcount = np.frombuffer(self._ref, np.int32)
        self._stack = array.array("i", range(num_pages - 1, 0, -1))
        self._free = np.frombuffer(self._stack, np.int32)
        self._num_free = num_pages - 1

    @property
    def num_free(self) -> int:
        return self._num_free

    def take(self, n: int) -> np.ndarray:
        """Hands out n free pages with refcount 1."""
        n = as_count(n, "n")
        if n > self._num_free:
            raise CacheFullError(f"take({n}) with only {self._num_free} free pages")
        with deferred_signals():
            return np.array(self._take(n), np.int32)

    def incref(self, pages: np.ndarray) -> None:
        """Adds one reference per entry; every page must already be held (refcount >= 1)."""
        pages = as_page_list(pages, self.num_pages)
        if not self._held(pages):
            raise ValueError(f"incref of free pages: {[p for p in pages if self._ref[p] < 1]}")
        with deferred_signals():
            self._incref_list(pages)

    def decref(self, pages: np.ndarray, *, distinct: bool = False) -> None:
        """Drops one reference per entry; pages reaching 0 become free. Repeats are allowed
        unless the caller promises `distinct` (a faster path)."""
        pages = as_page_ids(pages, self.num_pages)
        pages, counts = (pages, 1) if distinct else np.unique(pages, return_counts=True)
        if (self.refcount[pages] < counts).any():
            raise ValueError(f"released pages that were not held: {pages}")
        with deferred_signals():
            self._decref(pages, counts)

    # Unchecked steps for callers that have checked and hold a deferred_signals() section.
    def _take(self, n: int) -> array.array:
        """n free pages, lowest first, each set to refcount 1."""
        top, ref = self._num_free, self._ref
        pages = self._stack[top - n:top]
        pages.reverse()
        for p in pages:
            ref[p] = 1
        self._num_free = top - n
        return pages

    def _held(self, pages) -> bool:
        """Whether every entry has refcount >= 1."""
        ref = self._ref
        for p in pages:
            if ref[p] < 1:
                return False
        return True

    def _incref_list(self, pages) -> None:
        """Adds one reference per entry (repeats allowed)."""
        ref = self._ref
        for p in pages:
            ref[p] += 1

    def _decref_parts(self, parts) -> bool:
        """Drops one reference per entry of each sequence in `parts` (repeats allowed); pages
        reaching 0 become free. If some entry was not held, undoes every drop and returns
        False (nothing changed): one pass, with no separate check, for the release path."""
        ref, freed = self._ref, []
        for i, part in enumerate(parts):
            for j, p in enumerate(part):
                left = ref[p] - 1
                if left <= 0:
                    if left < 0:
                        for done in parts[:i] + (part[:j],):
                            self._incref_list(done)
                        return False
                    freed.append(p)
                ref[p] = left
        if freed:
            self._stack[self._num_free:self._num_free + len(freed)] = array.array("i", freed)
            self._num_free += len(freed)
        return True

    def _decref(self, pages: np.ndarray, counts) -> None:
        """pages int32 [n] distinct, each losing `counts` (int or int [n]) references."""
        self.refcount[pages] -= counts
        freed = pages[self.refcount[pages] == 0]
        self._free[self._num_free:self._num_free + freed.size] = freed
        self._num_free += freed.size

    def reset(self, held: np.ndarray) -> None:
        """Sets refcount 1 on held pages (bool [P]) and frees every other page (one commit)."""
        refcount = held.astype(np.int32)
        refcount[0] = 0
        free = np.zeros_like(self._free)
        idle = np.flatnonzero(refcount[1:] == 0)[::-1].astype(np.int32) + 1
        free[:idle.size] = idle
        self.refcount[:], self._free[:], self._num_free = refcount, free, int(idle.size)
