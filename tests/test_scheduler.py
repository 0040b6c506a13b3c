"""Scheduler host functions, without a model: page planning, packing, chunk bookkeeping."""
import numpy as np
import pytest
from hypothesis import given, strategies as st

from jaxrl_cache.rollout import runner, scheduler
from jaxrl_cache.rollout.scheduler import Row
from jaxrl_cache.shapes import page_width_bucket

PS = 4


@pytest.mark.parametrize("prompt_len,max_new,want", [
    (8, 1, 2),   # exact pages, one token: its KV is never written
    (8, 2, 3),   # the first output token's KV needs a third page
    (5, 4, 2),   # 5 + 3 written positions = 8
    (1, 1, 1),
])
def test_row_pages(prompt_len, max_new, want):
    assert scheduler.row_pages(prompt_len, max_new, PS) == want


@given(st.lists(st.booleans(), min_size=1, max_size=300))
def test_slot_bucket_covers_every_occupied_slot(occupied):
    """Decode computes slots[:bucket]: every occupied slot lies below it, it is never 1 (the
    1-row decode that copies the pool) and never more than the slots (or 2), and it takes
    one of few values (2 or a power of 4) unless capped at the slot count."""
    slots = [object() if o else None for o in occupied]
    rows = runner.slot_bucket(slots)
    assert all(i < rows for i, s in enumerate(slots) if s is not None)
    assert 2 <= rows <= max(len(slots), 2)
    assert rows in (2, len(slots)) or (rows & (rows - 1) == 0 and rows.bit_length() % 2 == 1)


@given(st.integers(1, 1 << 20))
def test_page_width_bucket_holds_the_row_with_bounded_padding(n):
    """The engine's table width: never smaller than the row, a fixed point (a width is its
    own bucket), monotone, under 25% padding past 8 pages, with at most three significant
    bits (so at most four widths per doubling)."""
    width = page_width_bucket(n)
    assert width >= n and page_width_bucket(width) == width
    assert page_width_bucket(n + 1) >= width
    if n > 8:
        assert (width - n) / n < 0.25
        assert width >> (width.bit_length() - 3) << (width.bit_length() - 3) == width
    else:
        assert width in (1, 2, 4, 8)


def _brute_force_need(prompt_len, cached, rows, max_new):
    """Pages the unit's rows hold in total, minus the shared ones, counted position by position."""
    positions = prompt_len + max_new - 1
    pages_per_row = -(-positions // PS)
    shared_full = prompt_len // PS  # full prompt pages: one copy for the unit
    fresh_shared = shared_full - cached // PS
    return fresh_shared, pages_per_row - shared_full


@pytest.mark.parametrize("prompt_len", [1, 3, 4, 5, 8, 13])
@pytest.mark.parametrize("cached_pages", [0, 1, 2])
@pytest.mark.parametrize("max_new", [1, 2, 7])
def test_unit_page_need_matches_brute_force(prompt_len, cached_pages, max_new):
    if cached_pages * PS > prompt_len - 1:
        return  # a match never covers the last prompt token
    got = scheduler.unit_page_need(prompt_len, cached_pages * PS, 3, max_new, PS)
    assert got == _brute_force_need(prompt_len, cached_pages * PS, 3, max_new)


def test_layout_unit_shares_prefix_and_splits_own_pages():
    prompt = tuple(range(10))  # 2 full pages + a partial one
    matched = np.array([7], np.int32)
    shared, own = scheduler.unit_page_need(10, 4, 3, 5, PS)  # 1 shared, 2 own per row
    fresh = np.arange(20, 20 + shared + 3 * own, dtype=np.int32)
    unit = scheduler.layout_unit(2, prompt, 6, matched, fresh, 3, 5, PS)
    assert unit.cached_tokens == 4 and unit.new_tokens == 6
    assert [r.index for r in unit.rows] == [6, 7, 8]
    assert [r.pages.tolist() for r in unit.rows] == [[7, 20, 21, 22], [7, 20, 23, 24],
                                                     [7, 20, 25, 26]]
    with pytest.raises(ValueError, match="fresh pages"):
        scheduler.layout_unit(2, prompt, 6, matched, fresh[:-1], 3, 5, PS)


def test_pack_prefill_packs_tails_and_copies_partial_pages():
    a = scheduler.layout_unit(0, tuple(range(1, 11)), 0, np.array([5], np.int32),
                              np.arange(10, 13, dtype=np.int32), 2, 3, PS)
    b = scheduler.layout_unit(1, (9, 9, 9, 9), 2, np.zeros(0, np.int32),
                              np.array([30, 31], np.int32), 1, 3, PS)
    arrays = runner.pack_prefill([(a, [3, 0]), (b, [1])], num_tokens=16, num_seqs=4,
                                    width=8, num_slots=4, page_size=PS)
    # unit a: cached 4 tokens, computes 6 (positions 4..9); unit b computes its 4 tokens
    assert arrays.tokens[:10].tolist() == list(range(5, 11)) + [9, 9, 9, 9]
    assert arrays.token_pos[:10].tolist() == list(range(4, 10)) + [0, 1, 2, 3]
    assert (arrays.token_pos[10:] == -1).all()
    assert arrays.token_seq[:10].tolist() == [0] * 6 + [1] * 4
    assert arrays.cu_q_lens.tolist() == [0, 6, 10, 10, 10]
    assert arrays.kv_lens.tolist() == [10, 4, 0, 0]
    assert arrays.page_table[0, :3].tolist() == a.rows[0].pages.tolist() == [5, 10, 11]
    # both rows of a start from a's last prompt token; b's row from b's
    assert arrays.logit_slot[[3, 0, 1]].tolist() == [5, 5, 9]
    # a's second row (slot 0) copies the partial page (index 2) of the first row; b is exact
    assert (arrays.copy_src[0], arrays.copy_dst[0]) == (a.rows[0].pages[2], a.rows[1].pages[2])
    assert arrays.copy_src[[1, 2, 3]].tolist() == [0, 0, 0]


def test_pack_decode_and_apply_chunk_track_positions_and_finish():
    fresh = Row(index=0, group=0, prompt=(1, 2, 3), pages=np.array([4, 5], np.int32),
                cached_tokens=0, max_new=5)
    running = Row(index=1, group=0, prompt=(1, 2, 3), pages=np.array([4, 6], np.int32),
                  cached_tokens=0, max_new=5, fresh=False, tokens=[7, 8], logprobs=[-1.0, -2.0])
    slots = [fresh, None, running]
    arrays = runner.pack_decode(slots, width=4)
    assert arrays.fresh.tolist() == [True, False, False]
    assert arrays.position.tolist() == [3, 0, 4]  # fresh: prompt length; running: its last
    assert arrays.last_token.tolist() == [0, 0, 8]
    assert arrays.budget.tolist() == [5, 0, 3]
    assert arrays.emitted.tolist() == [0, 0, 2]
    assert arrays.page_table[2].tolist() == [4, 6, 0, 0]
    assert arrays.shared_pages.size == 0
    # page 4 is both rows' first page and neither writes it (positions 3, 4 >= page size 2)
    assert runner.shared_prefix(slots, page_size=2) == 1
    assert runner.shared_prefix(slots, page_size=4) == 0  # row 0 writes page 4 next
    cut = runner.pack_decode(slots, width=4, shared=1)
    assert cut.shared_pages.tolist() == [4] and cut.page_table[[0, 2]].tolist() == [
        [5, 0, 0], [6, 0, 0]]
    tokens = np.array([[9, 9, 0], [0, 0, 0], [1, 2, 3]], np.int32)
    logprobs = -np.ones((3, 3), np.float32)
    done = scheduler.apply_chunk(slots, tokens, logprobs, np.array([2, 0, 3]),
                                 np.array([False, False, False]), version=0)
    assert done == [2] and running.finish_reason == "length"
    assert running.tokens == [7, 8, 1, 2, 3] and fresh.tokens == [9, 9] and not fresh.fresh
    done = scheduler.apply_chunk([fresh], tokens[:1], logprobs[:1], np.array([1]),
                                 np.array([True]), version=0)
    assert done == [0] and fresh.finish_reason == "stop" and fresh.tokens == [9, 9, 9]
    assert fresh.prompt == (1, 2, 3) and scheduler.written_outputs(fresh) == [9, 9]


def test_resumed_row_re_prefills_its_context_and_continues_its_stream():
    """kv_policy "recompute": a running row's KV is dropped at a weight update; it comes back
    as a one-row unit prefilling prompt + tokens, then draws its next token from that
    prefill (fresh) at the position after its last token."""
    row = Row(index=5, group=2, prompt=(1, 2, 3), pages=np.zeros(0, np.int32),
              cached_tokens=0, max_new=8, fresh=False, tokens=[7, 8, 9], logprobs=[-1.0] * 3,
              resume=True)
    assert runner.pack_decode([row], width=4).budget.tolist() == [0]
    # context 6 tokens, 8 - 3 = 5 more to emit: pages for 6 + 5 - 1 = 10 positions at page 4
    matched = np.array([11], np.int32)  # first 4 context tokens cached
    unit = scheduler.resume_unit(row, matched, np.array([12, 13], np.int32), 4)
    assert unit.prompt == (1, 2, 3, 7, 8, 9) and unit.cached_tokens == 4
    assert unit.new_tokens == 2 and unit.rows == (row,)
    assert row.pages.tolist() == [11, 12, 13] and row.fresh and not row.resume
    arrays = runner.pack_decode([row], width=4)
    assert arrays.fresh.tolist() == [True] and arrays.position.tolist() == [6]
    assert arrays.emitted.tolist() == [3] and arrays.budget.tolist() == [5]
    prefill = runner.pack_prefill([(unit, [0])], 4, 1, 4, 1, 4)
    assert prefill.tokens[:2].tolist() == [8, 9] and prefill.token_pos[:2].tolist() == [4, 5]
    assert prefill.kv_lens.tolist() == [6] and prefill.logit_slot.tolist() == [1]
    with pytest.raises(ValueError, match="fresh pages"):
        scheduler.resume_unit(row, matched, np.array([12], np.int32), 4)


def test_tokens_over_kv_of_another_version_are_mixed():
    row = Row(index=0, group=0, prompt=(1, 2), pages=np.array([1], np.int32),
              cached_tokens=0, max_new=9, kv_now={3}, kv_versions={3})
    tokens, logprobs = np.array([[5, 6]], np.int32), np.zeros((1, 2), np.float32)
    scheduler.apply_chunk([row], tokens, logprobs, np.array([2]), np.array([False]), 3)
    scheduler.apply_chunk([row], tokens, logprobs, np.array([1]), np.array([False]), 4)
    assert row.token_versions == [3, 3, 4] and row.mixed == [False, False, True]
    assert row.kv_now == {3, 4} and row.kv_versions == {3, 4}
