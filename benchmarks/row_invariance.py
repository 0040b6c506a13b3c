"""Does a matmul give a row the same bits whatever the number of rows? (issue 33 on GPU)

Exact numerics (docs/DESIGN.md, "Exact numerics") need every weight matmul to be
batch-invariant: a token row's result may not depend on how many rows share the call (the
sampler decodes 64 rows, the trainer packs 4,096). XLA:CPU's dots have that property at
these shapes; the first H200 check found XLA:GPU's do not. This probe answers, per XLA flag
set, which formulation keeps a row's bits on the device it runs on:

- `plain`: x [M, K] @ w [K, N];
- `tiled`: rows padded to a multiple of TILE and computed as one batched dot of
  [M / TILE, TILE, K] against w broadcast over the tiles (every row goes through a
  TILE-row problem, if XLA keeps the batch);
- `kernel`: `kernels_pallas.matmul.tiled_matmul`, the fixed-tile Pallas program that
  JAXRL_CACHE_KERNELS=pallas routes the model's projections through (GPU only: on CPU its
  interpret mode is the XLA:CPU dot again).

For M in ROWS, the rows of each result are compared with the same rows computed among
the largest M (fp32 and bf16 inputs, fp32 accumulation; SmolLM2's [576 -> 1536] and
[1536 -> 576] projections). One line per (flags, formulation, dtype, shape): how many M
give other bits.

    python -m benchmarks.row_invariance                 # every flag set, each in a child
    python -m benchmarks.row_invariance --child         # the current XLA_FLAGS only
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import numpy as np

FLAG_SETS = {  # name: XLA_FLAGS (GPU flags are ignored with a warning on CPU)
    "default": "",
    "no-triton-gemm": "--xla_gpu_enable_triton_gemm=false",
    "deterministic": "--xla_gpu_deterministic_ops=true",
    "autotune-0": "--xla_gpu_autotune_level=0",
}
ROWS = (1, 2, 4, 8, 16, 64, 256, 1024)
TILE = 64
SHAPES = ((576, 1536), (1536, 576))


def probe() -> list[dict]:
    import jax
    import jax.numpy as jnp

    def plain(x, w):
        return jnp.dot(x, w, preferred_element_type=jnp.float32)

    def tiled(x, w):
        m, k = x.shape
        pad = -m % TILE
        xt = jnp.pad(x, ((0, pad), (0, 0))).reshape(-1, TILE, k)
        wt = jnp.broadcast_to(w, (xt.shape[0],) + w.shape)
        out = jax.lax.dot_general(xt, wt, (((2,), (1,)), ((0,), (0,))),
                                  preferred_element_type=jnp.float32)
        return out.reshape(-1, w.shape[1])[:m]

    forms = [("plain", plain), ("tiled", tiled)]
    if jax.default_backend() == "gpu":
        from kernels_pallas.matmul import tiled_matmul
        forms.append(("kernel", tiled_matmul))
    rng = np.random.default_rng(0)
    rows = []
    for k, n in SHAPES:
        for dtype in ("float32", "bfloat16"):
            x_all = jnp.asarray(rng.standard_normal((max(ROWS), k)), dtype)
            w = jnp.asarray(rng.standard_normal((k, n)) / np.sqrt(k), dtype)
            for name, fn in forms:
                f = jax.jit(fn)
                want = np.asarray(f(x_all, w))
                differ = [m for m in ROWS[:-1]
                          if not np.array_equal(np.asarray(f(x_all[:m], w)), want[:m])]
                rows.append(dict(formulation=name, dtype=dtype, shape=f"{k}x{n}",
                                 rows_tried=list(ROWS[:-1]), rows_with_other_bits=differ,
                                 invariant=not differ))
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--child", action="store_true", help="probe under the current XLA_FLAGS")
    p.add_argument("--json", default=None, help="write the rows here")
    args = p.parse_args()
    if args.child:
        import jax
        print("RESULT " + json.dumps(dict(device=jax.devices()[0].device_kind,
                                          rows=probe())), flush=True)
        return
    out = []
    for flags_name, flags in FLAG_SETS.items():
        env = {**os.environ, "XLA_FLAGS": (os.environ.get("XLA_FLAGS", "") + " " + flags)}
        proc = subprocess.run([sys.executable, "-m", "benchmarks.row_invariance", "--child"],
                              env=env, capture_output=True, text=True, timeout=300)
        found = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
        if proc.returncode or not found:
            tail = (proc.stderr.strip().splitlines() or ["?"])[-1][:200]
            print(f"{flags_name}: failed (rc {proc.returncode}): {tail}", flush=True)
            out.append(dict(flags=flags_name, error=tail))
            continue
        result = json.loads(found[-1][len("RESULT "):])
        for r in result["rows"]:
            r.update(flags=flags_name, device=result["device"])
            print(f"{flags_name:15s} {r['formulation']:6s} {r['dtype']:9s} {r['shape']:9s} "
                  f"{'invariant' if r['invariant'] else 'other bits at M=' + str(r['rows_with_other_bits'])}",
                  flush=True)
            out.append(r)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
