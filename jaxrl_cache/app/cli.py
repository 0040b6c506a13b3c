"""`jaxrl-cache` command line: `demo` (GRPO end to end on CPU) and `bench` (benchmarks)."""
from __future__ import annotations

import argparse
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


def _positive_int(text):
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _positive_float(text):
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="jaxrl-cache", description=(
        "Attributable RL post-training in JAX: every sample carries the policy version that "
        "produced it, and prefix KV is never reused across versions."))
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    demo = sub.add_parser("demo", help="train a tiny LM by GRPO on a digit task (CPU, ~3 min)",
                          description=(
                              "GRPO on 'reverse the digits' with a fixed instruction prefix. "
                              "Each step: rollout at the current version -> rewards -> audit "
                              "-> train_step -> sync_weights. Writes metrics.jsonl, "
                              "reward.png and a checkpoint to --out. Ctrl-C stops after the "
                              "current step and saves."))
    from jaxrl_cache.app.demo import DemoOptions
    d = DemoOptions()
    demo.add_argument("--steps", type=_positive_int, default=d.steps,
                      help="total optimizer steps (= final policy version) [%(default)s]")
    demo.add_argument("--group-size", type=_positive_int, default=d.group_size,
                      help="samples per prompt (GRPO group) [%(default)s]")
    demo.add_argument("--prompts-per-step", type=_positive_int, default=d.prompts_per_step,
                      help="prompts per step [%(default)s]")
    demo.add_argument("--rollout-calls", type=_positive_int, default=d.rollout_calls,
                      help="rollout calls per step; later calls hit the cached prefix "
                           "[%(default)s]")
    demo.add_argument("--max-new-tokens", type=_positive_int, default=d.max_new_tokens,
                      help="generation budget per sample [%(default)s]")
    demo.add_argument("--lr", type=_positive_float, default=d.lr,
                      help="peak learning rate [%(default)s]")
    demo.add_argument("--seed", type=int, default=d.seed, help="random seed [%(default)s]")
    demo.add_argument("--backend", choices=["auto", "xla", "interpret", "pallas"],
                      default=d.backend, help="attention backend [%(default)s]")
    demo.add_argument("--out", default=d.out, help="output directory [%(default)s]")
    demo.add_argument("--resume", action="store_true",
                      help="continue from the checkpoint in --out (version and lr schedule)")
    bench = sub.add_parser("bench", help="run the CPU benchmark suite and print its figures",
                           description="Runs benchmarks/ with pytest-benchmark and prints a "
                                       "table of the figures (ratios measured side by side).")
    bench.add_argument("--quick", action="store_true",
                       help="only the fast benchmarks (cache bookkeeping and kernels)")
    bench.add_argument("--json", metavar="PATH", help="also write pytest-benchmark's JSON here")
    return parser


def _print_table(rows: list[tuple[str, str]], title: str) -> None:
    width = max(len(k) for k, _ in rows)
    print(f"\n{title}")
    print("-" * (width + 24))
    for key, value in rows:
        print(f"{key:<{width}}  {value}")


def _demo(args) -> int:
    from jaxrl_cache.app.demo import DemoOptions, run_demo
    try:
        opts = DemoOptions(steps=args.steps, group_size=args.group_size,
                           prompts_per_step=args.prompts_per_step,
                           rollout_calls=args.rollout_calls, max_new_tokens=args.max_new_tokens,
                           lr=args.lr, seed=args.seed, backend=args.backend, out=args.out,
                           resume=args.resume)
        s = run_demo(opts)
    except (ValueError, FileNotFoundError) as e:
        print(f"jaxrl-cache demo: error: {e}", file=sys.stderr)
        return 2
    saved = s["prefill_tokens_saved"] / max(s["prompt_tokens"], 1)
    _print_table([
        ("steps run / final version", f"{s['steps_run']} / {s['final_version']}"),
        ("mean reward, first -> last", f"{s['reward_first']:.3f} -> {s['reward_last']:.3f}"),
        ("tokens generated", f"{s['generated_tokens']:,}"),
        ("prompt tokens", f"{s['prompt_tokens']:,}"),
        ("prefill saved (radix + group)", f"{s['prefill_tokens_saved']:,} ({saved:.1%})"),
        ("served by the radix cache", f"{s['radix_cached_tokens']:,}"),
        ("attribution audit", f"{s['audited_samples'] - s['audit_failures']:,} / "
                              f"{s['audited_samples']:,} samples reproduce their logprobs"),
        ("wall time", f"{s['seconds']:.1f} s"),
        ("outputs", f"{s['out']}/metrics.jsonl, reward.png, checkpoint/"),
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
