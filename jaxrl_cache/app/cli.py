"""`jaxrl-cache` command line: `grpo` (GRPO on a dataset with reward functions: a TRL
recipe's), `demo` (the same run on the built-in task, end to end on CPU) and `bench`."""
from __future__ import annotations

import argparse
import ctypes
import dataclasses
import json
import os
import pathlib
import signal
import subprocess
import sys
import tempfile
import time

from jaxrl_cache.app import config_file

REPO = pathlib.Path(__file__).resolve().parents[2]


class _Parser(argparse.ArgumentParser):
    """One-line errors; `flags` records its long options as they are added, its argument
    groups' too (what --config may set); `commands` holds its subcommands' parsers."""

    def __init__(self, *args, **kwargs):
        self.flags, self.commands = config_file.Flags(), {}
        super().__init__(*args, **kwargs)

    def add_argument(self, *names, **kwargs):
        return self.flags.recording(super().add_argument)(*names, **kwargs)

    def add_argument_group(self, *args, **kwargs):
        group = super().add_argument_group(*args, **kwargs)
        group.add_argument = self.flags.recording(group.add_argument)
        return group

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
_power_of_two = _number(int, "a power of two", lambda v: v >= 1 and not v & (v - 1))


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="jaxrl-cache", description=(
        "Attributable RL post-training in JAX: every sample carries the policy version that "
        "produced it, and prefix KV is never reused across versions."))
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}",
                        help="print the installed version and exit")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    grpo = sub.add_parser(
        "grpo", help="GRPO on your dataset with your reward functions (a TRL recipe)",
        description=(
            "Trains a policy by GRPO on --dataset's prompts (a JSONL, JSON or parquet file, "
            "a datasets directory saved with save_to_disk, or a Hub dataset) with reward "
            "functions written as for TRL's GRPOTrainer (--reward), or the answer column's "
            "check. Each step: rollout at the current version -> decode -> rewards -> audit "
            "of every sample -> train_step -> sync_weights. " + _RUN_TEXT))
    demo = sub.add_parser(
        "demo", help="SFT warm start + GRPO on a built-in task (CPU, ~3 min)",
        description=(
            "The grpo run on a built-in task: a small built-in model with a character "
            "tokenizer, saved as a Hugging Face directory, warm-started by a short SFT, then "
            "GRPO on 'repeat the number' (exact match), or --env calculator. " + _RUN_TEXT))
    _run_parser(grpo, "grpo")
    _run_parser(demo, "demo")
    bench = sub.add_parser("bench", help="run the CPU benchmark suite and print its figures",
                           description="Runs benchmarks/ with pytest-benchmark and prints a "
                                       "table of the figures (ratios measured side by side).")
    bench.add_argument("--quick", action="store_true",
                       help="only the fast benchmarks (cache bookkeeping and kernels)")
    bench.add_argument("--json", metavar="PATH", help="also write pytest-benchmark's JSON here")
    parser.commands.update(grpo=grpo, demo=demo, bench=bench)
    return parser


_RUN_TEXT = ("Writes to --out: run.json, metrics.jsonl, demo.png, checkpoints/, sft_model/, "
             "final_model/ (the exported policy). Ctrl-C or SIGTERM stops after the current "
             "step and saves; --resume continues. Exit status: 0 done, 1 an audit failed, 2 "
             "bad input, 130 stopped by Ctrl-C (143 by SIGTERM).")
OUT = {"grpo": "runs/grpo", "demo": "runs/demo"}  # each command's default --out


def _run_parser(run: argparse.ArgumentParser, command: str) -> None:
    """The flags of a run command (grpo, demo: one DemoOptions, the flags of its task)."""
    from jaxrl_cache.app.options import DemoOptions  # no jax: --help stays fast
    d = argparse.Namespace(**{**{f.name: f.default for f in dataclasses.fields(DemoOptions)},
                              "out": OUT[command]})
    run.add_argument("--config", metavar="FILE", help="read settings from a YAML or JSON "
                     "mapping: the flags' names (dashes or underscores; async for --async), "
                     "a list for --stop and --reward, a mapping for --chat-template-kwargs, "
                     "true for a switch; flags given here override it; unknown names are an "
                     "error")
    task = run.add_argument_group("policy and task").add_argument
    _policy_arguments(task)
    if command == "grpo":
        _dataset_arguments(task)
    else:
        task("--env", choices=["calculator"], help="multi-turn episodes instead of single "
             "completions: 3-digit multiplication with a calculator tool the policy calls in "
             "writing (c:123*456); the warm start teaches the tool format, rewards come from "
             "the environment, every sampled token of every turn is audited (built-in model "
             "only)")
    _reward_argument(task, command)
    _grpo_arguments(run.add_argument_group("warm start and GRPO").add_argument, d)
    _trainer_arguments(run.add_argument_group("train step").add_argument, d)
    _engine_arguments(run.add_argument_group("rollout engine").add_argument, d)
    _run_arguments(run.add_argument_group("run directory").add_argument, d)


def _version() -> str:
    from importlib import metadata
    try:
        return metadata.version("jaxrl-cache")
    except metadata.PackageNotFoundError:  # a source tree that was never installed
        return "unknown (not installed)"


def _policy_arguments(add) -> None:
    add("--model", metavar="PATH|ID", help="start from this Hugging Face model: a local "
        "directory (config.json, safetensors, tokenizer.json; Llama/Mistral/Qwen2/Qwen3) or "
        "a Hub id such as Qwen/Qwen2.5-0.5B-Instruct (needs huggingface_hub; read from its "
        "cache, downloaded unless HF_HUB_OFFLINE=1) instead of the built-in model; prompts "
        "use its chat template if it has one")
    add("--chat-template-kwargs", metavar="JSON", help="extra variables of the model's chat "
        'template as a JSON object, e.g. \'{"enable_thinking": false}\' (Qwen3) [none]')


def _dataset_arguments(add) -> None:
    add("--dataset", metavar="PATH|NAME", help="the task's rows: a .jsonl file (one object "
        "per line), a .json list of objects, a .parquet file, a directory saved by "
        "datasets' save_to_disk, or a Hub dataset name such as openai/gsm8k (read from the "
        "datasets cache, downloaded unless HF_DATASETS_OFFLINE=1); each row has a prompt and "
        "any other columns (an answer, a solution, ...); with an answer column every 4th "
        "row is held out for evaluation (needs pip install 'jaxrl-cache[datasets]' but for "
        "JSON files) [required]")
    add("--split", metavar="NAME", help="the split of a DatasetDict directory or a Hub "
        "dataset [train]")
    add("--dataset-config", metavar="NAME", help="a Hub dataset's configuration (TRL's "
        "dataset_config; openai/gsm8k: main) [none]")
    add("--prompt-key", metavar="KEY", help="the rows' prompt field, text or chat messages "
        "[{role, content}, ...] (TRL's conversational format) [prompt; GSM8K: question]")
    add("--answer-key", metavar="KEY", help="the rows' answer field, a string or a number; "
        "an answer holding '####' is GSM8K's: what follows the last '####', commas removed, "
        "is the answer; optional with --reward (no answers: no warm start, no evaluation) "
        "[answer]")
    add("--system-prompt", metavar="TEXT", help="a system message before each prompt (the "
        "model's chat template renders it)")
    add("--answer-regex", metavar="REGEX", help="the completion's answer is the last match "
        "of REGEX (its first group that took part, if any); no match scores 0 [numeric and "
        "math-verify checks: the last \\boxed{...} or '#### ...' line, else the whole "
        "completion; exact: the whole completion (whitespace stripped)]")
    add("--answer-check", choices=["exact", "numeric", "math-verify"], help="how the "
        "answer is compared with the reference (reward 1 or 0, exact match and evaluation): "
        "exact strings; numeric (72. = 72, 1,000 = 1000, 3/4 = 0.75 = \\frac{3}{4}, else "
        "strings without spaces; a reference ending in '#### N' is N); math-verify (pip "
        "install 'jaxrl-cache[math]'); given with --reward, the answer reward joins the "
        "reward functions [numeric]")


def _reward_argument(add, command: str) -> None:
    joins = ("the rewards, TRL's reward_funcs (the answer reward joins them only with "
             "--answer-check)") if command == "grpo" else "an extra reward beside the task's"
    add("--reward", dest="rewards", action="append", metavar="MODULE:FUNCTION[=WEIGHT]",
        help=f"{joins}, each with WEIGHT [1] (repeat the flag for several): a function in "
        "an importable module or a .py file (path/to/file.py:fn), called as TRL calls one: "
        "fn(prompts=, completions=, completion_ids=, trainer_state=, <the row's other "
        "columns>) -> a list of float or None (None: not applicable); chat prompts give "
        "completions as [{role: assistant, content}] lists; an async def one is awaited with "
        "the others; a jaxrl_cache.rl.rewards.RewardFn there is used as declared (per "
        "sample or batched, threads, timeout); logged as rewards/<name>/mean|std")


def _grpo_arguments(add, d) -> None:
    add("--steps", type=_positive_int, default=d.steps,
        help="GRPO steps (= final policy version) [%(default)s]")
    add("--sft-steps", type=_natural_int, default=None,
        help="at most this many supervised warm-start steps on reference answers before "
             "GRPO; 0 skips it [600 for the built-in model, 400 with --env, 0 with --model]")
    add("--sft-stop-loss", type=_positive_float, default=None,
        help="the warm start stops early once its smoothed token loss falls below this: it "
             "is deliberately short, GRPO does the rest [0.5; 0.2 with --env]")
    add("--sft-lr", type=_positive_float, default=None,
        help="warm-start learning rate (Adam) [2e-3; 5e-3 with --env]")
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
        help="generation budget per sample [built-in task: answer + <eos>; --dataset: 64]")
    add("--temperature", type=_natural_float, default=d.temperature,
        help="sampling temperature of rollouts and evaluation [%(default)s]")
    add("--top-p", type=_number(float, "a number in (0, 1]", lambda v: 0 < v <= 1),
        default=d.top_p, help="nucleus sampling of rollouts and sampled evals [%(default)s]")
    add("--top-k", type=_natural_int, default=d.top_k,
        help="sample among the k likeliest tokens; 0: off [%(default)s]")
    add("--min-p", type=_number(float, "a number in [0, 1]", lambda v: 0 <= v <= 1),
        default=d.min_p, help="min-p sampling: keep the tokens whose probability is at least "
        "min_p x the likeliest one's (after temperature, top-k and top-p); 0: off "
        "[%(default)s]")
    add("--repetition-penalty", type=_positive_float, default=d.repetition_penalty,
        help="divide the logit of every token already in the context (prompt and output so "
             "far) by this if positive, multiply it if negative, before temperature "
             "(transformers / vLLM); 1: off [%(default)s]")
    add("--stop", action="append", metavar="TEXT", help="a stop string (repeat the flag for "
        "several): a completion ends at its first occurrence [none]")
    add("--include-stop-str-in-output", action="store_true",
        help="keep the stop string in the completion's text (rewards see it)")
    add("--lr", type=_positive_float, default=None, help="GRPO peak learning rate "
        "[1e-3; 3e-4 with --env]")
    add("--warmup-steps", type=_natural_int, default=d.warmup_steps,
        help="GRPO linear learning-rate warmup [%(default)s]")
    add("--weight-decay", type=_natural_float, default=d.weight_decay,
        help="decoupled weight decay of the GRPO optimizer (AdamW style) [%(default)s]")
    add("--max-grad-norm", type=_positive_float, default=d.max_grad_norm,
        help="gradients are clipped to this global norm [%(default)s]")
    add("--adam-b1", type=_number(float, "a number in [0, 1)", lambda v: 0 <= v < 1),
        default=d.adam_b1, help="Adam's first-moment decay [%(default)s]")
    add("--adam-b2", type=_number(float, "a number in [0, 1)", lambda v: 0 <= v < 1),
        default=d.adam_b2, help="Adam's second-moment decay [%(default)s]")
    add("--eval-prompts", type=_positive_int, default=d.eval_prompts,
        help="fixed prompts scored (exact match, one sample each) before and after GRPO "
             "[%(default)s]")
    add("--eval-every", type=_natural_int, default=d.eval_every,
        help="also evaluate the held-out prompts every N GRPO steps; the step's metrics row "
             "gains eval/exact_match (eval/pass@K with --eval-k K > 1, "
             "eval/greedy_exact_match with --eval-greedy); 0: before and after GRPO only "
             "[%(default)s]")
    add("--eval-k", type=_positive_int, default=d.eval_k,
        help="samples per eval prompt: exact match is their mean, pass@K the fraction of "
             "prompts with at least one right [%(default)s]")
    add("--eval-greedy", action="store_true",
        help="every eval also scores one greedy (temperature 0) completion per prompt")


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
    add("--epochs", type=_positive_int, default=d.epochs,
        help="passes over a step's batch; updates per step = --mini-batches x --epochs "
             "[%(default)s]")
    add("--clip-eps", type=_positive_float, default=d.clip_eps,
        help="PPO clip range: the ratio is clipped to [1 - eps, 1 + eps] [%(default)s]")
    add("--epsilon-high", type=_natural_float, default=d.epsilon_high,
        help="clip-higher (DAPO; TRL's epsilon_high): the ratio's upper clip is "
             "1 + this [--clip-eps]")
    add("--scale-rewards", choices=["group", "batch", "none"], default=d.scale_rewards,
        help="TRL's advantage scaling: r - group mean, divided by the group's or the "
             "batch's unbiased reward std + 1e-4, or not divided [r - group mean over the "
             "group's population std + 1e-6]")
    add("--mask-truncated-completions", action="store_true",
        help="completions cut at --max-new-tokens get no loss weight (still audited) "
             "[off]")
    add("--importance-sampling-level", choices=["token", "sequence"],
        default=d.importance_sampling_level,
        help="the ratio per token, or per sequence: exp of the sequence's mean log-ratio "
             "(GSPO) [%(default)s]")
    add("--entropy-coef", type=_natural_float, default=d.entropy_coef,
        help="entropy bonus: the loss minus this x the mean entropy of the sampling "
             "distribution over the trained tokens [%(default)s]")
    add("--dual-clip", type=_number(float, "a number > 1", lambda v: 1 < v < float("inf")),
        default=d.dual_clip, help="dual-clip PPO: bounds the ratio's pull on negative "
        "advantages at this (> 1) [off]")
    add("--is-cap", type=_number(float, "a number >= 1", lambda v: 1 <= v < float("inf")),
        default=d.is_cap, help="with --correction decoupled: importance weights truncated "
        "at this [%(default)s]")
    add("--kl-beta", type=_natural_float, default=d.kl_beta,
        help="weight of a k3 KL penalty to the policy GRPO started from (kept in memory "
             "beside the trained one); 0: none [%(default)s]")
    add("--remat", choices=["auto", "full", "dots", "none"], default=d.remat,
        help="rematerialisation of the layer scan in the train step (memory vs time); "
             "auto: dots when that fits half the memory, "
             "else full [%(default)s]")
    add("--compute-dtype", choices=["float32", "bfloat16"], default=d.compute_dtype,
        help="train-step compute dtype (params and optimizer state stay fp32); bfloat16: "
             "the engine samples with the bf16 cast of the params, so the audit still "
             "compares bits (full fine-tuning; LoRA keeps the engine fp32); fastest on CPUs "
             "with AMX [%(default)s]")
    add("--logprob-chunk", type=_positive_int, default=d.logprob_chunk,
        help="positions per LM-head chunk of the train step's log-probs [%(default)s]")
    add("--lora-rank", type=_natural_int, default=d.lora_rank,
        help="train LoRA adapters of this rank over the frozen model: the engine runs the "
             "trainer's base weights (one copy), a sync moves only the adapters, the final "
             "export adds a PEFT adapter directory; 0: full fine-tuning [%(default)s]")
    add("--lora-alpha", type=_positive_float, default=d.lora_alpha,
        help="LoRA scale = alpha / rank (PEFT's default) [%(default)s]")
    add("--lora-targets", metavar="NAMES", default=None,
        help="comma-separated projections to adapt (q_proj,k_proj,v_proj,o_proj,gate_proj,"
             "up_proj,down_proj) or all-linear [q_proj,v_proj, as PEFT]")


def _engine_arguments(add, d) -> None:
    add("--kv-pages", type=_positive_int, default=d.kv_pages,
        help="KV pool size in pages of --page-size tokens [sized from the job: every sample "
             "of a rollout call (or the eval) at its longest, at least 64 pages, at most half "
             "the available memory]")
    add("--page-size", type=_power_of_two, default=d.page_size,
        help="tokens per KV page, a power of two up to 65536: the prefix cache shares and "
             "reuses whole pages (the built-in prompts share a 9-token prefix) [%(default)s]")
    add("--chunk-steps", type=_positive_int, default=d.chunk_steps,
        help="decode steps per on-device chunk; with --async, weight updates land between "
             "chunks [%(default)s]")
    add("--seed", type=int, default=d.seed, help="random seed in [0, 2**32-1] [%(default)s]")
    add("--backend", choices=["auto", "xla", "interpret", "pallas"], default=d.backend,
        help="attention backend [%(default)s]")
    from jaxrl_cache.app.options import KERNELS
    add("--kernels", choices=list(KERNELS), default=d.kernels,
        help="batch-invariant kernels for every projection and the trainer's attention "
             "(JAXRL_CACHE_KERNELS; pallas: the mechanism for exact numerics on a GPU, not "
             "yet confirmed there; interpret: the same kernels on CPU, slow) [the "
             "environment's, else xla]")
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
        help="continue the run in --out from its latest checkpoint with its saved options; "
             "a setting given (flag or --config) that differs from the run's is refused, "
             "except --steps, --checkpoint-every, --eval-every, --report-to and "
             "--no-completions-log; "
             "metrics.jsonl and completions.jsonl are cut to the checkpoint's steps")
    add("--overwrite", action="store_true",
        help="replace the previous run in --out (its demo files only)")
    add("--report-to", metavar="SINKS", default=d.report_to,
        help="also send each step's numeric metrics, as it completes, to these sinks "
             "(comma-separated): tensorboard (--out/tensorboard/), csv (--out/metrics.csv), "
             "wandb (offline, --out/wandb/; needs wandb installed), or none; metrics.jsonl "
             "is always written [none]")
    add("--no-completions-log", dest="completions_log", action="store_false",
        help="do not write --out/completions.jsonl (one row per sample per step: prompt, "
             "completion, each reward, advantage, versions, log-prob mismatch)")


def _print_table(rows: list[tuple[str, str]], title: str) -> None:
    width = max(len(k) for k, _ in rows)
    print(f"\n{title}")
    print("-" * (width + 24))
    for key, value in rows:
        print(f"{key:<{width}}  {value}")


def _run(args) -> int:
    """`grpo` or `demo`: one run_demo (grpo needs --dataset, unless it resumes a run)."""
    from jaxrl_cache.app.demo import DemoOptions, run_demo
    from jaxrl_cache.errors import CacheFullError
    command = args.command
    try:
        if command == "grpo" and args.dataset is None and not args.resume:
            raise ValueError("--dataset is required (a JSONL/JSON/parquet file, a "
                             "save_to_disk directory or a Hub name); the built-in task: "
                             "jaxrl-cache demo")
        opts = DemoOptions(**{f.name: f.default if getattr(args, f.name, None) is None
                              else getattr(args, f.name)
                              for f in dataclasses.fields(DemoOptions)})
        s = run_demo(opts, given=args.given)
    except (ValueError, OSError, CacheFullError) as e:  # CheckpointError, ConfigError too
        print(f"jaxrl-cache {command}: error: {e}".splitlines()[0], file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"jaxrl-cache {command}: aborted; the last checkpoint is kept (--resume "
              f"continues; a run aborted before its first checkpoint left nothing)",
              file=sys.stderr)
        return 130
    _print_summary(s, command)
    if s["audit_failures"]:
        return 1
    return 128 + signal.Signals[s["stopped_by"]].value if s["stopped_by"] else 0


def _print_summary(s: dict, command: str) -> None:
    rl_exact = "n/a (interrupted)" if s["rl_exact_match"] is None else \
        f"{s['rl_exact_match']:.3f}"
    no_answers = s["exact_first"] is None
    saved = s["prefill_tokens_saved"] / max(s["prompt_tokens"], 1)
    _print_table([
        ("task / policy", f"{s['task']} / {s['policy']}"),
        ("GRPO steps run / final version", f"{s['steps_run']} / {s['final_version']}"),
        ("mean reward, first -> last", f"{s['reward_first']:.3f} -> {s['reward_last']:.3f}"),
        ("exact match in training, first -> last",
         "n/a (no answer column)" if no_answers else
         f"{s['exact_first']:.3f} -> {s['exact_last']:.3f}"),
        *([("episodes calling the tool, first -> last",
            f"{s['tool_use_first']:.3f} -> {s['tool_use_last']:.3f}")]
          if s["tool_use_first"] is not None else []),
        (f"exact match (eval, {s['eval_prompts']} prompts)",
         "n/a (no answer column)" if no_answers else
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
    ], f"jaxrl-cache {command} summary" + (" (interrupted)" if s["interrupted"] else ""))


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


MALLOC_ARENAS = 2  # glibc malloc arenas for the CLI's process: with one per XLA worker
# thread, freed step buffers stayed resident (SmolLM2 GRPO at 2 x 8 x 24: peak RSS 4.03 ->
# 3.69 GiB with 2; benchmarks/results/e2e-vs-peers-cpu-2026-12-04b.md)


def limit_malloc_arenas() -> None:
    """Caps glibc's malloc arenas (mallopt M_ARENA_MAX) unless MALLOC_ARENA_MAX is set;
    nothing off glibc."""
    if os.environ.get("MALLOC_ARENA_MAX") or not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL("libc.so.6").mallopt(ctypes.c_int(-8), ctypes.c_int(MALLOC_ARENAS))
    except (OSError, AttributeError):  # not glibc
        pass


limit_malloc_arenas()  # before XLA's worker threads start (importing jax starts none)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    command = args.command
    if command in ("grpo", "demo"):
        argv = _with_config(parser, argv, command, args.config)
        args = parser.parse_args(argv)
        # what was set explicitly (a --resume compares exactly these with the run's)
        args.given = config_file.given_names(parser.commands[command],
                                             argv[argv.index(command) + 1:])
    return {"grpo": _run, "demo": _run, "bench": _bench}[command](args)


def _with_config(parser: argparse.ArgumentParser, argv: list[str], command: str,
                 path) -> list[str]:
    """argv with the --config file's settings inserted after `command` (flags given on the
    command line come later, so they win); a bad file exits 2 with one line."""
    if path is None:
        return argv
    try:
        settings = config_file.config_argv(path, parser.commands[command].flags)
    except ValueError as e:
        parser.exit(2, f"jaxrl-cache {command}: error: {e}".splitlines()[0] + "\n")
    at = argv.index(command) + 1
    return argv[:at] + settings + argv[at:]


if __name__ == "__main__":
    sys.exit(main())
