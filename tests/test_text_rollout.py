"""Text through the rollout engine (rollout/text.py) on the committed qwen2 fixture and its
tokenizer: text prompts and chat messages become the same ids, samples carry decoded text,
stop strings cut samples exactly where a brute-force reference (decode every prefix) does,
and the cut rows leave a consistent radix cache that the audit and the trainer accept."""
import dataclasses
import json

import jax
import numpy as np
import pytest
import tokenizers
from hypothesis import example, given, settings, strategies as st

from jaxrl_cache.models import from_pretrained, load_tokenizer
from jaxrl_cache.models.tokenizer import Tokenizer
from jaxrl_cache.rl.audit import audit_attribution
from jaxrl_cache.rl.batch import make_batch
from jaxrl_cache.rollout import (CacheConfig, RolloutEngine, SamplingParams,
                                 SchedulerConfig)
from jaxrl_cache.rollout.scheduler import Row
from jaxrl_cache.rollout.text import RowText
from tests.hf_fixtures import FIXTURES

# One engine shape for every test (pool, slots, chunk, table width 8): few compilations.
CACHE = CacheConfig(num_pages=96, page_size=8)
SCHED = SchedulerConfig(max_num_seqs=8, chunk_steps=8)
NEW = 20
TEXTS = ["the cat sat on the mat", "a tiny test, with punctuation!"]  # 12 and 17 tokens


@pytest.fixture(scope="module")
def model():
    config, params = from_pretrained(FIXTURES / "qwen2", dtype="float32")
    return config, params, load_tokenizer(FIXTURES / "qwen2")


def make_engine(model, **kw):
    config, _, tok = model
    return RolloutEngine(config, CACHE, scheduler_config=SCHED, backend="xla",
                         **{"tokenizer": tok, **kw})


def run(engine, params, prompts, seed=0, **kw):
    sampling = SamplingParams(**{"n": 4, "max_new_tokens": NEW, **kw})
    return engine.rollout(params, 0, prompts, sampling, rng=jax.random.key(seed))


def same_samples(a, b, text=True):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert (x.prompt_ids, x.output_ids, x.finish_reason) == \
               (y.prompt_ids, y.output_ids, y.finish_reason)
        # a radix hit computes the prompt's KV in another packing: float noise only
        np.testing.assert_allclose(x.output_logprobs, y.output_logprobs, atol=1e-5)
        assert not text or x.text == y.text


def reference(tok, raw, stops, include=False):
    """Brute force: the first prefix of the unstopped output whose text contains a stop
    string -> (tokens kept, text, hit)."""
    for k in range(1, len(raw) + 1):
        text = tok.decode(raw[:k])
        hits = [(text.find(s), -len(s)) for s in stops if s in text]
        if hits:
            at, neg = min(hits)
            return raw[:k], text[:at - neg if include else at], True
    return raw, tok.decode(raw), False


# ---------------------------------------------------------------- prompts
# Every rollout below prefills 2 prompts of <= 32 new tokens, on a fresh engine unless a
# radix hit is the point: two prefill shapes in all.
def test_text_and_chat_prompts_are_their_token_ids(model):
    config, params, tok = model
    ids = [tok.encode(t) for t in TEXTS]
    by_ids = run(make_engine(model), params, ids)
    mixed = run(make_engine(model), params, [TEXTS[0], ids[1]])  # one call may mix forms
    same_samples(mixed.samples, by_ids.samples)
    assert [s.text for s in by_ids.samples] == [tok.decode(s.output_ids)
                                                 for s in by_ids.samples]
    plain = run(make_engine(model, tokenizer=None), params, ids)
    same_samples(plain.samples, by_ids.samples, text=False)
    assert all(s.text is None for s in plain.samples)

    # transformers' apply_chat_template(add_generation_prompt=True) on the fixture
    want = json.loads((FIXTURES / "qwen2" / "tokenizer_expected.json").read_text())
    short = ids[0][:6]
    chat = run(make_engine(model), params, [want["messages"], short])
    assert [s.prompt_ids for s in chat.samples] == [tuple(want["chat_ids"])] * 4 + \
        [tuple(short)] * 4
    same_samples(chat.samples, run(make_engine(model), params,
                                   [want["chat_ids"], short]).samples)


# ---------------------------------------------------------------- stop strings
def spans(tok, kept, stop) -> bool:
    """The first occurrence of `stop` in decode(kept) starts before the last token's text."""
    return 0 <= tok.decode(kept).find(stop) < len(tok.decode(kept[:-1]))


def spanning_stop(tok, samples):
    """A 2-character stop string made of the last character of one output token and the
    first of the next, whose first occurrence in a sample really spans two tokens."""
    for s in samples:
        out = list(s.output_ids)
        for t in range(len(out) - 1):
            a, b = tok.decode(out[t:t + 1]), tok.decode(out[t + 1:t + 2])
            if a and b and spans(tok, reference(tok, out, [a[-1] + b[0]])[0], a[-1] + b[0]):
                return a[-1] + b[0]
    raise AssertionError("no two adjacent non-empty tokens in the raw outputs")


@pytest.mark.parametrize("include", [False, True])
def test_stop_strings_cut_where_the_brute_force_reference_does(model, include):
    """The same rng without and with stop strings: each stopped sample is the prefix of its
    unstopped twin up to the token whose decoded prefix first contains a stop string (rows
    hit mid-chunk; device tokens past the cut are discarded)."""
    config, params, tok = model
    raw = run(make_engine(model), params, TEXTS)
    stops = (spanning_stop(tok, raw.samples), "!")
    # the asynchronous engine keeps per-token versions: they are cut with the tokens
    engine = make_engine(model, kv_policy="recompute" if include else "wait")
    engine.sync_weights(params, 0)  # asynchronous mode: a rollout needs synced weights
    batch = run(engine, params, TEXTS, stop=stops, include_stop_str_in_output=include)
    cut_mid_chunk = spanned = 0
    for r, s in zip(raw.samples, batch.samples):
        kept, text, hit = reference(tok, list(r.output_ids), stops, include)
        assert s.output_ids == tuple(kept) and len(s.token_versions) == len(kept)
        np.testing.assert_array_equal(s.output_logprobs, r.output_logprobs[:len(kept)])
        assert s.text == text
        assert s.finish_reason == ("stop" if hit else r.finish_reason)
        if hit:
            assert any(s.text.endswith(x) for x in stops) == include
            cut_mid_chunk += len(kept) < len(r.output_ids) and len(kept) % SCHED.chunk_steps
            spanned += spans(tok, kept, stops[0])
    assert cut_mid_chunk and spanned


def test_cut_rows_leave_a_consistent_cache_audit_and_batch(model):
    """Rows cut by stop strings retire with their kept tokens: the radix cache holds exactly
    their written tokens (prompt + output but the last), a repeat call reuses pages and
    returns the same samples, prompts continuing cut samples hit every full page of them,
    and the audit (token ids, a dense teacher-forced forward) passes on all of them."""
    config, params, tok = model
    engine = make_engine(model)
    stop = dict(stop=("cat", "on"))
    first = run(engine, params, TEXTS, seed=2, **stop)  # a seed whose cut outputs span pages
    engine.cache.check_invariants()
    cut = [s for s in first.samples if s.finish_reason == "stop" and len(s.output_ids) < NEW]
    again = run(engine, params, TEXTS, seed=2, **stop)
    same_samples(again.samples, first.samples)
    assert again.cached_tokens > first.cached_tokens
    ps = CACHE.page_size
    picked = sorted(cut, key=lambda s: -len(s.output_ids))[:2]  # the longest cut samples
    assert len(picked) == 2
    cont = run(engine, params, [s.prompt_ids + s.output_ids for s in picked], seed=1, **stop)
    # the trie holds prompt + output but the last token of each: every full page of it hits
    want = [(len(s.prompt_ids) + len(s.output_ids) - 1) // ps * ps for s in picked]
    assert [s.cached_tokens for s in cont.samples[::4]] == want
    assert max(w - len(s.prompt_ids) for w, s in zip(want, picked)) > 0  # output KV reused
    engine.cache.check_invariants()
    for batch in (first, cont):
        report = audit_attribution(batch, {0: params}, config, tolerance=1e-4)
        assert report.ok, report
    train = make_batch(first, np.arange(len(first.samples), dtype=np.float32))
    assert sum(len(b) for b in train.behavior_logprobs) == first.generated_tokens


# ---------------------------------------------------------------- incremental decoding
def byte_tokenizer() -> Tokenizer:
    """A byte-level BPE without merges: one token per UTF-8 byte, so a multi-byte character
    spans tokens and most prefixes end in an incomplete character."""
    alphabet = sorted(tokenizers.pre_tokenizers.ByteLevel.alphabet())
    backend = tokenizers.Tokenizer(tokenizers.models.BPE({c: i for i, c in enumerate(alphabet)},
                                                         []))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = tokenizers.decoders.ByteLevel()
    return Tokenizer(backend, {}, None, ())


def metaspace_tokenizer() -> Tokenizer:
    """SentencePiece-style: "▁" marks spaces and decoding drops the first one (a window
    decoded on its own differs from the same tokens inside the whole text)."""
    pieces = ["<unk>", *sorted(set(CHARS + "▁")), "▁a", "▁b", "▁é"]
    backend = tokenizers.Tokenizer(tokenizers.models.BPE(
        {p: i for i, p in enumerate(pieces)}, [("▁", "a"), ("▁", "b"), ("▁", "é")],
        unk_token="<unk>"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Metaspace(prepend_scheme="first")
    backend.decoder = tokenizers.decoders.Metaspace(prepend_scheme="first")
    return Tokenizer(backend, {}, None, ())


CHARS = "ab é✓\n"
TOKENIZERS = {"bytes": byte_tokenizer(), "metaspace": metaspace_tokenizer()}


@pytest.mark.parametrize("kind", TOKENIZERS)
@settings(max_examples=40, deadline=None)
@given(text=st.text(CHARS, min_size=1, max_size=24),
       stops=st.lists(st.text(CHARS + "\ufffd", min_size=1, max_size=3), min_size=1,
                      max_size=3),
       include=st.booleans(), chunk=st.integers(1, 7))
# the first byte of "é" decodes to U+FFFD: a stop string holding it ends at that token (the
# search used to wait for the character to complete and keep one token too many)
@example(text="aé", stops=["\ufffd"], include=False, chunk=1)
@example(text="é✓b", stops=["é\ufffd"], include=True, chunk=3)
def test_incremental_stop_search_matches_the_brute_force_reference(kind, text, stops, include,
                                                                   chunk):
    """Tokens arrive in chunks; the row is cut and its text equals the reference's, also
    for stop strings and characters split across byte tokens, and stop strings holding the
    U+FFFD an incomplete character decodes to."""
    tok = TOKENIZERS[kind]
    ids = tok.encode(text)
    rows = RowText(tok, SamplingParams(stop=tuple(stops),
                                         include_stop_str_in_output=include))
    row = Row(index=0, group=0, prompt=(1,), pages=np.zeros(0, np.int32), cached_tokens=0,
              max_new=8)
    for lo in range(0, len(ids), chunk):
        row.tokens += ids[lo:lo + chunk]
        for per_token in (row.logprobs, row.token_versions, row.mixed):
            per_token += [0] * len(ids[lo:lo + chunk])
        if rows.stop_rows([None, row], []) == [1]:
            break
    kept, want, hit = reference(tok, ids, stops, include)
    assert row.tokens == kept
    assert len(row.logprobs) == len(row.token_versions) == len(row.mixed) == len(kept)
    assert (row.finish_reason == "stop") == hit
    assert rows.sample_text(row) == want


# ---------------------------------------------------------------- bad input
@pytest.mark.parametrize("stop,error,match", [
    ("at", TypeError, "sequence of strings"), (("at", 3), TypeError, r"stop\[1\]"),
    (("",), ValueError, r"stop\[0\] is an empty"), (None, TypeError, "sequence of strings")])
def test_bad_stop_strings_are_typed_errors(stop, error, match):
    with pytest.raises(error, match=match):
        SamplingParams(stop=stop)


def test_include_stop_str_in_output_must_be_a_bool():
    with pytest.raises(TypeError, match="include_stop_str_in_output must be a bool"):
        SamplingParams(include_stop_str_in_output="yes")


def test_bad_text_inputs_are_refused_before_any_work(model):
    config, params, tok = model
    plain = make_engine(model, tokenizer=None)
    engine = make_engine(model)
    ids = tok.encode(TEXTS[0])

    def refuses(eng, prompts, error, match, **kw):
        with pytest.raises(error, match=match):
            run(eng, params, prompts, **kw)

    refuses(plain, [ids, TEXTS[0]], TypeError, "prompt 1 is text.*tokenizer=")
    refuses(plain, [[{"role": "user", "content": "hi"}]], TypeError, "prompt 0 is chat")
    refuses(plain, [ids], ValueError, "stop strings.*tokenizer", stop=("a",))
    refuses(engine, [ids], ValueError, r"stop\[1\] contains the special token '<\|im_end\|>'.*"
            r"stop_token_ids=\(2,\)", stop=("a", "x<|im_end|>"))
    refuses(engine, TEXTS[0], TypeError, "prompts must be a list")
    refuses(engine, [""], ValueError, "prompt 0 is empty")
    refuses(engine, [ids, [{"role": "user"}]], ValueError, "prompt 1: message 0 has no 'content'")
    refuses(engine, [[{"role": 1, "content": "x"}]], TypeError, "role must be a str")
    for content in (None, 3, ["x"]):  # used to fail inside the template, naming no prompt
        refuses(engine, [ids, [{"role": "user", "content": content}]], TypeError,
                "prompt 1: message 0 content must be a str")
    # content parts are passed on, but this ChatML template concatenates content as text
    refuses(engine, [[{"role": "user", "content": [{"type": "text", "text": "x"}]}]],
            ValueError, "prompt 0: the chat template failed on these messages: TypeError")
    no_template = Tokenizer(tok.backend, {}, None, ())
    refuses(make_engine(model, tokenizer=no_template), [[{"role": "user", "content": "x"}]],
            ValueError, "chat_template")
    stats = engine.cache.stats()
    assert stats.lookups == 0 and stats.free_pages == CACHE.num_pages - 1
    with pytest.raises(TypeError, match="tokenizer must be"):
        make_engine(model, tokenizer=tok.backend)
    with pytest.raises(ValueError, match="vocab_size"):
        RolloutEngine(dataclasses.replace(config, vocab_size=32), CACHE, tokenizer=tok)
