"""Ctrl-C at any line: each radix-cache / page-pool call completes or leaves no trace.

A SIGINT is simulated at every line, call and return event executed inside jaxrl_cache/cache/
and jaxrl_cache/interrupts.py (sys.settrace): the trace function hands the signal to whatever
Python handler is installed at that moment, exactly as CPython would between bytecodes. After
each run: invariants hold, no reference leaked (refcounts == trie + lease holdings), the
handlers are restored, and the state equals either the state before the call or the state of
an uninterrupted run.
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
from jaxrl_cache.cache import Lease, RadixCache
from jaxrl_cache.errors import CacheFullError, PinnedPagesError

PS = 4
TRACED = (str(pathlib.Path(jaxrl_cache.cache.__file__).parent), interrupts.__file__)
SYS = [7] * 4 + [8] * 4
# a simulated signal that lands in a generator being closed is reported as "ignored"
pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")


def scenario():
    """Versions 0 and 1 cached, part of version 1 pinned by a live lease, 3 pages free."""
    cache = RadixCache(16, PS)
    for v, prompts in ((0, [SYS + [1] * 4, [2] * 8]), (1, [SYS + [3] * 4, SYS + [4] * 5])):
        for p in prompts:
            lease = Lease()
            m = cache.match(v, p, lease=lease)
            own = cache.alloc(len(p) // PS - m.pages.size, lease=lease)
            cache.insert(v, p, np.concatenate([m.pages, own]))
            cache.release(lease)
    live = Lease()
    cache.match(1, SYS + [3] * 4, lease=live)
    writer = Lease()
    cache.alloc(2, lease=writer)  # pages a request wrote, about to be inserted
    return cache, live, writer


def snapshot(cache, *leases):
    trie = frozenset(cache.page_entries())
    pool = cache.pool
    return (cache.page_refcounts().tobytes(), sorted(pool._free[:pool.num_free].tolist()),
            cache._in_trie.tobytes(), trie, tuple(cache._counters.items()),
            tuple(tuple(sorted(lease.pages.tolist())) for lease in leases))


def nothing(cache, live, writer):
    pass


def drop_live(cache, live, writer):
    cache.release(live)


OPS = {  # name: (prepare, the call under test)
    "match": (nothing, lambda c, live, w: c.match(1, SYS + [3] * 4 + [5], lease=live)),
    "acquire_evicting": (nothing, lambda c, live, w: c.acquire(1, [SYS + [4] * 4, SYS], 5,
                                                               lease=live)),
    "alloc_evicting": (nothing, lambda c, live, w: c.alloc(6, lease=w)),
    "insert": (nothing, lambda c, live, w: c.insert(1, [9] * 8, w.pages)),
    "insert_releasing": (nothing, lambda c, live, w: c.insert(1, [9] * 8, w.pages, release=w)),
    "insert_releasing_pins": (nothing, lambda c, live, w: c.insert(
        1, SYS + [3] * 4 + [6] * 4, np.concatenate([live.pages, w.pages[:1]]), release=live)),
    "invalidate_keeping_holders": (nothing, lambda c, live, w: c.invalidate_before(2, held=True)),
    "evict": (nothing, lambda c, live, w: c.evict(3)),
    "invalidate_before": (nothing, lambda c, live, w: c.invalidate_before(1)),
    "release_lease": (nothing, lambda c, live, w: c.release(live)),
    "clear": (drop_live, lambda c, live, w: c.clear()),
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


def check_clean(cache, live, writer):
    cache.check_invariants()
    held = np.bincount(np.concatenate([live.pages, writer.pages]),
                       minlength=cache.pool.num_pages)
    np.testing.assert_array_equal(cache.page_refcounts(), held + cache._in_trie,
                                  "leaked reference")
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    assert interrupts._state.owner is None


@pytest.mark.parametrize("op", sorted(OPS))
def test_interrupt_at_every_traced_line(op):
    prepare, call = OPS[op]

    def fresh():
        state = scenario()
        prepare(*state)
        return state

    cache, live, writer = fresh()
    before = snapshot(cache, live, writer)
    counter = Injector()
    counter.run(lambda: call(cache, live, writer))
    after = snapshot(cache, live, writer)
    assert after != before, "the operation must change something for this test to mean it"
    check_clean(cache, live, writer)
    outcomes = set()
    for k in range(1, counter.count + 1):
        cache, live, writer = fresh()
        try:
            Injector(k).run(lambda: call(cache, live, writer))
            raised = False
        except KeyboardInterrupt:
            raised = True
        check_clean(cache, live, writer)
        state = snapshot(cache, live, writer)
        assert state in (before, after), f"{op}: interrupt at traced event {k} left a third state"
        outcomes.add((raised, state == after))
        # the cache keeps working: a full request cycle, then everything is released
        lease = Lease()
        m = cache.match(1, SYS + [3] * 4, lease=lease)
        cache.insert(1, SYS + [3] * 4, np.concatenate(
            [m.pages, cache.alloc(3 - m.pages.size, lease=lease)]))
        for holder in (lease, live, writer):
            cache.release(holder)
        check_clean(cache, live, writer)
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
    (acquire, insert, evict, release, invalidate), every reference held via leases. The SIGINT
    handler raises KeyboardInterrupt like the default one, but only while a cycle is armed (so
    the test's own loop is never hit) and at most once per cycle."""
    cache, leases, rng = RadixCache(24, PS), [], random.Random(0)
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
            lease = Lease()
            leases.append(lease)
            try:
                (m,), fresh = cache.acquire(v, [prompt], 4 - len(prompt) // PS + 2, lease=lease)
                cache.insert(v, prompt, np.concatenate([m.pages, fresh]))
                if len(leases) % 7 == 0:
                    cache.evict(2)
            finally:
                cache.release(lease)
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
            except (CacheFullError, PinnedPagesError):  # a lease left live by an interrupt
                for lease in leases:
                    cache.release(lease)
            cycles += 1
    finally:
        stop.set()
        thread.join()
        signal.signal(signal.SIGINT, signal.default_int_handler)
    assert interrupted > 10 and cycles > interrupted
    cache.check_invariants()
    held = np.bincount(np.concatenate([lease.pages for lease in leases] + [np.zeros(0, int)]),
                       minlength=cache.pool.num_pages)
    np.testing.assert_array_equal(cache.page_refcounts(), held + cache._in_trie)
    for lease in leases:
        cache.release(lease)
    cache.clear()
    assert cache.pool.num_free == cache.pool.num_pages - 1
