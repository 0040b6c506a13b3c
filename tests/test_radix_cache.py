"""Radix cache and page allocator: unit edge cases and a stateful property test."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, invariant, rule

from jaxrl_cache.errors import CacheFullError, PinnedPagesError
from jaxrl_cache.cache.page_pool import PagePool
from jaxrl_cache.cache.radix import PackedTokens, RadixCache

PS = 4


def toks(*chunks):
    return [t for c in chunks for t in c]


def run_request(cache, version, tokens, extra_pages=0):
    """match + alloc + insert of every full page; returns the pages the request holds."""
    m = cache.match(version, tokens)
    n_full = len(tokens) // PS
    own = cache.alloc(n_full - m.pages.size + extra_pages)
    held = np.concatenate([m.pages, own])
    cache.insert(version, tokens, held[:n_full])
    return m, held


class TestUnits:
    def test_prompt_shorter_than_a_page_is_never_cached(self):
        cache = RadixCache(8, PS)
        m, held = run_request(cache, 0, [1, 2, 3], extra_pages=1)
        assert m.num_tokens == 0 and cache.stats().cached_pages_by_version == {0: 0}
        cache.release(held)
        assert cache.stats().free_pages == 7
        cache.check_invariants()

    def test_exact_page_multiple_and_prefix_of_another(self):
        cache = RadixCache(16, PS)
        a = list(range(8))  # exactly two pages
        _, held = run_request(cache, 0, a)
        cache.release(held)
        longer = a + [9, 9, 9, 9, 7]
        m = cache.match(0, longer)
        assert m.num_tokens == 8 and list(m.pages) == list(held)
        cache.release(m.pages)
        m = cache.match(0, a[:6])  # a prefix of a cached prompt: one full page
        assert m.num_tokens == 4 and m.pages[0] == held[0]
        cache.release(m.pages)
        cache.check_invariants()

    def test_versions_are_separate_namespaces(self):
        cache = RadixCache(16, PS)
        _, held = run_request(cache, 0, list(range(8)))
        cache.release(held)
        assert cache.match(1, list(range(8))).num_tokens == 0
        assert cache.match(0, list(range(8))).num_tokens == 8

    def test_eviction_is_lru_and_leaf_first(self):
        cache = RadixCache(7, PS)  # 6 usable pages
        _, a = run_request(cache, 0, toks([1] * 4, [2] * 4, [3] * 4))  # path of 3
        cache.release(a)
        _, b = run_request(cache, 0, toks([5] * 4, [6] * 4))  # newer path of 2
        cache.release(b)
        fresh = cache.alloc(2)  # 1 free + must evict 1: the LRU leaf, a's last page
        assert cache.stats().evicted_pages == 1
        assert cache.match(0, toks([1] * 4, [2] * 4, [3] * 4)).num_tokens == 8  # middle kept
        cache.release(cache.match(0, [5] * 4 + [6] * 4).pages)
        cache.release(fresh)
        cache.check_invariants()

    def test_eviction_takes_the_oldest_version_first_then_lru(self):
        cache = RadixCache(8, PS)  # 7 usable pages
        _, new = run_request(cache, 1, toks([1] * 4, [2] * 4))  # version 1, used first
        cache.release(new)
        _, old = run_request(cache, 0, toks([3] * 4, [4] * 4))  # version 0, used last
        cache.release(old)
        _, old2 = run_request(cache, 0, toks([5] * 4))  # version 0, most recent of all
        cache.release(old2)
        assert cache.evict(2) == 2  # version 0's least recently used path, leaf first
        assert cache.peek(0, toks([3] * 4, [4] * 4)) == 0 and cache.peek(0, [5] * 4) == 1
        assert cache.evict(1) == 1  # version 0's last page before any of version 1
        assert cache.stats().cached_pages_by_version == {0: 0, 1: 2}
        assert cache.evict(1) == 1 and cache.peek(1, toks([1] * 4, [2] * 4)) == 1
        cache.check_invariants()

    def test_reconcile_keeps_every_listed_namespace(self):
        cache = RadixCache(16, PS)
        for v in (0, 1, 2):
            _, held = run_request(cache, v, toks([v] * 4, [9] * 4))
            cache.release(held)
        live = cache.match(2, [2] * 4)  # a reference an interrupted caller left behind
        cache.reconcile(keep_versions=(0, 2))
        assert cache.versions() == [0, 2]
        assert cache.stats().cached_pages_by_version == {0: 2, 2: 2}
        assert cache.stats().in_use_pages == 0 and live.num_tokens == 4  # refcounts rebuilt
        assert cache.pool.num_free == 15 - 4
        cache.reconcile(keep_versions=())
        assert cache.versions() == [] and cache.pool.num_free == 15
        with pytest.raises(TypeError, match="keep_versions"):
            cache.reconcile(keep_versions=2)
        with pytest.raises(TypeError, match="keep_versions"):
            cache.reconcile(keep_versions=[1.5])
        cache.check_invariants()

    def test_pool_incref_counts_repeats_and_refuses_free_pages(self):
        cache = RadixCache(8, PS)
        pages = cache.alloc(2)
        cache.pool.incref([pages[0], pages[0], pages[1]])
        assert cache.pool.refcount[pages].tolist() == [3, 2]
        before = cache.pool.refcount.copy()
        with pytest.raises(ValueError, match="incref of free pages"):
            cache.pool.incref([pages[0], 7])  # page 7 is free: nothing changes
        np.testing.assert_array_equal(cache.pool.refcount, before)
        cache.release([pages[0], pages[0], pages[0], pages[1], pages[1]])
        assert cache.pool.num_free == 7
        cache.check_invariants()

    def test_pool_take_decref_return_freed_pages_and_refuse_unheld_ones(self):
        pool = PagePool(6)
        pages = pool.take(3)
        assert pages.tolist() == [1, 2, 3] and pool.num_free == 2
        pool.incref(pages[:1])
        with pytest.raises(ValueError, match="not held"):
            pool.decref([1, 2, 2, 2])  # page 2 has one reference: nothing changes
        assert pool.refcount.tolist() == [0, 2, 1, 1, 0, 0] and pool.num_free == 2
        assert pool.decref([1, 2, 1]) == [2, 1] and pool.num_free == 4
        with pytest.raises(CacheFullError):
            pool.take(5)
        assert sorted(pool.take(4).tolist()) == [1, 2, 4, 5]
        with pytest.raises(ValueError):  # a read-only view for callers
            pool.refcount[1] = 0
        pool.check_invariants()

    def test_pool_exhaustion_raises_and_changes_nothing(self):
        cache = RadixCache(5, PS)
        m, held = run_request(cache, 0, list(range(8)), extra_pages=1)  # 3 pinned
        before = cache.pool.refcount.copy()
        with pytest.raises(CacheFullError, match="need 2 KV pages but only 1"):
            cache.alloc(2)
        np.testing.assert_array_equal(cache.pool.refcount, before)
        cache.release(held)
        assert len(cache.alloc(4)) == 4  # evicts the two cached pages
        cache.check_invariants()

    def test_duplicate_insert_is_released_back(self):
        cache = RadixCache(16, PS)
        tokens = list(range(8))
        _, first = run_request(cache, 0, tokens)
        second = cache.alloc(2)
        assert cache.insert(0, tokens, second) == 0
        cache.release(second)
        cache.release(first)
        s = cache.stats()
        assert s.cached_pages == 2 and s.free_pages == 13
        cache.check_invariants()

    def test_invalidate_frees_older_versions_only(self):
        cache = RadixCache(16, PS)
        for v in (0, 1, 2):
            _, held = run_request(cache, v, [v] * 8)
            cache.release(held)
        assert cache.invalidate_before(2) == 4
        assert cache.versions() == [2]
        assert cache.stats().invalidated_pages == 4
        cache.check_invariants()

    def test_invalidate_while_pinned_raises_and_changes_nothing(self):
        cache = RadixCache(16, PS)
        _, held = run_request(cache, 0, list(range(8)))
        before = (cache.pool.refcount.copy(), cache.versions())
        with pytest.raises(PinnedPagesError, match="held by live requests"):
            cache.invalidate_before(1)
        np.testing.assert_array_equal(cache.pool.refcount, before[0])
        assert cache.versions() == before[1]
        cache.release(held)
        assert cache.invalidate_before(1) == 2

    def test_release_of_unheld_page_raises_and_changes_nothing(self):
        cache = RadixCache(8, PS)
        pages = cache.alloc(1)
        cache.release(pages)
        with pytest.raises(ValueError, match="not held"):
            cache.release(pages)
        cache.check_invariants()


SYSTEM = toks([7] * PS, [8] * PS)  # a shared two-page system prefix
PROMPTS = [SYSTEM + [1] * 5, SYSTEM + [1] * 4 + [2] * 4, SYSTEM + [2] * 9, [3] * 12, SYSTEM,
           SYSTEM + [1] * 4 + [2] * 4 + [5]]


class CacheMachine(RuleBasedStateMachine):
    """Random request lifecycles across versions; accounting checked after every step, every
    eviction checked against an oracle built from page_entries and the refcounts alone."""
    requests = Bundle("requests")

    def __init__(self):
        super().__init__()
        self.cache = RadixCache(20, PS)
        self.written_by = {}  # page -> version whose params wrote its KV (oracle)
        self.live = {}
        self.next_id = 0
        self.min_version = 0

    @rule(target=requests, version=st.integers(0, 3), prompt=st.sampled_from(PROMPTS),
          extra=st.integers(0, 3))
    def start(self, version, prompt, extra):
        version = max(version, self.min_version)
        m = self.cache.match(version, prompt)
        for p in m.pages:
            assert self.written_by[int(p)] == version, "match crossed versions"
        need = len(prompt) // PS - m.pages.size + extra
        before = self.cache.pool.refcount.copy()
        try:
            own = self.cache.alloc(need)
        except CacheFullError:
            np.testing.assert_array_equal(self.cache.pool.refcount, before)
            self.cache.release(m.pages)
            return None
        for p in own:
            self.written_by[int(p)] = version  # this request writes their KV
        rid = self.next_id
        self.next_id += 1
        self.live[rid] = (version, prompt, np.concatenate([m.pages, own]))
        return rid

    @rule(rid=requests)
    def insert(self, rid):
        if rid in self.live:
            version, prompt, held = self.live[rid]
            self.cache.insert(version, prompt, held[:len(prompt) // PS])

    @rule(rid=requests)
    def finish(self, rid):
        if rid in self.live:
            self.cache.release(self.live.pop(rid)[2])

    @rule(n=st.integers(0, 6))
    def evict(self, n):
        """Oracle: repeatedly drop the cached leaf page (no page below it, no holder) of the
        oldest version, least recently stamped first (a node's pages share a stamp: deepest
        first)."""
        entries = {(v, page): (parent, stamp) for v, page, parent, _, stamp
                   in self.cache.page_entries()}
        ref, victims = self.cache.pool.refcount, set()
        for _ in range(n):
            parents = {(v, parent) for (v, _), (parent, _) in entries.items()}
            leaves = [(v, stamp, -depth(entries, v, page), page)
                      for (v, page), (_, stamp) in entries.items()
                      if (v, page) not in parents and ref[page] == 1]
            if not leaves:
                break
            v, _, _, page = min(leaves)
            victims.add(page)
            del entries[(v, page)]
        before = {page for _, page, _, _, _ in self.cache.page_entries()}
        assert self.cache.evict(n) == len(victims)
        assert before - {page for _, page, _, _, _ in self.cache.page_entries()} == victims

    @rule(version=st.integers(0, 4))
    def invalidate(self, version):
        stale_pages = sum(n for v, n in self.cache.stats().cached_pages_by_version.items()
                          if v < version)
        pinned = any(v < version and (held.size and
                                      self.cache._in_trie[held].any())
                     for v, _, held in self.live.values())
        before = (self.cache.pool.refcount.copy(), self.cache.versions())
        try:
            assert self.cache.invalidate_before(version) == stale_pages
            assert not pinned, "invalidation succeeded while stale pages were pinned"
            self.min_version = max(self.min_version, version)
        except PinnedPagesError:
            assert pinned
            np.testing.assert_array_equal(self.cache.pool.refcount, before[0])
            assert self.cache.versions() == before[1]

    @rule(version=st.integers(0, 4))
    def invalidate_keeping_holders(self, version):
        """kv_policy "keep": stale pages leave the trie, live requests keep theirs."""
        self.cache.invalidate_before(version, held=True)
        self.min_version = max(self.min_version, version)
        for _, _, held in self.live.values():
            assert (self.cache.pool.refcount[held] >= 1).all()

    @invariant()
    def accounting(self):
        self.cache.check_invariants()
        held = np.bincount(np.concatenate([h for _, _, h in self.live.values()] + [[]])
                           .astype(int), minlength=self.cache.pool.num_pages)
        trie = np.zeros_like(held)  # no page leaked: holders + trie are every reference
        trie[[page for _, page, _, _, _ in self.cache.page_entries()]] = 1
        np.testing.assert_array_equal(self.cache.pool.refcount, held + trie)


def depth(entries, version, page):
    """Pages from the root down to `page` in an entries map (version, page) -> (parent, _)."""
    return 0 if not page else 1 + depth(entries, version, entries[(version, page)][0])


CacheMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40,
                                          deadline=None)
TestCacheMachine = CacheMachine.TestCase


def test_acquire_cache_full_counts_no_lookup_and_keeps_lru_stamps():
    cache = RadixCache(6, PS)  # 5 usable pages
    _, held = run_request(cache, 0, list(range(8)))  # 2 cached pages, then released
    cache.release(held)
    stamps = cache.page_entries()
    before = cache.stats()
    # the matched path (2 pages) is pinned, so 3 free pages cannot give 4
    with pytest.raises(CacheFullError, match="need 4 KV pages but only 3"):
        cache.acquire(0, [list(range(8))], 4)
    assert cache.stats() == before
    assert cache.page_entries() == stamps
    matches, fresh = cache.acquire(0, [list(range(8)), [50] * 4], 3)
    assert [m.num_tokens for m in matches] == [8, 0] and fresh.size == 3
    assert cache.stats().lookups == before.lookups + 2
    cache.release(np.concatenate([matches[0].pages, fresh]))
    cache.check_invariants()


def test_insert_checks_every_page_before_linking_any():
    cache = RadixCache(16, PS)
    _, held = run_request(cache, 0, list(range(8)))
    mine = cache.alloc(2)
    before = (cache.pool.refcount.copy(), cache.stats())
    with pytest.raises(ValueError, match="already cached under another prefix or listed twice"):
        cache.insert(0, [9] * 8, np.array([mine[0], held[1]]))  # 2nd page cached elsewhere
    with pytest.raises(ValueError, match="listed twice"):
        cache.insert(0, [9] * 8, np.array([mine[0], mine[0]]))
    free = np.flatnonzero(cache.pool.refcount[1:] == 0)[:1] + 1
    with pytest.raises(ValueError, match="held by no one"):
        cache.insert(0, [9] * 4, free)
    np.testing.assert_array_equal(cache.pool.refcount, before[0])
    assert cache.stats() == before[1] and cache.match(0, [9] * 4).num_tokens == 0
    cache.check_invariants()


def test_token_arguments_are_checked():
    cache = RadixCache(8, PS)
    assert cache.match(0, np.arange(8)).num_tokens == 0  # integer arrays are token sequences
    for bad, error in (("abcd", TypeError), ([1, 2.0], TypeError), ([1, -1], ValueError),
                       (np.zeros((2, 4), int), TypeError), (None, TypeError)):
        with pytest.raises(error, match="tokens"):
            cache.match(0, bad)
    assert cache.stats().lookups == 1
    cache.check_invariants()


def test_pages_inserted_past_a_duplicate_prefix_block_its_eviction():
    """Two requests prefill the same 3-page prefix concurrently; the second's insert hangs
    its 4th page below the first's copy, which it does not hold. Until that page is
    released, the prefix above it is cached but not evictable: alloc must refuse cleanly."""
    cache = RadixCache(8, PS)  # 7 usable pages
    p0, p1 = toks([7] * 4, [8] * 4, [1] * 5), toks([7] * 4, [8] * 4, [1] * 4, [2] * 4)
    held0, held1 = cache.alloc(3), cache.alloc(4)  # both matched nothing, both prefill
    assert cache.insert(0, p0, held0) == 3
    assert cache.insert(0, p1, held1) == 1  # its first 3 pages are duplicates
    cache.release(held0)
    assert cache.stats().cached_pages == 3 and cache.num_evictable == 0
    cache.check_invariants()
    before = cache.pool.refcount.copy()
    with pytest.raises(CacheFullError):
        cache.alloc(1)
    np.testing.assert_array_equal(cache.pool.refcount, before)
    cache.release(held1)  # its 3 duplicates are freed, its 4th page stays cached
    assert cache.num_evictable == 4 and cache.available_pages == 7
    assert cache.alloc(7).size == 7
    cache.check_invariants()


def test_walks_match_an_oracle():
    """peek/acquire/insert of the same data, a prefix and an extension (lists, tuples or
    PackedTokens), across splits and evictions: every answer equals that of an oracle built
    from page_entries (version, parent page, page key) alone."""
    rng = np.random.default_rng(0)
    cache = RadixCache(64, PS)
    base = [int(t) for t in rng.integers(0, 3, 6 * PS)]

    def oracle(version, tokens):
        child = {(v, parent, key): page for v, page, parent, key, _ in cache.page_entries()}
        parent, n = 0, 0
        for i in range(len(tokens) // PS):
            key = np.asarray(tokens[i * PS:(i + 1) * PS], "<i4").tobytes()
            parent = child.get((version, parent, key))
            if parent is None:
                break
            n += 1
        return n

    for step in range(120):
        version = int(rng.integers(0, 2))
        cut = int(rng.integers(0, len(base) + 1))
        tokens = base[:cut] + [int(t) for t in rng.integers(0, 3, int(rng.integers(0, 9)))]
        tokens = (tokens, tuple(tokens), PackedTokens.of(tokens))[step % 3]
        listed = list(tokens.tolist() if isinstance(tokens, PackedTokens) else tokens)
        n_full = len(listed) // PS
        half = tokens.head(len(listed) // 2) if step % 3 == 2 else tokens[:len(listed) // 2]
        head = tokens.head(cut) if step % 3 == 2 else tokens[:cut]
        for probe, plain in ((tokens, listed), (half, listed[:len(listed) // 2]),
                             (tokens, listed)):  # same, prefix, extension
            assert cache.peek(version, probe) == oracle(version, plain)
        (m,), fresh = cache.acquire(version, [head], n_full)
        assert m.pages.size == oracle(version, listed[:cut])
        cache.insert(version, tokens, np.concatenate([m.pages, fresh])[:n_full])
        cache.release(np.concatenate([m.pages, fresh]))
        assert cache.peek(version, tokens) == oracle(version, listed) == n_full
        if step % 17 == 16:
            cache.evict(int(rng.integers(1, 8)))
        cache.check_invariants()


TOKEN_IDS = st.lists(st.integers(0, 2**31 - 1), max_size=40)


@given(TOKEN_IDS, TOKEN_IDS)
def test_packed_tokens_extend_equals_packing_the_whole_sequence(head, tail):
    packed = PackedTokens.of(head)
    whole = packed.extend(tail)
    assert whole == PackedTokens.of(head + tail) == np.asarray(head + tail, "<i4").tobytes()
    assert whole.num_tokens == len(head + tail) and whole.tolist() == head + tail
    assert whole.head(len(head)) == packed and PackedTokens.of(whole) is whole


def test_packed_tokens_refuse_what_token_lists_refuse():
    for bad, error in (("abcd", TypeError), ([1, 2.0], TypeError), ([1, -1], ValueError),
                       ([2**31], ValueError), (np.zeros((2, 4), int), TypeError),
                       ([True, False], TypeError), (None, TypeError)):
        with pytest.raises(error, match="tokens"):
            PackedTokens.of(bad)
        with pytest.raises(error, match="tokens"):
            PackedTokens.of([1, 2]).extend(bad)


def test_insert_releasing_equals_insert_then_release_and_changes_nothing_on_error():
    def state(cache):
        return cache.page_entries(), cache.pool.refcount.tolist(), cache.pool.num_free

    caches = RadixCache(32, PS), RadixCache(32, PS)
    for i, tokens in enumerate([list(range(10)), list(range(8)) + [5] * 6, [7] * 9]):
        for merged, cache in enumerate(caches):
            m = cache.match(0, tokens[:4])
            fresh = cache.alloc(len(tokens) // PS - m.pages.size + 1)
            pages = np.concatenate([m.pages, fresh])
            if merged:
                cache.insert(0, tokens, pages, release=pages)
            else:
                cache.insert(0, tokens, pages)
                cache.release(pages)
            cache.check_invariants()
        assert state(caches[0]) == state(caches[1])
    cache = caches[1]
    held = cache.alloc(2)
    before = state(cache)
    unheld = np.concatenate([held, np.flatnonzero(cache.pool.refcount[1:] == 0)[:1] + 1])
    with pytest.raises(ValueError, match="not held"):
        cache.insert(0, [3] * 8, held, release=unheld)
    assert state(cache) == before and cache.peek(0, [3] * 8) == 0
    with pytest.raises(TypeError, match="release"):
        cache.insert(0, [3] * 8, held, release="all")
    assert state(cache) == before
    cache.insert(0, [3] * 8, held, release=held)
    assert cache.peek(0, [3] * 8) == 2 and cache.stats().in_use_pages == 0
    cache.check_invariants()
