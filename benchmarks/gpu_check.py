"""Prepared GPU check: compiled Pallas kernels vs the reference, then timings.

  python -m benchmarks.gpu_check --out benchmarks/results      # on a GPU (about 3-5 min)
  python -m benchmarks.gpu_check --smoke --out /tmp/smoke      # CPU dry run, tiny shapes

(1) correctness of the compiled `pallas` kernels against the `xla` reference;
(2) decode at B=32, Hq=32, Hkv=8, D=128, bf16, page 16 and 64, L in {1k, 4k, 16k}: GB/s of
    K/V moved, the fraction of the device's measured copy bandwidth, and the speed ratio
    against jax.experimental.pallas.ops.gpu.paged_attention at the same shape;
(3) causal prefill of 4k tokens: TFLOP/s.
Writes gpu_check.json and gpu_check.txt into --out.
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


def make_pool(key, pages, hkv, page_size, d, dtype):
    k1, k2 = jax.random.split(key)
    shape = (pages, hkv, page_size, d)
    return (jax.random.normal(k1, shape, dtype), jax.random.normal(k2, shape, dtype))


def check_correctness(backend, smoke, report):
    rng = np.random.default_rng(0)
    cases = [(8, 32, 8, 128, 16, jnp.bfloat16), (4, 8, 2, 64, 64, jnp.float32)]
    if smoke:
        cases = [(2, 4, 2, 64, 16, jnp.float32)]
    for b, hq, hkv, d, ps, dtype in cases:
        width = 8
        k, v = make_pool(jax.random.key(1), b * width + 1, hkv, ps, d, dtype)
        table = jnp.asarray(1 + rng.permutation(b * width).reshape(b, width), jnp.int32)
        lens = jnp.asarray(rng.integers(0, width * ps, b), jnp.int32)
        q = jax.random.normal(jax.random.key(2), (b, hq, d), dtype)
        got = paged_decode_attention(q, k, v, table, lens, backend=backend)
        want = paged_decode_attention(q, k, v, table, lens, backend="xla")
        err = float(jnp.max(jnp.abs(got.astype(jnp.float32) - want.astype(jnp.float32))))
        q_lens = rng.integers(1, width * ps // 2, b)
        kv_lens = q_lens + rng.integers(0, width * ps // 2, b)
        cu = jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32)
        qp = jax.random.normal(jax.random.key(3), (int(q_lens.sum()) + 3, hq, d), dtype)
        got_p = paged_prefill_attention(qp, k, v, table, cu, jnp.asarray(kv_lens, jnp.int32),
                                        backend=backend)
        want_p = paged_prefill_attention(qp, k, v, table, cu, jnp.asarray(kv_lens, jnp.int32),
                                         backend="xla")
        err_p = float(jnp.max(jnp.abs(got_p.astype(jnp.float32) - want_p.astype(jnp.float32))))
        tol = 3e-2 if dtype == jnp.bfloat16 else 2e-3  # tf32 dots on GPU for fp32
        report["correctness"].append(dict(
            shape=f"B={b} Hq={hq} Hkv={hkv} D={d} page={ps} {jnp.dtype(dtype).name}",
            decode_max_err=err, prefill_max_err=err_p, ok=bool(err < tol and err_p < tol)))


def bench_decode(backend, smoke, report, copy_bw):
    from jax.experimental.pallas.ops.gpu import paged_attention as jax_paged
    b, hq, hkv, d = (2, 4, 2, 64) if smoke else (32, 32, 8, 128)
    lengths = (256,) if smoke else (1024, 4096, 16384)
    for ps in (16, 64):
        for length in lengths:
            pages_per_seq = length // ps
            k, v = make_pool(jax.random.key(0), b * pages_per_seq + 1, hkv, ps, d, jnp.bfloat16)
            table = jnp.asarray(1 + np.random.default_rng(0).permutation(
                b * pages_per_seq).reshape(b, pages_per_seq), jnp.int32)
            lens = jnp.full((b,), length, jnp.int32)
            q = jax.random.normal(jax.random.key(1), (b, hq, d), jnp.bfloat16)
            ours = jax.jit(functools.partial(paged_decode_attention, backend=backend))
            t_ours = timed(ours, q, k, v, table, lens)
            moved = 2 * b * length * hkv * d * 2  # K and V, bf16
            row = dict(page=ps, L=length, ours_ms=t_ours * 1e3, GBps=moved / t_ours / 1e9,
                       copy_fraction=moved / t_ours / copy_bw)
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
    hq, hkv, d, ps = (4, 2, 64, 16) if smoke else (32, 8, 128, 16)
    tokens = 128 if smoke else 4096
    pages = tokens // ps
    k, v = make_pool(jax.random.key(0), pages + 1, hkv, ps, d, jnp.bfloat16)
    table = jnp.asarray(1 + np.arange(pages)[None], jnp.int32)
    cu = jnp.asarray([0, tokens], jnp.int32)
    kv_lens = jnp.asarray([tokens], jnp.int32)
    q = jax.random.normal(jax.random.key(1), (tokens, hq, d), jnp.bfloat16)
    group_rows = hq // hkv
    for block_q, warps in (((16, 4),) if smoke else ((16, 4), (32, 4), (32, 8), (64, 8))):
        fn = jax.jit(functools.partial(paged_prefill_attention, backend=backend,
                                       block_q=block_q, num_warps=warps))
        t = timed(fn, q, k, v, table, cu, kv_lens, iters=10)
        flops = 4 * hq * d * tokens * (tokens + 1) / 2
        row = dict(tokens=tokens, block_q=block_q, rows=block_q * group_rows, num_warps=warps,
                   ms=t * 1e3, TFLOPs=flops / t / 1e12)
        report["prefill"].append(row)
        print("prefill", row, flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, interpret mode")
    args = parser.parse_args()
    backend = "interpret" if args.smoke else "pallas"
    device = jax.devices()[0]
    report = dict(date=datetime.date.today().isoformat(), device=device.device_kind,
                  platform=device.platform, jax=jax.__version__, backend=backend,
                  correctness=[], decode=[], prefill=[])
    t0 = time.perf_counter()
    check_correctness(backend, args.smoke, report)
    print("correctness", report["correctness"], flush=True)
    report["copy_GBps"] = copy_bandwidth(args.smoke) / 1e9
    bench_decode(backend, args.smoke, report, report["copy_GBps"] * 1e9)
    bench_prefill(backend, args.smoke, report)
    report["seconds"] = time.perf_counter() - t0
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_check.json").write_text(json.dumps(report, indent=1))
    lines = [f"gpu_check {report['date']} on {report['device']} (jax {report['jax']}, "
             f"{backend}); copy bandwidth {report['copy_GBps']:.0f} GB/s", "",
             "correctness (max abs err vs xla reference):"]
    lines += [f"  {c['shape']}: decode {c['decode_max_err']:.2e}, prefill "
              f"{c['prefill_max_err']:.2e} {'ok' if c['ok'] else 'FAIL'}"
              for c in report["correctness"]]
    lines += ["", "decode  page      L   ours ms    GB/s  copy%   jax ms  ours/jax"]
    for r in report["decode"]:
        lines.append(f"        {r['page']:4d} {r['L']:6d} {r['ours_ms']:9.3f} {r['GBps']:7.0f} "
                     f"{100 * r['copy_fraction']:5.1f} {r.get('jax_ms', float('nan')):8.3f} "
                     f"{r.get('speedup_vs_jax', float('nan')):8.2f}")
    lines += ["", "prefill tokens block_q rows warps      ms  TFLOP/s"]
    lines += [f"        {r['tokens']:6d} {r['block_q']:7d} {r['rows']:4d} {r['num_warps']:5d} "
              f"{r['ms']:7.3f} {r['TFLOPs']:8.1f}" for r in report["prefill"]]
    (out / "gpu_check.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
