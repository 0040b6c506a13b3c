"""Cost of exact numerics (issue 33), side by side in one run: two source trees, alternated.

The base tree is today's numerics before the change (c207577), the exact tree the change
(12b8e5d: batch-invariant dense with rows padded to 64, blocked attention, tree
reductions, audit tolerance 0). Each tree runs in its own process with
`PYTHONPATH=<tree>` and the working directory in the tree (checked: `jaxrl_cache.__file__`
resolves into it), under the same interpreter (this one unless --python).

1. End to end, the path users run: the CLI on SmolLM2-135M-Instruct with its chat template,
       python -m jaxrl_cache.app.cli grpo --model DIR --dataset examples/tasks/add.jsonl
           --steps S --prompts-per-step 2 --group-size 8 --max-new-tokens 24 --lr 2e-5 ...
   (--shape 2x8x24: 2 prompts x 8 samples x 24 new tokens, two rollout calls per step: the
   default; 8x8x128 is the README's larger shape), under
   /usr/bin/time -v (peak RSS). From its metrics.jsonl: median step_seconds,
   rollout_seconds, audit_seconds and train_seconds over steps 2..S (step 1 compiles), and
   the whole command's wall time (compiles, evaluation and export included).
2. The rollout alone: the jaxrl side of benchmarks/rollout_vs_transformers.py (its
   prompts, 8 chat prompts x n=8 x 64 new tokens, workloads "chat" and "system", prefix
   reuse on, a new version per call; "chat-no-reuse" / "system-no-reuse": the same with
   CacheConfig(prefix_cache=False), every sample prefilling its own prompt): one warm-up
   call per workload, then --reps timed calls.

3. With --parts profile: per-op timings in each tree (`run_profile`): decode step, prefill,
   the trainer's forward + backward, and in the exact tree the same with its row padding or
   its blocked attention swapped out, to say which op costs what.

Rounds alternate the trees, ABBA order (base, exact, exact, base, ...), so a load change on a
shared machine hits both alike; the load average is recorded before every run.

    python benchmarks/exact_cost.py --base-tree /tmp/jaxrl_base --exact-tree /tmp/jaxrl_exact \
        --model ~/.cache/jaxrl_cache/SmolLM2-135M-Instruct --rounds 3 --steps 6 \
        --json benchmarks/results/exact-cost-cpu-2026-12-03.json
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time

WORKLOADS = ("chat", "system", "chat-no-reuse", "system-no-reuse")  # ROLLOUT_CHILD parses

ROLLOUT_CHILD = r"""
import json, sys, time, jax, jaxrl_cache
from benchmarks.rollout_vs_transformers import GROUP, NEW, PROMPTS, chat_prompts
from jaxrl_cache.models import from_pretrained, load_tokenizer
from jaxrl_cache.rollout import CacheConfig, RolloutEngine, SchedulerConfig
from jaxrl_cache.rollout.sampling import SamplingParams
model, workloads, reps = sys.argv[1], sys.argv[2].split(","), int(sys.argv[3])
config, params = from_pretrained(model, dtype="float32")
tok = load_tokenizer(model)
sampling = SamplingParams(n=GROUP, max_new_tokens=NEW, temperature=1.0)
out = {"jaxrl_cache_file": jaxrl_cache.__file__}
version = 0
for w in workloads:
    prompts = chat_prompts(tok, system=w.startswith("system"))
    longest = max(map(len, prompts)) + NEW
    engine = RolloutEngine(config, CacheConfig(num_pages=PROMPTS * GROUP * (-(-longest // 16))
                                               + 64, page_size=16,
                                               prefix_cache=not w.endswith("-no-reuse")),
                           scheduler_config=SchedulerConfig(max_num_seqs=PROMPTS * GROUP),
                           backend="xla")
    times = []
    for r in range(reps + 1):
        version += 1
        t0 = time.perf_counter()
        batch = engine.rollout(params, version, prompts, sampling, rng=jax.random.key(version))
        dt = time.perf_counter() - t0
        assert all(len(s.output_ids) == NEW for s in batch.samples)
        times.append(dt)
    out[w] = {"compile_call_s": round(times[0], 3), "seconds": [round(t, 3) for t in times[1:]],
              "tokens": PROMPTS * GROUP * NEW, "prompt_tokens": batch.prompt_tokens,
              "reused_tokens": batch.reused_tokens, "decode_chunks": batch.decode_chunks}
print("RESULT " + json.dumps(out))
"""

PROFILE_CHILD = r"""
import json, statistics, sys, time
import jax, jax.numpy as jnp, numpy as np
from jaxrl_cache.models import from_pretrained
from jaxrl_cache.models import llama
from kernels_pallas import paged_decode_attention
model, reps = sys.argv[1], int(sys.argv[2])
config, params = from_pretrained(model, dtype="float32")
PS, CTX = 16, 96  # decode context: 96 tokens in cache (a chat prompt + some output)
AS_IS = {k: getattr(llama, k) for k in ("MIN_MATMUL_ROWS", "blocked_attention")
         if hasattr(llama, k)}


def plain_attention(q, k, v, visible, scale):  # the base tree's softmax einsum, same shapes
    s = jnp.einsum("...md,...ld->...ml", q, k, preferred_element_type=jnp.float32) * scale
    p = jax.nn.softmax(jnp.where(visible, s, -jnp.inf), axis=-1)
    return jnp.einsum("...ml,...ld->...md", p.astype(v.dtype), v,
                      preferred_element_type=jnp.float32)


def decode(rows):
    width = -(-(CTX + 32) // PS)
    kv = llama.init_kv_cache(config, rows * width + 1, PS)
    table = jnp.asarray((1 + np.arange(rows * width, dtype=np.int32)).reshape(rows, width))
    toks, pos = jnp.full((rows,), 5, jnp.int32), jnp.full((rows,), CTX, jnp.int32)
    f = jax.jit(lambda p, kv: llama.decode_forward(p, config, kv, toks, pos, table,
                                                   backend="xla")[0])
    return lambda: f(params, kv)


def decode_attention(rows):  # one layer's paged decode attention alone
    width = -(-(CTX + 32) // PS)
    kp = jnp.ones((rows * width + 1, config.n_kv_heads, PS, config.head_dim), jnp.float32)
    q = jnp.ones((rows, config.n_heads, config.head_dim), jnp.float32)
    table = jnp.asarray((1 + np.arange(rows * width, dtype=np.int32)).reshape(rows, width))
    lens = jnp.full((rows,), CTX + 1, jnp.int32)
    return lambda: paged_decode_attention(q, kp, kp, table, lens, backend="xla")


def prefill(n_seq, length):
    width = -(-length // PS)
    kv = llama.init_kv_cache(config, n_seq * width + 1, PS)
    table = jnp.asarray((1 + np.arange(n_seq * width, dtype=np.int32)).reshape(n_seq, width))
    tokens = jnp.full((n_seq * length,), 5, jnp.int32)
    seq = jnp.repeat(jnp.arange(n_seq, dtype=jnp.int32), length)
    pos = jnp.tile(jnp.arange(length, dtype=jnp.int32), n_seq)
    cu = jnp.arange(n_seq + 1, dtype=jnp.int32) * length
    lens = jnp.full((n_seq,), length, jnp.int32)
    f = jax.jit(lambda p, kv: llama.prefill_forward(p, config, kv, tokens, seq, pos, table,
                                                    cu, lens, cu[1:] - 1, backend="xla")[0])
    return lambda: f(params, kv)


def train(batch, length):
    tokens = jnp.full((batch, length), 5, jnp.int32)

    def loss(p):
        logits = llama.lm_logits(p, config, llama.hidden_states(p, config, tokens))
        return jnp.sum(jax.nn.log_softmax(logits, -1)[..., 7])
    f = jax.jit(jax.value_and_grad(loss))
    return lambda: f(params)


def forward(batch, length):
    tokens = jnp.full((batch, length), 5, jnp.int32)
    f = jax.jit(lambda p: llama.lm_logits(p, config, llama.hidden_states(p, config, tokens)))
    return lambda: f(params)


OPS = {"decode_step_8rows": lambda: decode(8), "decode_step_16rows": lambda: decode(16),
       "decode_step_64rows": lambda: decode(64), "prefill_2x64": lambda: prefill(2, 64),
       "decode_attention_16rows_1layer": lambda: decode_attention(16),
       "train_fwd_bwd_2x256": lambda: train(2, 256), "forward_16x64": lambda: forward(16, 64)}
VARIANTS = {"as_is": {}, "no_row_pad": {"MIN_MATMUL_ROWS": 1},  # exact tree: dense unpadded
            "plain_attention": {"blocked_attention": plain_attention}}  # trainer: one softmax
WHICH = {"no_row_pad": ("decode_step_8rows", "decode_step_16rows", "decode_step_64rows",
                        "prefill_2x64"),
         "plain_attention": ("train_fwd_bwd_2x256", "forward_16x64")}
fns = {}
for variant, patch in VARIANTS.items():
    if any(k not in AS_IS for k in patch):
        continue  # the base tree has neither knob
    for k, v in {**AS_IS, **patch}.items():
        setattr(llama, k, v)
    for op, make in OPS.items():
        if variant == "as_is" or op in WHICH[variant]:
            fn = make()
            jax.block_until_ready(fn())  # traces with this variant's globals and compiles
            fns[(variant, op)] = fn
times = {key: [] for key in fns}
for _ in range(reps):  # interleaved: every program once per round
    for key, fn in fns.items():
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times[key].append(time.perf_counter() - t0)
out = {}
for (variant, op), ts in times.items():
    out.setdefault(variant, {})[op + "_ms"] = round(statistics.median(ts) * 1e3, 2)
print("RESULT " + json.dumps(out))
"""


def load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def check_tree(python: str, tree: pathlib.Path) -> str:
    """jaxrl_cache.__file__ as imported with PYTHONPATH=tree from inside the tree."""
    got = subprocess.run([python, "-c", "import jaxrl_cache; print(jaxrl_cache.__file__)"],
                         cwd=tree, env={**os.environ, "PYTHONPATH": str(tree)},
                         capture_output=True, text=True, check=True).stdout.strip()
    if not pathlib.Path(got).resolve().is_relative_to(tree.resolve()):
        raise SystemExit(f"{tree}: jaxrl_cache imports from {got}, not from the tree")
    return got


def commit(tree: pathlib.Path) -> str:
    return subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"],
                          capture_output=True, text=True, check=True).stdout.strip()


def peak_rss_mib(time_v: str) -> float | None:
    m = re.search(r"Maximum resident set size \(kbytes\): (\d+)", time_v)
    return round(int(m.group(1)) / 1024, 1) if m else None


def run_demo(python: str, tree: pathlib.Path, model: pathlib.Path, steps: int, out: pathlib.Path,
             shape: tuple[int, int, int], extra: list[str]) -> dict:
    """One CLI demo run; shape = (prompts per step, group size, max new tokens)."""
    task = tree / "examples/tasks/add.jsonl"
    prompts, group, new = map(str, shape)
    cmd = ["/usr/bin/time", "-v", python, "-m", "jaxrl_cache.app.cli", "grpo",
           "--model", str(model), "--dataset", str(task), "--steps", str(steps),
           "--prompts-per-step", prompts, "--group-size", group, "--max-new-tokens", new,
           "--lr", "2e-5", "--eval-prompts", "2", "--checkpoint-every", str(steps + 1),
           "--seed", "0", "--out", str(out), "--overwrite", *extra]
    before = load()
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=tree, env={**os.environ, "PYTHONPATH": str(tree)},
                          capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode:
        raise SystemExit(f"demo in {tree} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    timed = rows[1:]  # step 1 compiles the rollout and train programs

    def med(key):
        vals = [r[key] for r in timed if key in r]
        return round(statistics.median(vals), 3) if vals else None
    return dict(
        command=" ".join(cmd[2:]), wall_seconds=round(wall, 1), load_before=before,
        load_after=load(), peak_rss_mib=peak_rss_mib(proc.stderr),
        steps=len(rows), first_step_seconds=round(rows[0]["step_seconds"], 2),
        step_seconds=med("step_seconds"), rollout_seconds=med("rollout_seconds"),
        audit_seconds=med("audit_seconds"), train_seconds=med("train_seconds"),
        step_seconds_each=[round(r["step_seconds"], 2) for r in rows],
        rollout_seconds_each=[round(r["rollout_seconds"], 2) for r in rows],
        train_seconds_each=[round(r["train_seconds"], 2) for r in rows],
        mismatch_max=[r.get("logprob_mismatch_max") for r in rows],
        reward=[round(r["reward"], 3) for r in rows if "reward" in r])


def run_rollout(python: str, tree: pathlib.Path, model: pathlib.Path, workloads: str,
                reps: int) -> dict:
    before = load()
    proc = subprocess.run(["/usr/bin/time", "-v", python, "-c", ROLLOUT_CHILD, str(model),
                           workloads, str(reps)], cwd=tree,
                          env={**os.environ, "PYTHONPATH": str(tree)},
                          capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"rollout in {tree} failed:\n{proc.stderr[-4000:]}")
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    res = json.loads(line[len("RESULT "):])
    for w in workloads.split(","):
        res[w]["best_s"] = min(res[w]["seconds"])
        res[w]["median_s"] = round(statistics.median(res[w]["seconds"]), 3)
        res[w]["tokens_per_s_best"] = round(res[w]["tokens"] / res[w]["best_s"], 1)
    return dict(res, load_before=before, load_after=load(), peak_rss_mib=peak_rss_mib(proc.stderr))


def run_profile(python: str, tree: pathlib.Path, model: pathlib.Path, reps: int) -> dict:
    """Per-op timings in one tree (ms, median of reps, all programs compiled first, then
    timed round-robin so load changes hit every one alike): a decode step at 8, 16 and 64
    rows (96 tokens of context), one layer's paged decode attention (16 rows), a 2 x 64-token
    paged prefill, the trainer's forward + backward of a [2, 256] batch, a [16, 64] forward;
    in the exact tree also with its row padding off (`no_row_pad`: MIN_MATMUL_ROWS = 1) and
    with the trainer's attention as one softmax (`plain_attention`): the benchmark process
    patches module globals, the library is untouched."""
    before = load()
    proc = subprocess.run([python, "-c", PROFILE_CHILD, str(model), str(reps)], cwd=tree,
                          env={**os.environ, "PYTHONPATH": str(tree)}, capture_output=True,
                          text=True)
    if proc.returncode:
        raise SystemExit(f"profile in {tree} failed:\n{proc.stderr[-4000:]}")
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    return dict(json.loads(line[len("RESULT "):]), load_before=before, load_after=load())


def summarise(runs: list[dict], keys) -> dict:
    """{tree: {key: median over the rounds}}."""
    out = {}
    for name in sorted({r["tree"] for r in runs}):
        mine = [r for r in runs if r["tree"] == name]
        out[name] = {k: round(statistics.median(r[k] for r in mine), 3) for k in keys
                     if all(r.get(k) is not None for r in mine)}
    return out


def markdown(res: dict) -> str:
    """The tables of a result (e2e per run and medians, rollout, profile)."""
    lines = ["| round | tree | s/step | rollout s | audit s | train s | step 1 s | wall s | "
             "peak RSS MiB | load before |", "|---|---|---|---|---|---|---|---|---|---|"
             ] if res["e2e"] else []
    for x in res["e2e"]:
        lines.append(f"| {x['round']} | {x['tree']} | {x['step_seconds']:.2f} | "
                     f"{x['rollout_seconds']:.2f} | {x['audit_seconds']:.3f} | "
                     f"{x['train_seconds']:.2f} | {x['first_step_seconds']:.1f} | "
                     f"{x['wall_seconds']:.0f} | {x['peak_rss_mib']:.0f} | "
                     f"{x['load_before'][0]:.2f} |")
    for name, m in res["e2e_median"].items():
        lines.append(f"| **median** | **{name}** | **{m['step_seconds']:.2f}** | "
                     f"{m['rollout_seconds']:.2f} | {m['audit_seconds']:.3f} | "
                     f"{m['train_seconds']:.2f} | {m['first_step_seconds']:.1f} | "
                     f"{m['wall_seconds']:.0f} | {m['peak_rss_mib']:.0f} | |")
    if res.get("rollout"):
        workloads = [k[:-len("_best_s")] for k in res["rollout"][0] if k.endswith("_best_s")]
        lines += ["", "| round | tree | " + " | ".join(f"{w} s (tokens/s)" for w in workloads)
                  + " | peak RSS MiB | load before |",
                  "|---|---|" + "---|" * len(workloads) + "---|---|"]
        for x in res["rollout"]:
            lines.append(f"| {x['round']} | {x['tree']} | " + " | ".join(
                f"{x[w]['best_s']:.2f} ({x[w]['tokens_per_s_best']:.0f})" for w in workloads)
                + f" | {x['peak_rss_mib']:.0f} | {x['load_before'][0]:.2f} |")
    if res.get("profile"):
        keys = sorted({k for x in res["profile"] for v in x.values() if isinstance(v, dict)
                       for k in v})
        lines += ["", "| op (ms, median) | " + " | ".join(
            f"{x['tree']} {v}" for x in res["profile"] for v in x if isinstance(x[v], dict))
            + " |", "|---|" + "---|" * sum(isinstance(v, dict) for x in res["profile"]
                                          for v in x.values())]
        for k in keys:
            lines.append(f"| {k} | " + " | ".join(
                str(x[v].get(k, "")) for x in res["profile"] for v in x
                if isinstance(x[v], dict)) + " |")
    return "\n".join(lines).lstrip("\n") + "\n"


def shape_arg(text: str) -> tuple[int, int, int]:
    """--shape's argparse type: the peers' parser (benchmarks/peers/common.py), its
    ValueError turned into argparse's usage error."""
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent / "peers"))
    import common
    try:
        return common.parse_shape(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base-tree", type=pathlib.Path)
    p.add_argument("--exact-tree", type=pathlib.Path)
    p.add_argument("--model", type=pathlib.Path, default=pathlib.Path(os.environ.get(
        "JAXRL_SMOLLM2_DIR", "~/.cache/jaxrl_cache/SmolLM2-135M-Instruct")).expanduser())
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=6, help="GRPO steps per demo run")
    p.add_argument("--shape", default="2x8x24", type=shape_arg,
                   help="e2e: prompts per step x group size x max new tokens")
    p.add_argument("--reps", type=int, default=2, help="timed rollout calls per workload")
    p.add_argument("--workloads", default="chat,system",
                   help=f"comma-separated, of {', '.join(WORKLOADS)}")
    p.add_argument("--parts", default="e2e,rollout",
                   help="comma-separated: e2e, rollout, profile (per-op timings)")
    p.add_argument("--rollout-rounds", type=int, default=None,
                   help="rounds that also time the rollout alone [all]")
    p.add_argument("--profile-rounds", type=int, default=1, help="rounds that also profile")
    p.add_argument("--profile-reps", type=int, default=5, help="timed calls per profiled op")
    p.add_argument("--python", default=sys.executable)
    p.add_argument("--json", type=pathlib.Path)
    p.add_argument("--render", type=pathlib.Path,
                   help="print the markdown tables of this result JSON and exit")
    args = p.parse_args(argv)
    if args.render:
        print(markdown(json.loads(args.render.read_text())))
        return {}
    if not (args.base_tree and args.exact_tree):
        p.error("--base-tree and --exact-tree are required")
    unknown = sorted(set(args.workloads.split(",")) - set(WORKLOADS))
    if unknown:
        p.error(f"unknown workloads {unknown}: choose from {', '.join(WORKLOADS)}")
    model = args.model.expanduser()
    if not (model / "config.json").exists():
        raise SystemExit(f"{model} has no config.json: run scripts/fetch_smollm2.py first")
    trees = {"base": args.base_tree.resolve(), "exact": args.exact_tree.resolve()}
    info = {name: dict(path=str(t), commit=commit(t), jaxrl_cache_file=check_tree(args.python, t))
            for name, t in trees.items()}
    print(json.dumps(info), flush=True)
    parts = args.parts.split(",")
    e2e, rollout, profile = [], [], []
    scratch = pathlib.Path(tempfile.mkdtemp(prefix="exact_cost_"))
    for r in range(args.rounds):
        order = ["base", "exact"] if r % 2 == 0 else ["exact", "base"]
        for name in order:
            if "e2e" in parts:
                res = run_demo(args.python, trees[name], model, args.steps,
                               scratch / f"{name}-{r}", args.shape, [])
                e2e.append(dict(round=r + 1, tree=name, **res))
                print("e2e", json.dumps(e2e[-1]), flush=True)
            if "rollout" in parts and r < (args.rollout_rounds or args.rounds):
                res = run_rollout(args.python, trees[name], model, args.workloads, args.reps)
                rollout.append(dict(round=r + 1, tree=name, **res))
                print("rollout", json.dumps(rollout[-1]), flush=True)
            if "profile" in parts and r < args.profile_rounds:
                res = run_profile(args.python, trees[name], model, args.profile_reps)
                profile.append(dict(round=r + 1, tree=name, **res))
                print("profile", json.dumps(profile[-1]), flush=True)
    for x in rollout:
        for w in args.workloads.split(","):
            x[f"{w}_best_s"] = x[w]["best_s"]
    out = dict(
        benchmark="exact_cost", date=str(datetime.date.today()),
        machine=f"CPU, {len(os.sched_getaffinity(0))} cores, shared with other engineers' jobs",
        python=platform.python_version(), interpreter=args.python,
        xla_flags=os.environ.get("XLA_FLAGS", ""), model=model.name, trees=info,
        rounds=args.rounds, steps=args.steps, shape="x".join(map(str, args.shape)),
        order="ABBA (base, exact, exact, base, ...)",
        e2e=e2e, rollout=rollout, profile=profile,
        e2e_median=summarise(e2e, ["step_seconds", "rollout_seconds", "audit_seconds",
                                   "train_seconds", "first_step_seconds", "wall_seconds",
                                   "peak_rss_mib"]),
        rollout_median=summarise(rollout, [f"{w}_best_s" for w in args.workloads.split(",")]
                                 + ["peak_rss_mib"]))
    out["exact_over_base"] = {
        part: {k: round(v / out[f"{part}_median"]["base"][k], 3)
               for k, v in out[f"{part}_median"].get("exact", {}).items()
               if out[f"{part}_median"]["base"].get(k)}
        for part in ("e2e", "rollout") if out[f"{part}_median"]}
    print(json.dumps({k: out[k] for k in ("e2e_median", "rollout_median", "exact_over_base")},
                     indent=1))
    if args.json:
        args.json.write_text(json.dumps(out, indent=1) + "\n")
    return out


if __name__ == "__main__":
    main()
