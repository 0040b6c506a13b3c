"""Host-side cache bookkeeping: the GRPO match+insert trace, ours vs sglang-jax's RadixCache,
and the invalidation ack path.

The trace (`grpo_trace`): 64 prompts x 8 samples, 512-token prompts sharing a 256-token
system prefix, 64 output tokens per sample, page 16, run at 2 versions (the second trie is
built while the first is still cached). One op = one match or one insert; the token tuples
are converted inside the timed flows (sglang-jax: `list(...)` per call; ours: each prompt
packed once and each sequence extending it by its output, as the engine keys a row).

Flows (`run_ours`, `run_ours_units`, `run_theirs`):
- per sample (ours): peek (pages to plan), acquire (the matched pages plus fresh ones),
  insert of prompt + output releasing them;
- engine units (ours): as RolloutEngine admits a GRPO group: one peek + acquire for the
  group's rows, prompt pages shared by the rows, the prompt inserted after its prefill,
  then per row an insert releasing its pages (still 2 ops counted per sample);
- sglang-jax per sample: match_prefix + inc_lock_ref, insert + dec_lock_ref.
Ours runs twice: each cache call in a signal-deferring section of its own (a caller outside
the engine: two sigaction syscalls per call), and each rollout call inside one section as
the engine runs it (`RolloutEngine._serialized`), where the cache's sections nest.

sglang-jax is never vendored: its `radix_cache.py` (and `base_prefix_cache.py`, which it
imports) is loaded at run time from a checkout named by SGLANG_JAX_SRC (the repository root
or its `python/` folder); its other imports are stubbed. Without it those benchmarks skip.

Script: `python -m benchmarks.test_bench_radix [--rounds N] [--json PATH]` prints ops/s of
every flow and the ratios (and writes them to PATH).
"""
from __future__ import annotations

import importlib.util
import os
import pathlib
import sys
import time
import types

import numpy as np
import pytest

from benchmarks.timing import best_interleaved
from jaxrl_cache.cache.radix import PackedTokens, RadixCache
from jaxrl_cache.interrupts import allow_signals, deferred_signals

PAGE = 16
VERSIONS = (0, 1)


def grpo_trace(num_prompts=64, group=8, prompt_len=512, system_len=256, output_len=64,
               seed=0):
    """[(prompt, prompt + output) per sample], prompt-major; token tuples as the engine has."""
    rng = np.random.default_rng(seed)
    system = rng.integers(0, 32000, system_len).tolist()
    trace = []
    for _ in range(num_prompts):
        prompt = tuple(system + rng.integers(0, 32000, prompt_len - system_len).tolist())
        for _ in range(group):
            trace.append((prompt, prompt + tuple(rng.integers(0, 32000, output_len).tolist())))
    return trace


def trace_ops(trace) -> int:
    return 2 * len(trace) * len(VERSIONS)  # one match + one insert per sample per version


def rollout_call(fn, *args, engine_lock: bool):
    """One rollout call's cache traffic. engine_lock: run it as RolloutEngine._serialized
    runs every call (one deferred_signals section around it, allow_signals inside), so each
    cache call's own commit section is nested and swaps no signal handler; without it every
    cache call opens (and closes) a top-level section of its own."""
    if not engine_lock:
        return fn(*args)
    with deferred_signals():
        return allow_signals(fn, *args)


def packed(trace):
    """Per sample of the trace: (prompt, prompt + output) as PackedTokens, each prompt packed
    once and each sample's sequence extending it by its output, as the engine keys a row."""
    last = packed_prompt = None
    for prompt, seq in trace:
        if prompt is not last:
            last, packed_prompt = prompt, PackedTokens.of(prompt)
        yield packed_prompt, packed_prompt.extend(seq[len(prompt):])


def run_ours(trace, engine_lock=False):
    """Per sample: peek, acquire, insert releasing the pages (see module); one rollout call
    per version."""
    cache = RadixCache(8192, PAGE)

    def call(version):
        for prompt, seq in packed(trace):
            n_fresh = seq.num_tokens // PAGE - cache.peek(version, prompt)
            (match,), fresh = cache.acquire(version, [prompt], n_fresh)
            pages = np.concatenate([match.pages, fresh])
            cache.insert(version, seq, pages, release=pages)

    for version in VERSIONS:
        rollout_call(call, version, engine_lock=engine_lock)
    return cache


def run_ours_units(trace, group=8, engine_lock=False):
    """As RolloutEngine admits a unit of `group` samples of one prompt: one peek + acquire for
    the unit (shared prompt pages + each row's own), rows share the prompt pages
    (pool.incref), the prompt is inserted after its prefill, then per sample: insert of
    prompt + output releasing the row's pages. Still one match + one insert counted per
    sample; one rollout call per version."""
    cache = RadixCache(8192, PAGE)
    samples = list(packed(trace))

    def call(version):
        for u in range(0, len(samples), group):
            prompt = samples[u][0]
            shared = prompt.num_tokens // PAGE - cache.peek(version, prompt)
            own = samples[u][1].num_tokens // PAGE - prompt.num_tokens // PAGE
            (match,), fresh = cache.acquire(version, [prompt], shared + group * own)
            prefix = np.concatenate([match.pages, fresh[:shared]])
            cache.pool.incref(np.tile(prefix, group - 1))
            cache.insert(version, prompt, prefix)
            for j, (_, seq) in enumerate(samples[u:u + group]):
                row = np.concatenate([prefix, fresh[shared + j * own:shared + (j + 1) * own]])
                cache.insert(version, seq, row, release=row)

    for version in VERSIONS:
        rollout_call(call, version, engine_lock=engine_lock)
    return cache


# ------------------------------------------------------------------ sglang-jax, loaded live
def sglang_jax_radix():
    """sglang-jax's radix_cache module from SGLANG_JAX_SRC, or None if not given/found."""
    root = os.environ.get("SGLANG_JAX_SRC")
    if not root:
        return None
    root = pathlib.Path(root)
    src = next((d / "sgl_jax/srt/mem_cache" for d in (root / "python", root)
                if (d / "sgl_jax/srt/mem_cache/radix_cache.py").is_file()), None)
    if src is None:
        return None
    if "sgl_jax.srt.mem_cache.radix_cache" in sys.modules:
        return sys.modules["sgl_jax.srt.mem_cache.radix_cache"]
    for name in ("sgl_jax", "sgl_jax.srt", "sgl_jax.srt.mem_cache"):
        sys.modules.setdefault(name, types.ModuleType(name))
    stubs = {"sgl_jax.srt.mem_cache.allocator": "BaseTokenToKVPoolAllocator",
             "sgl_jax.srt.mem_cache.memory_pool": "ReqToTokenPool"}
    for name, cls in stubs.items():  # only type annotations in radix_cache
        module = types.ModuleType(name)
        setattr(module, cls, type(cls, (), {}))
        sys.modules.setdefault(name, module)
    for name in ("base_prefix_cache", "radix_cache"):
        full = f"sgl_jax.srt.mem_cache.{name}"
        spec = importlib.util.spec_from_file_location(full, src / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[full] = module
        spec.loader.exec_module(module)
    return sys.modules["sgl_jax.srt.mem_cache.radix_cache"]


def run_theirs(rc, trace):
    """sglang-jax's scheduler calls: match_prefix + inc_lock_ref at admission, insert of the
    finished sequence + dec_lock_ref (cache_finished_req); version as the extra_key
    namespace; fresh KV slots from a bump counter (their allocator is not in the module)."""
    base = sys.modules["sgl_jax.srt.mem_cache.base_prefix_cache"]
    cache = rc.RadixCache(None, None, page_size=PAGE)
    next_slot = 0
    for version in VERSIONS:
        extra = f"v{version}"
        for prompt, seq in trace:
            m = cache.match_prefix(base.MatchPrefixParams(key=rc.RadixKey(list(prompt), extra)))
            cache.inc_lock_ref(m.last_device_node)
            n_new = len(seq) // PAGE * PAGE - len(m.device_indices)
            value = np.concatenate([m.device_indices,
                                    np.arange(next_slot, next_slot + n_new, dtype=np.int32)])
            next_slot += n_new
            cache.insert(base.InsertParams(key=rc.RadixKey(list(seq), extra), value=value))
            cache.dec_lock_ref(m.last_device_node)
    return cache


# ------------------------------------------------------------------ pytest-benchmark
@pytest.mark.parametrize("engine_lock", [False, True])
def test_grpo_match_insert(benchmark, engine_lock):
    trace = grpo_trace()
    cache = benchmark(run_ours, trace, engine_lock=engine_lock)
    benchmark.extra_info["ops_per_s"] = trace_ops(trace) / benchmark.stats.stats.mean
    stats = cache.stats()
    benchmark.extra_info["hit_rate"] = stats.hit_rate
    # per version: the first sample of each prompt but the first hits the system prefix,
    # the other 7 the whole prompt; every sample's own 4 output pages are new
    assert stats.lookups == len(trace) * len(VERSIONS)
    assert stats.hit_rate == pytest.approx((63 * 256 + 64 * 7 * 512) / (512 * 512))
    cache.check_invariants()
    assert stats.cached_pages_by_version == {v: 16 + 64 * 16 + 512 * 4 for v in VERSIONS}


@pytest.mark.parametrize("engine_lock", [False, True])
def test_grpo_match_insert_engine_units(benchmark, engine_lock):
    trace = grpo_trace()
    cache = benchmark(run_ours_units, trace, engine_lock=engine_lock)
    benchmark.extra_info["ops_per_s"] = trace_ops(trace) / benchmark.stats.stats.mean
    cache.check_invariants()
    assert cache.stats().cached_pages_by_version == {v: 16 + 64 * 16 + 512 * 4 for v in VERSIONS}
    assert cache.pool.num_free + cache.stats().cached_pages == cache.pool.num_pages - 1


def test_grpo_match_insert_sglang_jax(benchmark):
    rc = sglang_jax_radix()
    if rc is None:
        pytest.skip("set SGLANG_JAX_SRC to a sglang-jax checkout to compare")
    trace = grpo_trace()
    cache = benchmark(run_theirs, rc, trace)
    benchmark.extra_info["ops_per_s"] = trace_ops(trace) / benchmark.stats.stats.mean
    assert cache.total_size() == len(VERSIONS) * (16 + 64 * 16 + 512 * 4) * PAGE


def test_invalidate_2048_pages(benchmark):
    def setup():
        cache = RadixCache(4096, PAGE)
        rng = np.random.default_rng(1)
        for _ in range(128):  # 128 distinct 256-token prompts = 2048 pages
            prompt = rng.integers(0, 32000, 256).tolist()
            pages = cache.alloc(16)
            cache.insert(0, prompt, pages)
            cache.release(pages)
        return (cache,), {}

    dropped = benchmark.pedantic(lambda cache: cache.invalidate_before(1), setup=setup,
                                 rounds=30)
    assert dropped == 2048
    benchmark.extra_info["ms"] = benchmark.stats.stats.mean * 1e3


# ------------------------------------------------------------------ script
def main(argv=None) -> int:
    import argparse
    import json
    import platform
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", metavar="PATH", help="also write the figures here")
    args = parser.parse_args(argv)
    trace, ops = grpo_trace(), trace_ops(grpo_trace())
    rc = sglang_jax_radix()
    runs = {"ours": lambda: run_ours(trace), "ours_units": lambda: run_ours_units(trace),
            "ours_lock": lambda: run_ours(trace, engine_lock=True),
            "ours_units_lock": lambda: run_ours_units(trace, engine_lock=True)}
    if rc is not None:
        runs["theirs"] = lambda: run_theirs(rc, trace)
    best = best_interleaved(runs, args.rounds, clock=time.process_time)
    ours, units = ops / best["ours"], ops / best["ours_units"]
    ours_lock, units_lock = ops / best["ours_lock"], ops / best["ours_units_lock"]
    theirs = ops / best["theirs"] if rc else None
    rows = [("per sample, own sections", ours), ("per sample, engine lock", ours_lock),
            ("engine units, own sections", units), ("engine units, engine lock", units_lock)]
    print(f"GRPO trace, {ops} ops (match + insert), best of {args.rounds} interleaved rounds")
    for name, value in rows:
        ratio = f"  {value / theirs:.2f}x sglang-jax" if theirs else ""
        print(f"  jaxrl_cache, {name:27s}: {value:9.0f} ops/s{ratio}")
    if theirs is None:
        print("  sglang-jax RadixCache        : skipped (set SGLANG_JAX_SRC)")
    else:
        print(f"  sglang-jax, per sample                   : {theirs:9.0f} ops/s")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(dict(
            date=time.strftime("%Y-%m-%d", time.gmtime()),
            machine=f"{os.cpu_count()}-core {platform.processor() or platform.machine()} "
                    f"(CPU), Python {platform.python_version()}",
            command="SGLANG_JAX_SRC=<sglang-jax checkout> python -m benchmarks.test_bench_radix "
                    f"--rounds {args.rounds}",
            load_average_1_5_15_min=os.getloadavg(),
            timing=f"best of {args.rounds} rounds of CPU time per flow, flows interleaved",
            trace=dict(prompts=64, group=8, prompt_tokens=512, shared_prefix_tokens=256,
                       output_tokens=64, page_size=PAGE, versions=len(VERSIONS), ops=ops),
            ours_ops_per_s=ours, ours_engine_units_ops_per_s=units,
            ours_engine_lock_ops_per_s=ours_lock,
            ours_engine_units_engine_lock_ops_per_s=units_lock, sglang_jax_ops_per_s=theirs,
            ratio=ours / theirs if theirs else None,
            ratio_engine_units=units / theirs if theirs else None,
            ratio_engine_lock=ours_lock / theirs if theirs else None,
            ratio_engine_units_engine_lock=units_lock / theirs if theirs else None),
            indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
