"""Roofline model of paged decode: a split plan -> bytes moved -> expected HBM-bandwidth fraction.

  python -m benchmarks.roofline --out benchmarks/results      # writes roofline-decode.{md,json}

Predicts, before a GPU measures it, what a change of the decode plan buys. Per attention call
(one layer, one decode step) of B rows of equal length L:

  useful bytes   K and V of the valid tokens, read once: B * Hkv * L * D * 2 * itemsize
  partial bytes  fp32 split partials, written by the kernel and read by the merge
  other bytes    q in, output out (and the partial-free path's direct output)
  time           launches * launch_s + bytes / (peak_bw * mlp) , at least the busiest SM's
                 bytes / sm_bw
  mlp            memory-level parallelism: min(1, resident programs * bytes each has in
                 flight / (peak_bw * latency)) (Little's law); a program keeps one K+V block
                 in flight (page ids are loaded synchronously, so deeper pipelining is not
                 counted)
  fraction       useful bytes / time / peak_bw: the share of HBM bandwidth doing useful reads

"before" is the plan of commit 4f77f9c (splits from the table width only, 16-row partials,
separate pad/merge/slice ops); "after" is `kernels_pallas.plan_decode`. The device constants
are H200 datasheet values and round latencies, not measurements; gpu_check.sh measures.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import pathlib

from kernels_pallas import plan_decode
from kernels_pallas import next_power_of_2


@dataclasses.dataclass(frozen=True)
class Device:
    name: str = "H200"
    num_sms: int = 132
    peak_bw: float = 4.8e12  # bytes/s HBM3e
    latency_s: float = 1.0e-6  # loaded HBM latency of a gathered page load
    sm_bw: float = 3 * 4.8e12 / 132  # bytes/s one SM can pull on its own
    launch_s: float = 2.0e-6  # per dependent kernel launch inside one XLA program


@dataclasses.dataclass(frozen=True)
class DecodeWork:
    """Traffic of one decode call, the input of the roofline."""
    programs: int
    active_programs: int  # programs with at least one valid page
    resident_per_sm: int  # programs one SM holds at once (registers / smem; ptxas table)
    in_flight_bytes: int  # bytes one program has outstanding
    useful_bytes: int
    partial_bytes: int  # write + read
    other_bytes: int
    launches: int


def predict(work: DecodeWork, dev: Device = Device()) -> dict:
    """Expected time and HBM-bandwidth fraction of `work` on `dev`."""
    total = work.useful_bytes + work.partial_bytes + work.other_bytes
    concurrent = min(work.active_programs, dev.num_sms * work.resident_per_sm)
    mlp = min(1.0, concurrent * work.in_flight_bytes / (dev.peak_bw * dev.latency_s))
    per_program = total / max(1, work.active_programs)
    busiest_sm = math.ceil(work.active_programs / dev.num_sms) * per_program
    memory_s = max(total / (dev.peak_bw * mlp), busiest_sm / dev.sm_bw)
    time_s = work.launches * dev.launch_s + memory_s
    return dict(time_us=time_s * 1e6, mlp=mlp,
                traffic_overhead=(work.partial_bytes + work.other_bytes) / work.useful_bytes,
                hbm_fraction=work.useful_bytes / time_s / dev.peak_bw)


def _common(batch, hq, hkv, d, length, itemsize):
    useful = batch * hkv * length * d * 2 * itemsize
    q_and_out = 2 * batch * hq * d * itemsize
    return useful, q_and_out


def work_before(batch, hq, hkv, d, length, *, page_size=16, width=256, itemsize=2,
                resident_per_sm=3) -> DecodeWork:
    """The pre-#12 plan: num_splits = min(16, pow2(blocks(W) // 4)); partials of 16 rows."""
    ppb = max(1, 64 // page_size)
    blocks = -(-width // ppb)
    splits = min(16, next_power_of_2(max(1, blocks // 4)))
    splits = min(splits, next_power_of_2(blocks))
    pages_per_split = next_power_of_2(-(-blocks // splits)) * ppb
    valid_pages = -(-length // page_size)
    active = min(splits, -(-valid_pages // pages_per_split))
    rows = max(16, next_power_of_2(hq // hkv))
    programs = batch * hkv * splits
    partial = programs * (rows * d * 4 + 2 * rows * 4) * 2
    useful, q_and_out = _common(batch, hq, hkv, d, length, itemsize)
    return DecodeWork(programs=programs, active_programs=batch * hkv * active,
                      resident_per_sm=resident_per_sm,
                      in_flight_bytes=2 * ppb * page_size * d * itemsize,
                      useful_bytes=useful, partial_bytes=partial,
                      other_bytes=q_and_out + programs * rows * d * itemsize,  # padded q
                      launches=4)  # table pad, q pad, kernel, merge (+ slice, fused)


def work_after(batch, hq, hkv, d, length, *, page_size=16, width=256, itemsize=2,
               resident_per_sm=4, dev: Device = Device()) -> DecodeWork:
    """The planned kernel: splits from batch, SMs and max_kv_len = length (bucketed)."""
    plan = plan_decode(batch, hq, hkv, d, page_size, width, max_kv_len=length,
                       num_sms=dev.num_sms)
    splits = plan.num_splits
    row_blocks = -(-(-(-length // page_size)) // plan.pages_per_block)
    row_splits = max(1, min(splits, -(-row_blocks // plan.min_blocks_per_split)))
    programs = plan.programs
    active = batch * hkv * row_splits
    partial = 0
    if splits > 1:  # live splits write o and lse, idle ones lse only; the merge reads all
        per_split = plan.group_rows * d * 4 + plan.group_rows * 4
        written = active * per_split + (programs - active) * plan.group_rows * 4
        partial = written + programs * per_split
    useful, q_and_out = _common(batch, hq, hkv, d, length, itemsize)
    padded_q = programs * plan.dot_rows * d * itemsize  # each program loads its q tile
    launches = 2 + (splits > 1) + (plan.group_rows != plan.group and splits == 1)
    return DecodeWork(programs=programs, active_programs=active,
                      resident_per_sm=resident_per_sm,
                      in_flight_bytes=2 * plan.block_k * d * itemsize,
                      useful_bytes=useful, partial_bytes=partial,
                      other_bytes=q_and_out + padded_q, launches=launches)


def table(models, batches=(1, 8, 32, 64), lengths=(512, 4096, 16384), page_size=16,
          dev: Device = Device()) -> list[dict]:
    rows = []
    for name, hq, hkv, d, before_res, after_res in models:
        for batch in batches:
            for length in lengths:
                width = max(256, -(-length // page_size))  # serving table: >= 256 pages
                kw = dict(page_size=page_size, width=width)
                b = work_before(batch, hq, hkv, d, length, resident_per_sm=before_res, **kw)
                a = work_after(batch, hq, hkv, d, length, resident_per_sm=after_res, dev=dev,
                               **kw)
                pb, pa = predict(b, dev), predict(a, dev)
                rows.append(dict(model=name, batch=batch, length=length, width=width,
                                 before=dict(programs=b.programs, active=b.active_programs,
                                             launches=b.launches, **pb),
                                 after=dict(programs=a.programs, active=a.active_programs,
                                            launches=a.launches, **pa)))
    return rows


def markdown(rows, dev: Device) -> str:
    out = [f"Decode roofline ({dev.name}: {dev.num_sms} SMs, {dev.peak_bw / 1e12:.1f} TB/s "
           f"peak, latency {dev.latency_s * 1e6:.1f} us, launch {dev.launch_s * 1e6:.1f} us); "
           "page 16, bf16, every row at length L; fraction = useful K/V bytes / time / peak.",
           "",
           "| model | B | L | programs (active) before -> after | partial+q traffic before "
           "-> after | launches | predicted us before -> after | HBM fraction before -> after |",
           "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        b, a = r["before"], r["after"]
        out.append(
            f"| {r['model']} | {r['batch']} | {r['length']} | {b['programs']} ({b['active']}) "
            f"-> {a['programs']} ({a['active']}) | {b['traffic_overhead']:.1%} -> "
            f"{a['traffic_overhead']:.1%} | {b['launches']} -> {a['launches']} | "
            f"{b['time_us']:.1f} -> {a['time_us']:.1f} | {b['hbm_fraction']:.0%} -> "
            f"{a['hbm_fraction']:.0%} |")
    return "\n".join(out) + "\n"


# name, Hq, Hkv, D, resident decode programs per SM before / after (ptxas, sm_90; see
# kernel_resources-*.md in benchmarks/results)
MODELS = [("llama3-8b", 32, 8, 128, 3, 4), ("qwen2.5-7b", 28, 4, 128, 3, 4)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results")
    a = ap.parse_args()
    dev = Device()
    rows = table(MODELS, dev=dev)
    out = pathlib.Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "roofline-decode.json").write_text(json.dumps(
        dict(device=dataclasses.asdict(dev), rows=rows), indent=1))
    text = markdown(rows, dev)
    (out / "roofline-decode.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
