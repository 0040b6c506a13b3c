"""`jaxrl-cache` command line: `demo` (GRPO end to end on CPU) and `bench` (benchmarks)."""
from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import subprocess
import sys
import tempfile
import time

REPO = pathlib.Path(__file__).resolve().parents[2]


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, no usage dump, no traceback
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def _number(parse, what: str, ok):
    """An argparse type: `parse` the text, then require `ok(value)`; errors say `what`."""
    def convert(text):
        try:
            value = parse(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if not ok(value):
            raise argparse.ArgumentTypeError(f"expected {what}, got {value}")
        return value
    return convert


_positive_int = _number(int, "a positive integer", lambda v: v >= 1)
_natural_int = _number(int, "an integer >= 0", lambda v: v >= 0)
_natural_float = _number(float, "a finite number >= 0", lambda v: 0 <= v < float("inf"))
_positive_float = _number(float, "a positive number", lambda v: 0 < v < float("inf"))


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="jaxrl-cache", description=(
        "Attributable RL post-training in JAX: every sample carries the policy version that "
        "produced it, and prefix KV is never reused across versions."))
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    demo = sub.add_parser("demo", help="SFT warm start + GRPO on a text task (CPU, ~3 min)",
                          description=(
                              "Trains a policy by GRPO on a text task with a verifiable reward. "
                              "Default: a small built-in model with a character tokenizer, "
                              "saved as a Hugging Face directory, warm-started by a short SFT, "
                              "then GRPO on 'repeat the number' (exact match). Each step: "
                              "rollout at the current version -> decode -> rewards -> audit "
                              "of every sample -> train_step -> sync_weights. Writes to --out: "
                              "run.json, metrics.jsonl, demo.png, checkpoints/, sft_model/, "
                              "final_model/ (the exported policy). Ctrl-C or SIGTERM stops "
                              "after the current step and saves; --resume continues."))
    from jaxrl_cache.app.demo import DemoOptions
    d = DemoOptions()
    _policy_arguments(demo.add_argument_group("policy and task").add_argument)
    _grpo_arguments(demo.add_argument_group("warm start and GRPO").add_argument, d)
    _trainer_arguments(demo.add_argument_group("train step").add_argument, d)
    _engine_arguments(demo.add_argument_group("rollout engine").add_argument, d)
    _run_arguments(demo.add_argument_group("run directory").add_argument, d)
    bench = sub.add_parser("bench", help="run the CPU benchmark suite and print its figures",
                           description="Runs benchmarks/ with pytest-benchmark and prints a "
                                       "table of the figures (ratios measured side by side).")
    bench.add_argument("--quick", action="store_true",
                       help="only the fast benchmarks (cache bookkeeping and kernels)")
    bench.add_argument("--json", metavar="PATH", help="also write pytest-benchmark's JSON here")
    return parser


def _policy_arguments(add) -> None:
    add("--model", metavar="PATH", help="start from this Hugging Face model directory "
        "(config.json, safetensors, tokenizer.json; Llama/Mistral/Qwen2/Qwen3) instead of the "
        "built-in model; prompts use its chat template if it has one")
    add("--task", metavar="FILE", help='JSONL task file, one {"prompt": ..., "answer": ...} '
        "per line (e.g. examples/tasks/arithmetic.jsonl); default: the built-in "
        "'repeat the number' task")
    add("--env", choices=["calculator"], help="multi-turn episodes instead of single "
        "completions: 3-digit multiplication with a calculator tool the policy calls in "
        "writing (c:123*456); the warm start teaches the tool format, rewards come from the "
        "environment, every sampled token of every turn is audited (built-in model only)")
    add("--answer-regex", metavar="REGEX", help="with --task: reward 1 if the last match of "
        "REGEX in the completion (its first group if any) equals the answer, else 0 "
        "(GSM8K style: '####\\s*(-?[\\d.,]+)'); default: exact match of the whole "
        "completion (whitespace stripped)")


def _grpo_arguments(add, d) -> None:
    add("--steps", type=_positive_int, default=d.steps,
        help="GRPO steps (= final policy version) [%(default)s]")
    add("--sft-steps", type=_natural_int, default=None,
        help="at most this many supervised warm-start steps on reference answers before "
             "GRPO; 0 skips it [300 for the built-in model, 400 with --env, 0 with --model]")
    add("--sft-stop-loss", type=_positive_float, default=None,
        help="the warm start stops early once its smoothed token loss falls below this: it "
             "is deliberately short, GRPO does the rest [0.5; 0.2 with --env]")
    add("--sft-lr", type=_positive_float, default=d.sft_lr,
        help="warm-start learning rate (Adam) [%(default)s]")
    add("--sft-batch", type=_positive_int, default=d.sft_batch,
        help="warm-start examples per step [%(default)s]")
    add("--group-size", type=_positive_int, default=d.group_size,
        help="samples per prompt (GRPO group, >= 2) [%(default)s]")
    add("--prompts-per-step", type=_positive_int, default=d.prompts_per_step,
        help="prompts per GRPO step [%(default)s]")
    add("--rollout-calls", type=_positive_int, default=d.rollout_calls,
        help="rollout calls per step; later calls hit the prefix cached by earlier ones "
             "(one call of all the step's prompts decodes fastest) [%(default)s]")
    add("--max-new-tokens", type=_positive_int, default=None,
        help="generation budget per sample [built-in task: answer + <eos>; --task: 64]")
    add("--temperature", type=_natural_float, default=d.temperature,
        help="sampling temperature of rollouts and evaluation [%(default)s]")
    add("--lr", type=_positive_float, default=None, help="GRPO peak learning rate "
        "[3e-3; 3e-4 with --env]")
    add("--warmup-steps", type=_natural_int, default=d.warmup_steps,
        help="GRPO linear learning-rate warmup [%(default)s]")
    add("--eval-prompts", type=_positive_int, default=d.eval_prompts,
        help="fixed prompts scored (exact match, one sample each) before and after GRPO "
             "[%(default)s]")


def _trainer_arguments(add, d) -> None:
    add("--correction", choices=["none", "decoupled"], default=d.correction,
        help="off-policy correction of the train step: PPO-clip against the behavior "
             "logprobs, or decoupled PPO (clip against the proximal logprobs: the params "
             "before the step's first update; importance weights proximal/behavior "
             "truncated at 2). Its clip binds only with --mini-batches > 1 [%(default)s]")
    add("--mini-batches", type=_positive_int, default=d.mini_batches,
        help="optimizer updates per GRPO step: the step's samples split into this many "
             "parts, one update (one policy version) each [%(default)s]")
    add("--token-budget", type=_positive_int, default=d.token_budget,
        help="tokens per training micro-batch: the trainer's activation memory is set by it, "
             "not by the batch (gradients accumulate over micro-batches) [%(default)s]")
    add("--loss-type", choices=["dapo", "grpo", "dr_grpo"], default=d.loss_type,
        help="loss aggregation (TRL's names): token mean, mean of per-sequence token means, "
             "or token sum / (sequences x max new tokens) [%(default)s]")


def _engine_arguments(add, d) -> None:
    add("--kv-pages", type=_positive_int, default=d.kv_pages,
        help="KV pool size in pages of 8 tokens [sized from the job: every sample of a "
             "rollout call (or the eval) at its longest, at least 512 pages, at most half "
             "the available memory]")
    add("--chunk-steps", type=_positive_int, default=d.chunk_steps,
        help="decode steps per on-device chunk; with --async, weight updates land between "
             "chunks [%(default)s]")
    add("--seed", type=int, default=d.seed, help="random seed in [0, 2**32-1] [%(default)s]")
    add("--backend", choices=["auto", "xla", "interpret", "pallas"], default=d.backend,
        help="attention backend [%(default)s]")
    add("--async", dest="async_rollouts", action="store_true",
        help="asynchronous RL: a rollout worker keeps generating while the trainer trains; "
             "weight updates land between decode chunks (see --kv-policy) and every token "
             "records the version that sampled it")
    add("--kv-policy", choices=["recompute", "keep"], default=d.kv_policy,
        help="with --async, what an update does to samples in flight: re-prefill them with "
             "the new weights (strictly attributable) or keep their old KV (flagged mixed) "
             "[%(default)s]")
    add("--max-policy-lag", type=_natural_int, default=d.max_policy_lag,
        help="with --async, the oldest token version a trained sample may have, in updates "
             "behind the trainer; older rollouts are dropped and counted [%(default)s]")
    add("--mesh", metavar="trainer=T,engine=E", help="train and generate on "
        "disjoint device sets: the trainer FSDP over T devices (or DxF: data D x fsdp F), "
        "the rollout engine tensor-parallel over the next E; every weight sync reshards "
        "between them (bytes and time per sync are reported). On CPU, simulate devices with "
        "XLA_FLAGS=--xla_force_host_platform_device_count=8 [one device]")


def _run_arguments(add, d) -> None:
    add("--checkpoint-every", type=_positive_int, default=d.checkpoint_every,
        help="save a checkpoint every k GRPO steps (also at the end and on Ctrl-C/SIGTERM; "
             "a kill -9 loses at most k steps) [%(default)s]")
    add("--out", default=d.out, help="output directory [%(default)s]")
    add("--resume", action="store_true",
        help="continue the run in --out from its latest checkpoint with its saved options "
             "(only --steps may change); metrics.jsonl is cut to the checkpoint's steps")
    add("--overwrite", action="store_true",
        help="replace the previous run in --out (its demo files only)")


def _print_table(rows: list[tuple[str, str]], title: str) -> None:
    width = max(len(k) for k, _ in rows)
    print(f"\n{title}")
    print("-" * (width + 24))
    for key, value in rows:
        print(f"{key:<{width}}  {value}")


def _demo(args) -> int:
    from jaxrl_cache.app.demo import DemoOptions, run_demo
    from jaxrl_cache.errors import CacheFullError
    try:
        opts = DemoOptions(**{f.name: getattr(args, f.name)
                              for f in dataclasses.fields(DemoOptions)})
        s = run_demo(opts)
    except (ValueError, OSError, CacheFullError) as e:  # CheckpointError, ConfigError too
        print(f"jaxrl-cache demo: error: {e}".splitlines()[0], file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("jaxrl-cache demo: aborted; the last checkpoint is kept (--resume continues; a "
              "run aborted before its first checkpoint left nothing)", file=sys.stderr)
        return 130
    rl_exact = "n/a (interrupted)" if s["rl_exact_match"] is None else \
        f"{s['rl_exact_match']:.3f}"
    saved = s["prefill_tokens_saved"] / max(s["prompt_tokens"], 1)
    _print_table([
        ("task / policy", f"{s['task']} / {s['policy']}"),
        ("GRPO steps run / final version", f"{s['steps_run']} / {s['final_version']}"),
        ("mean reward, first -> last", f"{s['reward_first']:.3f} -> {s['reward_last']:.3f}"),
        ("exact match in training, first -> last",
         f"{s['exact_first']:.3f} -> {s['exact_last']:.3f}"),
        *([("episodes calling the tool, first -> last",
            f"{s['tool_use_first']:.3f} -> {s['tool_use_last']:.3f}")]
          if s["tool_use_first"] is not None else []),
        (f"exact match (eval, {s['eval_prompts']} prompts)",
         f"{'after SFT' if s['warm_started'] else 'before GRPO'} "
         f"{s['sft_exact_match']:.3f} -> after GRPO {rl_exact}"),
        ("tokens generated", f"{s['generated_tokens']:,}"),
        ("prefill saved (radix + group)", f"{s['prefill_tokens_saved']:,} ({saved:.1%})"),
        ("served by the radix cache", f"{s['radix_cached_tokens']:,}"),
        ("attribution audit", f"{s['audited_samples'] - s['audit_failures']:,} / "
                              f"{s['audited_samples']:,} samples reproduce their logprobs"),
        ("mode", s["mode"] + ("" if s["mode"] == "sync" else
                              f": {s['recomputed_tokens']:,} tokens recomputed, "
                              f"{s['mixed_tokens']:,} mixed, {s['dropped_stale_calls']} stale "
                              f"calls dropped, token staleness {s['staleness_histogram']}")),
        ("devices", s["devices"]),
        ("weight sync (trainer -> engine)",
         f"{s['sync_bytes'] / 2**20:,.1f} MiB copied, median {s['sync_seconds_median'] * 1e3:.1f}"
         f" ms per sync ({s['syncs']} syncs)"),
        ("wall time", f"{s['seconds']:.1f} s"),
        ("outputs", f"{s['out']}/metrics.jsonl, demo.png, checkpoints/"),
        ("exported policy (HF)", s["exported"]),
    ], "jaxrl-cache demo summary" + (" (interrupted)" if s["interrupted"] else ""))
    return 0 if s["audit_failures"] == 0 else 1


def _bench(args) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        out = pathlib.Path(args.json or pathlib.Path(tmp) / "bench.json").resolve()
        cmd = [sys.executable, "-m", "pytest", str(REPO / "benchmarks"), "--benchmark-only",
               "-q", "-p", "no:cacheprovider", f"--benchmark-json={out}"]
        if args.quick:
            cmd += ["-m", "not slow"]
        t0 = time.perf_counter()
        code = subprocess.call(cmd, cwd=REPO)
        if not out.exists():
            print("jaxrl-cache bench: error: the benchmarks produced no results", file=sys.stderr)
            return code or 1
        data = json.loads(out.read_text())
    rows = []
    for b in data["benchmarks"]:
        rows.append((b["name"], f"mean {b['stats']['mean'] * 1e3:9.3f} ms"))
        for key, value in sorted(b.get("extra_info", {}).items()):
            shown = f"{value:.4g}" if isinstance(value, float) else str(value)
            rows.append((f"  {key}", shown))
    _print_table(rows, f"jaxrl-cache bench ({time.perf_counter() - t0:.0f} s, "
                       f"{data['machine_info'].get('cpu', {}).get('brand_raw', 'cpu')})")
    return code


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    return {"demo": _demo, "bench": _bench}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
