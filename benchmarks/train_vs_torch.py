"""Training tokens/s of one `train_step` against torch + transformers (issue 21, "Measured").

Same weights (SmolLM2-135M-Instruct, fp32), same N x L batch (PROMPT prompt tokens, the rest
completion; loss on completion tokens only), same PPO-clip token loss (ratio
exp(logp - old_logp), clip eps 0.2, token mean over completion tokens, advantages +-1 per
sample, old_logp = the current logp, so the ratio is 1), same optimizer (global-norm clip 1,
Adam b1 0.9 / b2 0.99, weight decay 0, lr 1e-6: `make_optimizer()`'s defaults).

- ours: `train_step` with the default TrainConfig (token_budget 4096, remat "full"; `--remat`
  overrides) on `make_batch` of a fake RolloutBatch whose behavior log-probs are the model's
  own (`next_token_log_probs`, computed once before timing), so the ratio is 1 as well.
- torch: `model(input_ids).logits[:, :-1]`, each target's log-prob picked and normalised by
  a per-row logsumexp (the selective log-softmax TRL uses), loss.backward(),
  clip_grad_norm_(1.0), AdamW.step(). `--torch-checkpointing` (default on) enables the
  model's gradient checkpointing, the counterpart of our remat (without it the [N, L]
  activations of 32x512 need ~20 GiB here).

Each (point, side) runs in a fresh subprocess, `--steps` steps, the first excluded
(compile / warm-up): seconds/step is the mean of the others. Sides alternate per point
(ours, torch 1 thread, torch 2 threads[, ours single-threaded XLA]) for `--rounds` rounds;
the best round of each side is reported. Tokens/s = N x L / seconds per step. Peak RSS =
VmHWM of the child. Step 1's loss and pre-clip gradient norm are reported per side: the
same work gives the same numbers (to float error).

    python -m benchmarks.train_vs_torch [--points 16x256,32x512] [--rounds 2] [--steps 3]
        [--ours-single-thread] [--json PATH] [--md PATH]
    python -m benchmarks.train_vs_torch --profile 16x256 [--remats full,dots,none]
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import pathlib
import subprocess
import sys
import time

import numpy as np

from benchmarks.timing import write_report

MODEL = "/root/.cache/jaxrl_cache/SmolLM2-135M-Instruct"
TORCH_PYTHON = "/work/torchvenv/bin/python"
OURS_PYTHON = "/work/main/.venv/bin/python"
PROMPT = 32
CLIP_EPS = 0.2
LR = 1e-6
XLA_SINGLE = "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"
DEFAULT_POINTS = "16x256,32x512"


def _vmhwm_gib() -> float:
    for line in pathlib.Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return round(int(line.split()[1]) / 2**20, 3)
    raise KeyError("VmHWM")


def _tokens_and_advantages(n: int, length: int, vocab: int):
    """int32 [n, length] token ids (fake_rollouts, seed 0) and f32 [n] advantages +-1."""
    from benchmarks.train_memory import fake_rollouts

    rollouts = fake_rollouts(n, length, vocab)
    tokens = np.array([s.prompt_ids + s.output_ids for s in rollouts.samples], np.int32)
    adv = np.random.default_rng(1).choice(np.array([-1.0, 1.0], np.float32), n)
    return rollouts, tokens, adv


def run_ours(n: int, length: int, steps: int, remat: str) -> dict:
    """`steps` train steps of this library; per-step seconds, step 1's loss / grad norm."""
    import jax

    from jaxrl_cache.models import from_pretrained
    from jaxrl_cache.rl.logprobs import next_token_log_probs
    from jaxrl_cache.rl.batch import make_batch
    from jaxrl_cache.rl.train import TrainState, train_step
    from jaxrl_cache.rl.train_config import TrainConfig

    config, params = from_pretrained(MODEL, dtype="float32")
    rollouts, tokens, adv = _tokens_and_advantages(n, length, config.vocab_size)
    logp = np.asarray(next_token_log_probs(params, config, tokens, rollouts.sampling))
    samples = [dataclasses.replace(s, output_logprobs=logp[i, PROMPT - 1:].astype(np.float32))
               for i, s in enumerate(rollouts.samples)]
    batch = make_batch(dataclasses.replace(rollouts, samples=samples), adv,
                       advantages=lambda rewards, groups: rewards.astype(np.float32))
    state = TrainState.create(params, config=config, lr_schedule=LR)
    del params
    cfg = TrainConfig(clip_eps=CLIP_EPS, remat=remat)
    seconds, first = [], None
    for _ in range(steps):
        t0 = time.perf_counter()
        state, metrics = jax.block_until_ready(train_step(state, batch, cfg))
        seconds.append(time.perf_counter() - t0)
        if first is None:
            first = dict(loss=float(metrics["loss"]), grad_norm=float(metrics["grad_norm"]),
                         ratio_max=float(metrics["ratio_max"]))
    return dict(step_seconds=seconds, first_step=first, remat=remat,
                xla_flags=os.environ.get("XLA_FLAGS", ""), jax=jax.__version__)


def profile_ours(n: int, length: int, remats: list[str]) -> dict:
    """Where one micro-batch's time goes (seconds of one call each, after compiling): the
    decoder forward, the forward + chunked LM-head log-probs, and the gradient of the
    weighted log-prob sum per remat policy, with XLA's temp bytes of each program."""
    import jax

    from jaxrl_cache.models import from_pretrained
    from jaxrl_cache.models.llama import hidden_states
    from jaxrl_cache.rl.logprobs import knobs_of, token_log_probs
    from jaxrl_cache.rl.batch import make_batch, pack_batch
    from jaxrl_cache.rl.train_config import TrainConfig

    config, params = from_pretrained(MODEL, dtype="float32")
    rollouts, _, adv = _tokens_and_advantages(n, length, config.vocab_size)
    batch = make_batch(rollouts, adv, advantages=lambda rewards, groups: rewards)
    mb = jax.tree.map(lambda x: x[0, 0], pack_batch(batch, TrainConfig()))  # [B, R]
    knobs, kind = knobs_of(batch.sampling, config.vocab_size)

    def logp(p, mb, remat="none"):
        return token_log_probs(p, config, mb.tokens, mb.targets, knobs, kind=kind,
                               positions=mb.positions, segments=mb.segments,
                               parents=mb.parents, kv_blocks=mb.kv_blocks, items=mb.items,
                               columns=mb.columns, sources=mb.sources, remat=remat)

    programs = {"decoder forward": lambda p, mb: hidden_states(p, config, mb.tokens,
                                                               mb.positions, mb.segments,
                                                               mb.parents, mb.kv_blocks,
                                                               mb.items, mb.columns,
                                                               mb.sources),
                "forward + log-probs": logp}
    for remat in remats:
        programs[f"grad remat={remat}"] = jax.grad(
            lambda p, mb, r=remat: (logp(p, mb, r) * mb.weights).sum())
    out = dict(micro_batch_BR=list(mb.tokens.shape))
    for name, fn in programs.items():
        t0 = time.perf_counter()
        compiled = jax.jit(fn).lower(params, mb).compile()
        t1 = time.perf_counter()
        jax.block_until_ready(compiled(params, mb))
        out[name] = dict(compile_seconds=round(t1 - t0, 1),
                         seconds=round(time.perf_counter() - t1, 2),
                         temp_gib=round(compiled.memory_analysis().temp_size_in_bytes / 2**30,
                                        3), load=[round(x, 2) for x in os.getloadavg()])
        print(name, out[name], file=sys.stderr, flush=True)
    return out


def selective_log_softmax(logits, index):
    """log softmax(logits)[..., index] row by row: logits [N, T, V], index [N, T] -> [N, T];
    one [T, V] logsumexp at a time instead of an [N, T, V] log-softmax."""
    import torch

    picked = torch.gather(logits, -1, index.unsqueeze(-1)).squeeze(-1)
    lse = torch.stack([torch.logsumexp(row, dim=-1) for row in logits])
    return picked - lse


def run_torch(n: int, length: int, steps: int, threads: int, checkpointing: bool) -> dict:
    """`steps` PPO-clip steps of transformers' model with AdamW; as `run_ours`."""
    import torch
    import transformers

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32)
    if checkpointing:
        model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs=dict(use_reentrant=False))
    model.config.use_cache = False
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.99), weight_decay=0.0)
    _, tokens, adv = _tokens_and_advantages(n, length, model.config.vocab_size)
    ids = torch.from_numpy(tokens.astype(np.int64))
    adv = torch.from_numpy(adv)[:, None]
    mask = torch.zeros(n, length - 1)
    mask[:, PROMPT - 1:] = 1.0  # position t predicts token t + 1: completion from PROMPT - 1
    seconds, first = [], None
    for _ in range(steps):
        t0 = time.perf_counter()
        logits = model(input_ids=ids).logits[:, :-1]
        logp = selective_log_softmax(logits, ids[:, 1:])
        ratio = torch.exp(logp - logp.detach())
        surrogate = torch.maximum(-adv * ratio,
                                  -adv * torch.clamp(ratio, 1 - CLIP_EPS, 1 + CLIP_EPS))
        loss = (surrogate * mask).sum() / mask.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        del logits, logp, ratio, surrogate
        seconds.append(time.perf_counter() - t0)
        if first is None:
            first = dict(loss=float(loss), grad_norm=float(norm))
    return dict(step_seconds=seconds, first_step=first, threads=threads,
                checkpointing=checkpointing, torch=torch.__version__,
                transformers=transformers.__version__)


SIDES = {  # name: (python, environment, child arguments)
    "ours": (OURS_PYTHON, {}, ["--side", "ours"]),
    "torch-1t": (TORCH_PYTHON, dict(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1"),
                 ["--side", "torch", "--threads", "1"]),
    "torch-2t": (TORCH_PYTHON, dict(OMP_NUM_THREADS="2", MKL_NUM_THREADS="2"),
                 ["--side", "torch", "--threads", "2"]),
    "ours-xla-1t": (OURS_PYTHON, dict(XLA_FLAGS=XLA_SINGLE), ["--side", "ours"]),
}


def _run_child(side: str, point: str, args) -> dict:
    python, env, extra = SIDES[side]
    cmd = [python, "-m", "benchmarks.train_vs_torch", "--child", point, "--steps",
           str(args.steps), "--remat", args.remat] + extra + \
        ["--no-torch-checkpointing"] * (not args.torch_checkpointing)
    n, length = (int(x) for x in point.split("x"))
    row = dict(side=side, point=point, n=n, length=length, tokens=n * length,
               load_before=[round(x, 2) for x in os.getloadavg()])
    t0 = time.time()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout,
                              env={**os.environ, **env}, cwd=pathlib.Path(__file__).parent.parent)
    except subprocess.TimeoutExpired:
        return dict(row, error=f"timeout after {args.timeout:.0f} s")
    found = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode or not found:
        tail = (proc.stderr.strip().splitlines() or ["?"])[-1][:300]
        return dict(row, error=f"rc {proc.returncode}: {tail}")
    row.update(json.loads(found[-1][len("RESULT "):]))
    timed = row["step_seconds"][1:] or row["step_seconds"]
    row.update(seconds_per_step=round(float(np.mean(timed)), 2),
               tokens_per_second=round(n * length / float(np.mean(timed)), 1),
               step_seconds=[round(s, 2) for s in row["step_seconds"]],
               load_after=[round(x, 2) for x in os.getloadavg()],
               wall_seconds=round(time.time() - t0, 1))
    return row


def summarise(rows: list[dict]) -> list[dict]:
    """Per point: each side's best round and ours / faster torch (tokens/s)."""
    out = []
    for point in dict.fromkeys(r["point"] for r in rows):
        best = {}
        for r in rows:
            if r["point"] == point and "error" not in r and (
                    r["side"] not in best or r["tokens_per_second"]
                    > best[r["side"]]["tokens_per_second"]):
                best[r["side"]] = r
        torch_best = max((best[s]["tokens_per_second"] for s in ("torch-1t", "torch-2t")
                          if s in best), default=None)
        summary = dict(point=point, **{
            s: dict(seconds_per_step=r["seconds_per_step"],
                    tokens_per_second=r["tokens_per_second"], peak_rss_gib=r["peak_rss_gib"])
            for s, r in best.items()})
        for s in ("ours", "ours-xla-1t"):
            if s in best and torch_best:
                summary[f"{s}_over_faster_torch"] = round(
                    best[s]["tokens_per_second"] / torch_best, 3)
        out.append(summary)
    return out


def markdown(result: dict) -> str:
    lines = [f"# train_step vs torch + transformers, CPU ({result['date']})", "",
             f"{result['machine']}; SmolLM2-135M-Instruct fp32; prompt {PROMPT} tokens, loss "
             f"on completion tokens; PPO-clip (eps {CLIP_EPS}, ratio 1), Adam(W) lr {LR}, "
             f"clip 1.0. ours: default TrainConfig (token_budget 4096, remat "
             f"{result['remat']}); torch gradient checkpointing: "
             f"{result['torch_checkpointing']}. {result['steps']} steps per run, the first "
             "excluded; best of the rounds; sides alternate within a round.", "",
             "| N x L | side | s/step | tokens/s | peak RSS GiB | step-1 loss | step-1 grad norm "
             "| load before |", "|---|---|---|---|---|---|---|---|"]
    for r in result["runs"]:
        if "error" in r:
            lines.append(f"| {r['point']} | {r['side']} | failed: {r['error']} | | | | | "
                         f"{r['load_before']} |")
            continue
        lines.append(f"| {r['point']} | {r['side']} | {r['seconds_per_step']} | "
                     f"{r['tokens_per_second']} | {r['peak_rss_gib']} | "
                     f"{r['first_step']['loss']:.5f} | {r['first_step']['grad_norm']:.5f} | "
                     f"{r['load_before']} |")
    lines += ["", "Ratio ours / faster torch (tokens/s, best rounds):", ""]
    for s in result["summary"]:
        ratios = {k: v for k, v in s.items() if k.endswith("_over_faster_torch")}
        lines.append(f"- {s['point']}: {ratios}")
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--points", default=DEFAULT_POINTS, help="comma-separated NxL")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--remat", default="full", help="ours: TrainConfig.remat")
    p.add_argument("--sides", default="ours,torch-1t,torch-2t",
                   help="comma-separated, from " + ", ".join(SIDES))
    p.add_argument("--ours-single-thread", action="store_true",
                   help="add the ours-xla-1t side (XLA_FLAGS=" + XLA_SINGLE + ")")
    p.add_argument("--torch-checkpointing", action=argparse.BooleanOptionalAction,
                   default=True)
    p.add_argument("--timeout", type=float, default=1800, help="seconds per run")
    p.add_argument("--json", type=pathlib.Path)
    p.add_argument("--md", type=pathlib.Path)
    p.add_argument("--profile", metavar="NxL",
                   help="only profile ours on the first micro-batch of NxL (--remats)")
    p.add_argument("--remats", default="full,dots,none", help="with --profile")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--side", help=argparse.SUPPRESS)
    p.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        n, length = (int(x) for x in args.child.split("x"))
        row = (run_ours(n, length, args.steps, args.remat) if args.side == "ours" else
               run_torch(n, length, args.steps, args.threads, args.torch_checkpointing))
        print("RESULT " + json.dumps(dict(row, peak_rss_gib=_vmhwm_gib())), flush=True)
        return
    if args.profile:
        n, length = (int(x) for x in args.profile.split("x"))
        print(json.dumps(profile_ours(n, length, args.remats.split(","))), flush=True)
        return
    sides = args.sides.split(",") + ["ours-xla-1t"] * args.ours_single_thread
    runs = []
    for _ in range(args.rounds):
        for point in args.points.split(","):
            for side in sides:
                row = _run_child(side, point, args)
                print(json.dumps(row), flush=True)
                runs.append(row)
    result = dict(date=datetime.date.today().isoformat(), machine=f"CPU, {os.cpu_count()} "
                  "cores, shared", model=MODEL, prompt_tokens=PROMPT, steps=args.steps,
                  remat=args.remat, torch_checkpointing=args.torch_checkpointing,
                  runs=runs, summary=summarise(runs))
    write_report(result, args.json, args.md, markdown)


if __name__ == "__main__":
    main()
