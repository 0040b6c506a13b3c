"""Reference-counted physical KV pages with vectorised bulk alloc/free.

Pages are 1..num_pages-1; page 0 is the null page that pads page tables and is never handed
out. A page is free iff its reference count is 0.
"""
from __future__ import annotations

import numpy as np


class PagePool:
    def __init__(self, num_pages: int):
        if num_pages < 2:
            raise ValueError(f"num_pages must be >= 2 (page 0 is the null page), got {num_pages}")
        self.num_pages = num_pages
        self.refcount = np.zeros(num_pages, np.int32)  # [P]
        self._free = np.arange(num_pages - 1, 0, -1, dtype=np.int32)  # stack, top at the end
        self._num_free = num_pages - 1

    @property
    def num_free(self) -> int:
        return self._num_free

    def take(self, n: int) -> np.ndarray:
        """Hands out n free pages with refcount 1. The caller checks num_free first."""
        if n > self._num_free:
            raise AssertionError(f"take({n}) with only {self._num_free} free pages")
        pages = self._free[self._num_free - n:self._num_free][::-1].copy()
        self._num_free -= n
        self.refcount[pages] = 1
        return pages

    def incref(self, pages: np.ndarray) -> None:
        np.add.at(self.refcount, pages, 1)

    def decref(self, pages: np.ndarray, *, distinct: bool = False) -> None:
        """Drops one reference per entry; pages reaching 0 become free. Repeats are allowed
        unless the caller promises `distinct` (a faster path)."""
        pages = np.asarray(pages, np.int32)
        if pages.size == 0:
            return
        if (pages <= 0).any() or (pages >= self.num_pages).any():
            raise ValueError(f"page ids must be in 1..{self.num_pages - 1}, got {pages}")
        counts = np.bincount(pages, minlength=self.num_pages) if not distinct else None
        if (self.refcount[pages] < (1 if distinct else counts[pages])).any():
            raise ValueError(f"released pages that were not held: {pages}")
        if distinct:
            self.refcount[pages] -= 1
            freed = pages[self.refcount[pages] == 0]
        else:
            self.refcount -= counts.astype(np.int32)
            freed = np.unique(pages[self.refcount[pages] == 0])
        self._free[self._num_free:self._num_free + freed.size] = freed
        self._num_free += freed.size

    def reset(self, held: np.ndarray) -> None:
        """Sets refcount 1 on held pages (bool [P]) and frees every other page (one commit)."""
        refcount = held.astype(np.int32)
        refcount[0] = 0
        free = np.zeros_like(self._free)
        idle = np.flatnonzero(refcount[1:] == 0)[::-1].astype(np.int32) + 1
        free[:idle.size] = idle
        self.refcount, self._free, self._num_free = refcount, free, int(idle.size)
