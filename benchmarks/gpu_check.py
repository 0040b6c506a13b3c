"""Prepared GPU check: compiled Pallas kernels vs the reference, then timings.

  python -m benchmarks.gpu_check --out benchmarks/results      # on a GPU (about 4-6 min)
  python -m benchmarks.gpu_check --smoke --out /tmp/smoke      # CPU dry run, tiny shapes

(1) correctness of the compiled `pallas` kernels against the `xla` reference (the exact
    kernels, which also count the elements whose bits differ, and exact=False with planned
    and forced splits);
(2) decode at Llama-3-8B heads (Hq=32, Hkv=8, D=128), bf16, page 16, B in {1, 8, 32, 64} x
    L in {512, 4k, 16k}: GB/s of K/V moved, the fraction of the device's measured copy
    bandwidth, the roofline model's prediction (benchmarks/roofline.py), the speed ratio
    against jax.experimental.pallas.ops.gpu.paged_attention at the same shape, and the
    time of exact=False (flash-decoding) beside the exact kernel's (the cost of exactness);
(3) causal prefill of 4k tokens, exact and exact=False, at the default and alternative
    program shapes: TFLOP/s (and last, (5): `tiled_matmul` against XLA's dot at projection
    shapes, and `log_sum_exp` against XLA's logsumexp: the cost of the batch-invariant
    kernels);
(4) exactness: an engine's recorded log-probs (kernels, and the xla path) against the
    trainer's teacher-forced ones (the audit's pass over plain rows, and the train step's
    gate over packed rows), bit for bit: the number of log-probs whose bits differ and the
    max |diff|, with XLA's dots and with the batch-invariant kernels
    (JAXRL_CACHE_KERNELS=pallas: tiled_matmul, the trainer's attention on the prefill
    kernel, log_sum_exp), fp32 and bf16, and with FMA contraction switched off (exact on CPU; this
    answers it for the GPU; never fails). A variant that is not exact also says where the
    bits part (`benchmarks/exactness_probe.py`: the first block whose logits differ, layer
    0's K/V, decode vs prefill kernel, row-count effects of norm / rotary / normaliser).
Writes gpu_check.json and gpu_check.txt into --out after every section.
"""
from __future__ import annotations

import argparse
import datetime
import functools
import json
import pathlib
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from kernels_pallas import paged_decode_attention, paged_prefill_attention


def timed(fn, *args, iters=20, warmup=3) -> float:
    """Median seconds of fn(*args) over iters calls (after warmup)."""
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def copy_bandwidth(smoke: bool) -> float:
    """Bytes/s of a device-to-device copy (read + write counted)."""
    n = (1 << 20) if smoke else (1 << 30)
    x = jnp.ones((n,), jnp.bfloat16)
    copy = jax.jit(lambda a: a + jnp.bfloat16(1))
    return 2 * x.nbytes / timed(copy, x, iters=10)


def make_pool(key, pages, hkv, page_size, d, dtype, layers=None):
    """[P, Hkv, ps, D] pools, or stacked [layers, P, Hkv, ps, D] ones."""
    k1, k2 = jax.random.split(key)
    shape = (pages, hkv, page_size, d) if layers is None else (layers, pages, hkv, page_size, d)
    return (jax.random.normal(k1, shape, dtype), jax.random.normal(k2, shape, dtype))


def _err(got, want) -> float:
    return float(jnp.max(jnp.abs(got.astype(jnp.float32) - want.astype(jnp.float32))))


def _bits_differ(got, want) -> int:
    """Elements of got whose value is not want's (NaN counts as differing)."""
    return int(np.sum(np.asarray(got, np.float32) != np.asarray(want, np.float32)))


def check_correctness(backend, smoke, report):
    """Compiled kernels vs the xla reference: head sizes 64/80/96/128/256, stacked pools with
    a layer index, forced and planned splits, NaN/Inf in every slot no row may read."""
    rng = np.random.default_rng(0)
    cases = [(8, 32, 8, 128, 16, jnp.bfloat16), (4, 8, 2, 64, 64, jnp.float32),
             (4, 32, 32, 80, 16, jnp.bfloat16), (4, 28, 4, 96, 16, jnp.bfloat16),
             (2, 16, 8, 256, 16, jnp.bfloat16), (1, 28, 4, 128, 16, jnp.bfloat16)]
    if smoke:
        cases = [(2, 4, 2, 64, 16, jnp.float32), (2, 6, 2, 80, 16, jnp.float32)]
    for b, hq, hkv, d, ps, dtype in cases:
        width = 8 if smoke else 64
        layers = 2
        k, v = make_pool(jax.random.key(1), b * width + 1, hkv, ps, d, dtype, layers)
        table = np.asarray(1 + rng.permutation(b * width).reshape(b, width), np.int32)
        lens = rng.integers(1, width * ps, b).astype(np.int32)
        lens[0] = width * ps - 3  # one long row: several splits
        # Poison every slot no row reads (free pages, the null page, past each length) and
        # point unused table slots at the null page.
        used = np.zeros((b * width + 1, ps), bool)
        for row, n in enumerate(lens):
            pages = table[row, :-(-n // ps)] if n else table[row, :0]
            used[pages] = True
            if n % ps:
                used[table[row, n // ps], n % ps:] = False
            table[row, -(-n // ps):] = 0
        free = jnp.asarray(~used)[None, :, None, :, None]
        k, v = jnp.where(free, jnp.nan, k), jnp.where(free, jnp.inf, v)
        table, lens = jnp.asarray(table), jnp.asarray(lens)
        layer = jnp.int32(1)
        q = jax.random.normal(jax.random.key(2), (b, hq, d), dtype)
        want = paged_decode_attention(q, k, v, table, lens, layer=layer, backend="xla")
        exact = paged_decode_attention(q, k, v, table, lens, layer=layer, backend=backend)
        errs = [_err(exact, want)] + [
            _err(paged_decode_attention(q, k, v, table, lens, layer=layer, backend=backend,
                                        num_splits=splits, exact=False), want)
            for splits in (None, 1, 3)]
        q_lens = rng.integers(1, width * ps // 2, b)
        kv_lens = jnp.asarray(np.minimum(q_lens + rng.integers(0, width * ps // 2, b),
                                         np.asarray(lens)), jnp.int32)  # unpoisoned keys
        q_lens = np.minimum(q_lens, np.asarray(kv_lens))
        cu = jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32)
        qp = jax.random.normal(jax.random.key(3), (int(q_lens.sum()) + 3, hq, d), dtype)
        got_p = paged_prefill_attention(qp, k, v, table, cu, kv_lens, layer=layer,
                                        backend=backend)
        want_p = paged_prefill_attention(qp, k, v, table, cu, kv_lens, layer=layer,
                                         backend="xla")
        err_p = _err(got_p, want_p)
        fast_p = paged_prefill_attention(qp, k, v, table, cu, kv_lens, layer=layer,
                                         backend=backend, exact=False)
        tol = 3e-2 if dtype == jnp.bfloat16 else 2e-3  # tf32 dots on GPU for fp32
        ok = all(e < tol for e in errs + [err_p, _err(fast_p, want_p)]) and not bool(
            jnp.isnan(want).any())
        real = int(q_lens.sum())  # packed rows past it are padding
        report["correctness"].append(dict(
            shape=f"B={b} Hq={hq} Hkv={hkv} D={d} page={ps} {jnp.dtype(dtype).name}",
            decode_max_err=max(errs), prefill_max_err=err_p, ok=bool(ok),
            # the exact kernels against the references, element bits (0 in interpret mode)
            decode_bits_differ=_bits_differ(exact, want), decode_elements=int(want.size),
            prefill_bits_differ=_bits_differ(got_p[:real], want_p[:real]),
            prefill_elements=int(want_p[:real].size)))


def bench_decode(backend, smoke, report, copy_bw):
    """Decode at Llama-3-8B heads over B x L, with the roofline's prediction beside each."""
    from jax.experimental.pallas.ops.gpu import paged_attention as jax_paged

    from benchmarks.roofline import Device, predict, work_after
    hq, hkv, d, ps = (4, 2, 64, 16) if smoke else (32, 8, 128, 16)
    grid = [(2, 256)] if smoke else [(bb, ll) for bb in (1, 8, 32, 64)
                                     for ll in (512, 4096, 16384)]
    device = jax.devices()[0]
    dev = Device(num_sms=int(getattr(device, "core_count", 0) or Device.num_sms))
    for b, length in grid:
        pages_per_seq = length // ps
        k, v = make_pool(jax.random.key(0), b * pages_per_seq + 1, hkv, ps, d, jnp.bfloat16)
        table = jnp.asarray(1 + np.random.default_rng(0).permutation(
            b * pages_per_seq).reshape(b, pages_per_seq), jnp.int32)
        lens = jnp.full((b,), length, jnp.int32)
        q = jax.random.normal(jax.random.key(1), (b, hq, d), jnp.bfloat16)
        ours = jax.jit(functools.partial(paged_decode_attention, backend=backend,
                                         max_kv_len=length))
        t_ours = timed(ours, q, k, v, table, lens)
        fast = jax.jit(functools.partial(paged_decode_attention, backend=backend,
                                         max_kv_len=length, exact=False))
        t_fast = timed(fast, q, k, v, table, lens)
        moved = 2 * b * length * hkv * d * 2  # K and V, bf16
        predicted = predict(work_after(b, hq, hkv, d, length, page_size=ps,
                                       width=pages_per_seq, dev=dev), dev)
        row = dict(B=b, L=length, page=ps, ours_ms=t_ours * 1e3, fast_ms=t_fast * 1e3,
                   exact_cost=t_ours / t_fast, GBps=moved / t_ours / 1e9,
                   copy_fraction=moved / t_ours / copy_bw,
                   predicted_us=predicted["time_us"],
                   predicted_fraction=predicted["hbm_fraction"])
        try:  # JAX's own kernel uses [Hkv, P, page, D]
            kt, vt = jnp.swapaxes(k, 0, 1), jnp.swapaxes(v, 0, 1)
            splits = min(16, pages_per_seq)
            ppcb = max(1, min(8, pages_per_seq // splits))
            ref = jax.jit(functools.partial(jax_paged.paged_attention, k_splits=splits,
                                            pages_per_compute_block=ppcb, interpret=smoke))
            t_ref = timed(ref, q, kt, vt, table, lens)
            row.update(jax_ms=t_ref * 1e3, speedup_vs_jax=t_ref / t_ours)
        except Exception as e:  # noqa: BLE001 - report, keep measuring
            row.update(jax_error=f"{type(e).__name__}: {str(e)[:200]}")
        report["decode"].append(row)
        print("decode", row, flush=True)


def bench_prefill(backend, smoke, report):
    """Causal prefill of one long sequence at the default and alternative program shapes."""
    hq, hkv, d, ps = (4, 2, 64, 16) if smoke else (32, 8, 128, 16)
    tokens = 128 if smoke else 4096
    pages = tokens // ps
    k, v = make_pool(jax.random.key(0), pages + 1, hkv, ps, d, jnp.bfloat16)
    table = jnp.asarray(1 + np.arange(pages)[None], jnp.int32)
    cu = jnp.asarray([0, tokens], jnp.int32)
    kv_lens = jnp.asarray([tokens], jnp.int32)
    q = jax.random.normal(jax.random.key(1), (tokens, hq, d), jnp.bfloat16)
    variants = [(None, None, True), (None, None, False)]
    if not smoke:
        variants += [(128, 8, True), (64, 4, True), (128, 8, False)]
    for rows, warps, exact in variants:
        fn = jax.jit(functools.partial(paged_prefill_attention, backend=backend,
                                       block_rows=rows, num_warps=warps, exact=exact))
        t = timed(fn, q, k, v, table, cu, kv_lens, iters=10)
        flops = 4 * hq * d * tokens * (tokens + 1) / 2  # QK^T and PV (exact computes QK^T twice)
        row = dict(tokens=tokens, exact=exact, block_rows=rows or "default",
                   num_warps=warps or "default", ms=t * 1e3, TFLOPs=flops / t / 1e12)
        report["prefill"].append(row)
        print("prefill", row, flush=True)


MATMUL_SHAPES = (  # (rows, K, N): SmolLM2 decode and packed-training gate/up, an 8B's up
    (64, 576, 1536), (4096, 576, 1536), (4096, 1536, 576), (64, 4096, 14336),
    (4096, 4096, 14336))


def bench_matmul(backend, smoke, report):
    """The cost of batch-invariant projections: `tiled_matmul` against XLA's dot (cuBLAS or
    XLA's Triton GEMM, TF32 allowed for fp32) at projection shapes, bf16 and fp32."""
    from kernels_pallas.matmul import tiled_matmul
    shapes = ((8, 64, 96),) if smoke else MATMUL_SHAPES
    for dtype in (jnp.bfloat16, jnp.float32):
        for m, k, n in shapes:
            x = jax.random.normal(jax.random.key(0), (m, k), dtype)
            w = jax.random.normal(jax.random.key(1), (k, n), dtype)
            ours = timed(jax.jit(functools.partial(tiled_matmul, backend=backend)), x, w,
                         iters=10)
            xla = timed(jax.jit(lambda x, w: jnp.dot(x, w, preferred_element_type=jnp.float32)),
                        x, w, iters=10)
            row = dict(rows=m, k=k, n=n, dtype=jnp.dtype(dtype).name, tiled_ms=ours * 1e3,
                       xla_ms=xla * 1e3, cost=ours / xla,
                       tiled_TFLOPs=2 * m * k * n / ours / 1e12)
            report["matmul"].append(row)
            print("matmul", row, flush=True)


def bench_normaliser(backend, smoke, report):
    """The cost of the batch-invariant log-softmax normaliser: `log_sum_exp` (one program
    per 16 rows) against XLA's logsumexp, at decode and training row counts (SmolLM2's and
    Llama-3's vocabularies)."""
    from kernels_pallas.normaliser import log_sum_exp
    shapes = ((8, 300),) if smoke else ((64, 49152), (4096, 49152), (64, 128256), (4096, 128256))
    for m, v in shapes:
        x = jax.random.normal(jax.random.key(0), (m, v), jnp.float32)
        ours = timed(jax.jit(functools.partial(log_sum_exp, backend=backend)), x, iters=10)
        xla = timed(jax.jit(lambda a: jax.nn.logsumexp(a, axis=-1)), x, iters=10)
        row = dict(rows=m, vocab=v, kernel_ms=ours * 1e3, xla_ms=xla * 1e3, cost=ours / xla,
                   GBps=x.nbytes * 2 / ours / 1e9)  # the kernel reads x twice
        report["normaliser"].append(row)
        print("normaliser", row, flush=True)


EXACTNESS_VARIANTS = (  # (engine backend, JAXRL_CACHE_KERNELS, model dtype, XLA_FLAGS set)
    ("pallas", "xla", "float32", ""), ("xla", "xla", "float32", ""),
    ("pallas", "pallas", "float32", ""), ("pallas", "pallas", "bfloat16", ""),
    ("pallas", "pallas", "float32", "no-fma-ptxas"), ("pallas", "pallas", "float32", "no-fma"))
# XLA:GPU may contract a multiply and an add of the elementwise code (rotary, norms, the
# sampler's warp) into one FMA in one program's fusion and not in the other's: these sets
# switch contraction off in the PTX compiler, and in LLVM's NVPTX backend too. Every set
# must parse (an unknown XLA flag aborts the process): tests/test_gpu_check.py
FLAG_SETS = {"": "", "no-fma-ptxas": "--xla_gpu_ptx_compiler_extra_flags=--fmad=false",
             "no-fma": "--xla_gpu_ptx_compiler_extra_flags=--fmad=false "
                       "--xla_backend_extra_options=-nvptx-fma-level=0"}


def child_result(row: dict, out: str, err: str, returncode: int) -> dict:
    """row updated with an exactness child's output: line 1 its exactness row, line 2 (when
    it was not exact) where the bits part; `error` when the child failed, printed no row,
    or owed a probe it did not print. Never raises: a stray line is skipped."""
    lines = []
    for line in out.splitlines():
        try:
            lines.append(json.loads(line))
        except ValueError:
            continue
    lines = [x for x in lines if isinstance(x, dict)]
    if lines:
        row.update(lines[0])
    if len(lines) > 1 and "probe" in lines[1]:
        row.update(probe=lines[1]["probe"], probe_summary=lines[1].get("summary", ""))
    owed = bool(lines) and not lines[0].get("exact", True)
    if returncode or not lines or (owed and "probe" not in row):
        row.update(error=(err.strip() or f"exit {returncode}")[-300:])
    return row


def check_exactness(backend, smoke, report):
    """Exact numerics on this device, per variant (engine backend x the trainer's and
    projections' kernels, JAXRL_CACHE_KERNELS, x dtype): see `exactness_row`. Each variant
    runs in its own child process (the variable is read when a program is traced), all at
    once (compiling is most of their time). Never fails the script: the numbers (and any
    error) go into the report."""
    import os
    import subprocess
    import sys
    children = []
    for engine_backend, kernels, dtype, flags in EXACTNESS_VARIANTS:
        if smoke:  # interpret mode stands in for the compiled kernels; no GPU flags
            if flags:
                continue
            engine_backend = "interpret" if engine_backend == "pallas" else engine_backend
            kernels = "interpret" if kernels == "pallas" else kernels
        row = dict(engine_backend=engine_backend, kernels=kernels, dtype=dtype, flags=flags)
        env = dict(os.environ, JAXRL_CACHE_KERNELS=kernels)
        env["XLA_FLAGS"] = " ".join(filter(None, (env.get("XLA_FLAGS", ""), FLAG_SETS[flags])))
        proc = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.gpu_check", "--exactness-child",
             json.dumps(dict(engine_backend=engine_backend, dtype=dtype, smoke=smoke))],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        children.append((row, proc))
    deadline = time.monotonic() + 300
    for row, proc in children:
        try:
            out, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:  # keep what it printed: the row comes first
            proc.kill()
            out, err = proc.communicate()
            err = "timed out; " + err
        child_result(row, out, err, proc.returncode)
        print("exactness", row, flush=True)
        report["exactness"].append(row)


def exactness_row(engine_backend: str, dtype: str, smoke: bool) -> tuple[dict, dict]:
    """An engine's recorded log-probs against the trainer's, bit for bit, in this process's
    JAXRL_CACHE_KERNELS: the audit's teacher-forced pass (rl.logprobs, plain rows) over two
    calls (the second reuses the cached prefix), and the GRPO train step's own gate (packed
    rows with shared prefixes): its mismatch max and first PPO ratio (1.0 when exact).
    Returns (that row, the keyword arguments of `exactness_probe.probe` for the first
    sample)."""
    import optax
    from jaxrl_cache.models import ModelConfig, init_params
    from jaxrl_cache.rl.batch import make_batch
    from jaxrl_cache.rl.logprobs import next_token_log_probs
    from jaxrl_cache.rl.train import TrainState, train_step
    from jaxrl_cache.rollout import CacheConfig, RolloutEngine, SamplingParams
    from jaxrl_cache.shapes import bucket
    config = ModelConfig.tiny(vocab_size=512, d_model=256, n_layers=2, n_heads=8, n_kv_heads=2,
                              head_dim=64, d_ff=512, max_seq_len=512, dtype=dtype)
    params = init_params(config, jax.random.key(0))
    rng = np.random.default_rng(0)
    system = [int(t) for t in rng.integers(1, 512, 48)]
    prompts = [system + [int(t) for t in rng.integers(1, 512, 5 + i)] for i in range(4)]
    sampling = SamplingParams(n=4, max_new_tokens=8 if smoke else 32, temperature=1.0)
    engine = RolloutEngine(config, CacheConfig(num_pages=256, page_size=16),
                           backend=engine_backend)
    batches = [engine.rollout(params, 0, prompts, sampling, rng=jax.random.key(k))
               for k in range(2)]  # the second call reuses the cached prefix
    tokens = diffs = mismatched = 0
    for batch in batches:
        longest = max(len(s.prompt_ids) + len(s.output_ids) for s in batch.samples)
        # as the audit (rl/audit.py) builds them: rows and length bucketed
        rows = np.zeros((bucket(len(batch.samples), 64), bucket(longest, 64)), np.int32)
        for i, s in enumerate(batch.samples):
            rows[i, :len(s.prompt_ids) + len(s.output_ids)] = s.prompt_ids + s.output_ids
        logp = np.asarray(next_token_log_probs(params, config, rows, sampling))
        for i, s in enumerate(batch.samples):
            p, o = len(s.prompt_ids), len(s.output_ids)
            got = np.asarray(s.output_logprobs, np.float32)
            want = logp[i, p - 1:p - 1 + o]
            tokens += o
            mismatched += int((got != want).sum())
            diffs = max(diffs, float(np.abs(got - want).max(initial=0.0)))
    state = TrainState.create(params, optax.adamw(1e-6), config=config)
    rewards = [float(i % 3 == 0) for i in range(len(batches[1].samples))]
    _, metrics = train_step(state, make_batch(batches[1], rewards), audit_tolerance=1.0)
    first = batches[0].samples[0]
    step_mismatch = float(metrics["logprob_mismatch_max"])
    row = dict(tokens=tokens, bit_mismatches=mismatched, max_abs_diff=diffs,
               exact=mismatched == 0 and step_mismatch == 0.0,
               cached_tokens=batches[1].cached_tokens, step_mismatch_max=step_mismatch,
               step_ratio_max=float(metrics["ratio_max"]))
    return row, dict(params=params, config=config, backend=engine_backend,
                     tokens=list(first.prompt_ids) + list(first.output_ids), sampling=sampling)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, interpret mode")
    parser.add_argument("--exactness-child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.exactness_child:  # one exactness variant (check_exactness starts it)
        child = json.loads(args.exactness_child)
        row, probe_args = exactness_row(**child)
        print(json.dumps(row), flush=True)
        if not row["exact"] or child["smoke"]:  # where the sampler's and trainer's bits part
            from benchmarks.exactness_probe import probe, summary
            result = probe(**probe_args)
            print(json.dumps(dict(probe=result, summary=summary(result))), flush=True)
        return
    backend = "interpret" if args.smoke else "pallas"
    device = jax.devices()[0]
    report = dict(date=datetime.date.today().isoformat(), device=device.device_kind,
                  platform=device.platform, jax=jax.__version__, backend=backend,
                  correctness=[], exactness=[], decode=[], prefill=[], matmul=[],
                  normaliser=[])
    t0 = time.perf_counter()
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    sections = (  # most wanted first; written after each one: a timeout keeps what ran
        lambda: check_correctness(backend, args.smoke, report),
        lambda: check_exactness(backend, args.smoke, report),
        lambda: bench_matmul(backend, args.smoke, report),
        lambda: bench_normaliser(backend, args.smoke, report),
        lambda: bench_prefill(backend, args.smoke, report),
        lambda: report.update(copy_GBps=copy_bandwidth(args.smoke) / 1e9),
        lambda: bench_decode(backend, args.smoke, report, report["copy_GBps"] * 1e9))
    for section in sections:
        try:
            section()
        except Exception as e:  # noqa: BLE001 - recorded; the next section still runs
            report.setdefault("errors", []).append(f"{type(e).__name__}: {e}"[:300])
            print("section failed:", report["errors"][-1], flush=True)
        report["seconds"] = time.perf_counter() - t0
        text = write_report(report, out)
    print(text)


def write_report(report: dict, out: pathlib.Path) -> str:
    """Writes gpu_check.json and gpu_check.txt (what has been measured so far)."""
    (out / "gpu_check.json").write_text(json.dumps(report, indent=1))
    lines = [f"gpu_check {report['date']} on {report['device']} (jax {report['jax']}, "
             f"{report['backend']}); copy bandwidth {report.get('copy_GBps', float('nan')):.0f}"
             f" GB/s; {report['seconds']:.0f} s", "",
             "correctness (max abs err vs xla reference):"]
    lines += [f"  {c['shape']}: decode {c['decode_max_err']:.2e}, prefill "
              f"{c['prefill_max_err']:.2e} {'ok' if c['ok'] else 'FAIL'}; exact kernels' bits "
              f"differ in {c['decode_bits_differ']}/{c['decode_elements']} decode, "
              f"{c['prefill_bits_differ']}/{c['prefill_elements']} prefill elements"
              for c in report["correctness"]]
    lines += ["", "exactness (engine log-probs vs the trainer's, bit for bit; "
              "kernels = JAXRL_CACHE_KERNELS):"]
    for r in report["exactness"]:
        head = (f"  engine {r['engine_backend']}, kernels {r['kernels']}, {r['dtype']}"
                + (f", flags {r['flags']}" if r.get("flags") else "") + ": ")
        if "exact" in r:
            head += (f"audit {r['bit_mismatches']} of {r['tokens']} tokens differ, max |diff| "
                     f"{r['max_abs_diff']:.2e} ({'exact' if r['exact'] else 'NOT exact'}); "
                     f"train step mismatch max {r['step_mismatch_max']:.2e}, ratio max "
                     f"{r['step_ratio_max']:.7f}")
        lines.append(head + (f" [{r['error']}]" if "error" in r else ""))
        if "probe_summary" in r:  # where the bits part (benchmarks/exactness_probe.py)
            lines.append(f"    where: {r['probe_summary']}")
    lines += ["", "decode (ours = exact; fast = exact=False, flash-decoding)",
              "decode   B      L   ours ms    GB/s  copy%  model us  model%   jax ms  ours/jax"
              "  fast ms  ours/fast"]
    for r in report["decode"]:
        lines.append(f"      {r['B']:3d} {r['L']:6d} {r['ours_ms']:9.3f} {r['GBps']:7.0f} "
                     f"{100 * r['copy_fraction']:5.1f} {r['predicted_us']:9.1f} "
                     f"{100 * r['predicted_fraction']:6.1f} {r.get('jax_ms', float('nan')):8.3f} "
                     f"{r.get('speedup_vs_jax', float('nan')):8.2f} {r['fast_ms']:8.3f} "
                     f"{r['exact_cost']:9.2f}")
    lines += ["", "prefill tokens  exact    rows   warps      ms  TFLOP/s"]
    lines += [f"        {r['tokens']:6d} {r['exact']!s:>6} {r['block_rows']!s:>7} "
              f"{r['num_warps']!s:>7} {r['ms']:7.3f} {r['TFLOPs']:8.1f}"
              for r in report["prefill"]]
    lines += ["", "tiled_matmul (batch-invariant) vs XLA's dot",
              "  rows     K      N  dtype      tiled ms   xla ms   cost  TFLOP/s"]
    lines += [f"  {r['rows']:4d} {r['k']:5d} {r['n']:6d}  {r['dtype']:9s} {r['tiled_ms']:9.3f} "
              f"{r['xla_ms']:8.3f} {r['cost']:6.2f} {r['tiled_TFLOPs']:8.1f}"
              for r in report["matmul"]]
    lines += ["", "log_sum_exp (batch-invariant normaliser) vs XLA's logsumexp",
              "  rows   vocab  kernel ms   xla ms   cost   GB/s"]
    lines += [f"  {r['rows']:4d} {r['vocab']:7d} {r['kernel_ms']:10.3f} {r['xla_ms']:8.3f} "
              f"{r['cost']:6.2f} {r['GBps']:6.0f}" for r in report.get("normaliser", [])]
    lines += ["", "errors: " + "; ".join(report["errors"])] if report.get("errors") else []
    text = "\n".join(lines) + "\n"
    (out / "gpu_check.txt").write_text(text)
    return text


if __name__ == "__main__":
    main()
