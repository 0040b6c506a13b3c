"""Ctrl-C at any line: each radix-cache / page-pool call completes or leaves no trace.

A SIGINT is simulated at every line, call and return event executed inside jaxrl_cache/cache/
and jaxrl_cache/interrupts.py (sys.settrace): the trace function hands the signal to whatever
Python handler is installed at that moment, exactly as CPython would between bytecodes. After
each run: invariants hold, the handlers are restored, the state equals either the state
before the call or the state of an uninterrupted run, and no reference leaked (refcounts ==
trie + the test's holdings) except the pages a call handing them out (match, acquire, alloc)
had committed when the interrupt hit its return: those stay held until `reconcile` (as the
engine does after an interrupted call) rebuilds the pool.
"""
import os
import pathlib
import random
import signal
import sys
import threading
import time

import numpy as np
import pytest

import jaxrl_cache.cache
import jaxrl_cache.interrupts as interrupts
from jaxrl_cache.cache import RadixCache

PS = 4
TRACED = (str(pathlib.Path(jaxrl_cache.cache.__file__).parent), interrupts.__file__)
SYS = [7] * 4 + [8] * 4
NONE = np.zeros(0, np.int32)
# a simulated signal that lands in a generator being closed is reported as "ignored"
pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")


def scenario():
    """Versions 0 and 1 cached, part of version 1 held by a live request, 2 pages a writer
    holds, 3 pages free. Returns (cache, holdings: name -> int32 [n] pages held)."""
    cache = RadixCache(16, PS)
    for v, prompts in ((0, [SYS + [1] * 4, [2] * 8]), (1, [SYS + [3] * 4, SYS + [4] * 5])):
        for p in prompts:
            m = cache.match(v, p)
            pages = np.concatenate([m.pages, cache.alloc(len(p) // PS - m.pages.size)])
            cache.insert(v, p, pages, release=pages)
    held = dict(live=cache.match(1, SYS + [3] * 4).pages, writer=cache.alloc(2), got=NONE)
    return cache, held


def snapshot(cache):
    return (cache.pool.refcount.tobytes(), cache.pool.num_free, cache._in_trie.tobytes(),
            frozenset(cache.page_entries()), tuple(cache._counters.items()))


def nothing(cache, h):
    pass


def drop_live(cache, h):
    cache.release(h.pop("live"))


def acquire(c, h):
    matches, fresh = c.acquire(1, [SYS + [4] * 4, SYS], 5)
    h["got"] = np.concatenate([m.pages for m in matches] + [fresh])


def insert_releasing(c, h):
    c.insert(1, [9] * 8, h["writer"], release=h["writer"])
    h["writer"] = NONE


def insert_releasing_matched(c, h):
    c.insert(1, SYS + [3] * 4 + [6] * 4, np.concatenate([h["live"], h["writer"][:1]]),
             release=h["live"])
    h["live"] = NONE


def release_live(c, h):
    c.release(h["live"])
    h["live"] = NONE


HANDS_OUT = {"match", "acquire_evicting", "alloc_evicting"}
OPS = {  # name: (prepare, the call under test, which updates the holdings after it)
    "match": (nothing, lambda c, h: h.update(got=c.match(1, SYS + [3] * 4 + [5]).pages)),
    "acquire_evicting": (nothing, acquire),
    "alloc_evicting": (nothing, lambda c, h: h.update(got=c.alloc(6))),
    "insert": (nothing, lambda c, h: c.insert(1, [9] * 8, h["writer"])),
    "insert_releasing": (nothing, insert_releasing),
    "insert_releasing_matched": (nothing, insert_releasing_matched),
    "invalidate_keeping_holders": (nothing, lambda c, h: c.invalidate_before(2, held=True)),
    "evict": (nothing, lambda c, h: c.evict(3)),
    "invalidate_before": (nothing, lambda c, h: c.invalidate_before(1)),
    "release": (nothing, release_live),
    "clear": (drop_live, lambda c, h: c.clear()),
}


class Injector:
    """Counts traced events; at event number `fire_at` delivers a simulated SIGINT."""

    def __init__(self, fire_at=None):
        self.count, self.fire_at = 0, fire_at

    def __call__(self, frame, event, arg):
        if not frame.f_code.co_filename.startswith(TRACED):
            return None
        if event in ("call", "line", "return"):
            self.count += 1
            if self.count == self.fire_at:
                signal.getsignal(signal.SIGINT)(signal.SIGINT, frame)
        return self

    def run(self, fn):
        sys.settrace(self)
        try:
            fn()
        finally:
            sys.settrace(None)


def check_clean(cache, h, exact=True):
    """Invariants hold and the handlers are restored; exact: every reference is the trie's
    or in the holdings h, else (a hand-out interrupted at its return) some may be extra."""
    cache.check_invariants()
    held = np.bincount(np.concatenate([*h.values(), NONE]), minlength=cache.pool.num_pages)
    extra = cache.pool.refcount - held - cache._in_trie
    assert not extra.any() if exact else (extra >= 0).all(), "leaked reference"
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    assert interrupts._state.owner is None


@pytest.mark.parametrize("op", sorted(OPS))
def test_interrupt_at_every_traced_line(op):
    prepare, call = OPS[op]

    def fresh():
        cache, h = scenario()
        prepare(cache, h)
        return cache, h

    cache, h = fresh()
    before = snapshot(cache)
    counter = Injector()
    counter.run(lambda: call(cache, h))
    after = snapshot(cache)
    assert after != before, "the operation must change something for this test to mean it"
    check_clean(cache, h)
    # what the caller holds if an interrupt hits after the commit: the uninterrupted run's
    # holdings, less any pages handed out (lost with the return value)
    committed = dict(h, got=NONE)
    outcomes = set()
    for k in range(1, counter.count + 1):
        cache, h = fresh()
        try:
            Injector(k).run(lambda: call(cache, h))
            raised = False
        except KeyboardInterrupt:
            raised = True
        state = snapshot(cache)
        assert state in (before, after), f"{op}: interrupt at traced event {k} left a third state"
        if raised and state == after:
            h = committed
        check_clean(cache, h, exact=not (raised and state == after and op in HANDS_OUT))
        outcomes.add((raised, state == after))
        # quiescent again: reconcile repairs what was lost, then a full request cycle works
        for pages in h.values():
            cache.release(pages)
        cache.reconcile(keep_versions=cache.versions())
        check_clean(cache, {})
        m = cache.match(1, SYS + [3] * 4)
        pages = np.concatenate([m.pages, cache.alloc(3 - m.pages.size)])
        cache.insert(1, SYS + [3] * 4, pages, release=pages)
        check_clean(cache, {})
        assert cache.pool.num_free + cache.num_evictable == cache.pool.num_pages - 1
    assert (True, False) in outcomes and (True, True) in outcomes  # both sides were hit


def test_deferred_signal_is_delivered_once_after_the_section():
    with pytest.raises(KeyboardInterrupt):
        with interrupts.deferred_signals():
            with interrupts.deferred_signals():  # nested: defers to the outer section
                signal.getsignal(signal.SIGINT)(signal.SIGINT, None)
            done = True  # still deferred
    assert done and signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_real_sigint_is_deferred_past_the_section():
    done = False
    with pytest.raises(KeyboardInterrupt):
        with interrupts.deferred_signals():
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)  # the handler would run here; it only records
            done = True
    assert done and interrupts._state.owner is None


def test_real_sigints_at_random_moments_never_corrupt_or_leak():
    """A thread fires real SIGINTs at the process while the main thread runs request cycles
    (acquire, insert, evict, release, invalidate). The SIGINT handler raises KeyboardInterrupt
    like the default one, but only while a cycle is armed (so the test's own loop is never
    hit) and at most once per cycle; after an interrupted cycle the cache is reconciled, as
    the engine does. The cache stays consistent throughout and leaks nothing."""
    cache, rng = RadixCache(24, PS), random.Random(0)
    stop, armed = threading.Event(), [False]

    def on_sigint(signum, frame):
        if armed[0]:
            armed[0] = False
            raise KeyboardInterrupt

    def fire():
        while not stop.is_set():
            time.sleep(rng.uniform(0.0002, 0.002))
            os.kill(os.getpid(), signal.SIGINT)

    def cycle(v, prompt):
        try:
            armed[0] = True
            (m,), fresh = cache.acquire(v, [prompt], 4 - len(prompt) // PS + 2)
            pages = np.concatenate([m.pages, fresh])
            try:
                cache.insert(v, prompt, pages)
                if cycles % 7 == 0:
                    cache.evict(2)
            finally:
                cache.release(pages)
            cache.invalidate_before(v)
        finally:
            armed[0] = False

    thread = threading.Thread(target=fire, daemon=True)
    interrupted = cycles = 0
    deadline = time.monotonic() + 1.5
    signal.signal(signal.SIGINT, on_sigint)
    thread.start()
    try:
        while time.monotonic() < deadline:
            try:
                cycle(cycles // 20, SYS + [cycles % 3] * 4 + [5])
            except KeyboardInterrupt:
                interrupted += 1
                cache.check_invariants()
                cache.reconcile(keep_versions=cache.versions())
            np.testing.assert_array_equal(cache.pool.refcount, cache._in_trie)
            cycles += 1
    finally:
        stop.set()
        thread.join()
        signal.signal(signal.SIGINT, signal.default_int_handler)
    assert interrupted > 10 and cycles > interrupted
    cache.check_invariants()
    cache.clear()
    assert cache.pool.num_free == cache.pool.num_pages - 1
