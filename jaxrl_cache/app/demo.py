"""The main job (`jaxrl-cache grpo`, and `demo` on the built-in task): SFT warm start ->
GRPO on a text task, end to end, through HF directories.

1. Policy: `--model PATH|ID` (a Hugging Face directory with its tokenizer, or a Hub id:
   models/hub.py), or the built-in small model with a character tokenizer, written to
   `out/base_model` and read back.
2. Warm start (`--sft-steps`): teacher-forced cross-entropy on reference answers, saved as
   `out/sft_model`. RL starts from the HF directory read back (`from_pretrained`).
3. GRPO: each step, rollout at the current version (one call by default: the samples of a
   prompt reuse its cached prefix; with `--rollout-calls` > 1 later calls reuse the prefix
   cached by the first) -> decode -> rewards on text -> attribution audit of
   every sample -> train_step -> sync_weights. One metrics.jsonl row per step.
4. Checkpoints every `--checkpoint-every` steps, at the end, and on Ctrl-C/SIGTERM (the save
   itself defers signals); `--resume` continues exactly; the final policy is exported with
   `save_pretrained` to `out/final_model`.
5. `--env calculator` (app/calculator.py): multi-turn episodes instead of single
   completions: 3-digit multiplication with a calculator tool the policy calls in writing;
   the warm start teaches the tool format on both turns, rewards come from the
   environment, every sampled token of every turn is audited.
6. `--mesh trainer=T,engine=E` (app/mesh_layout.py): the trainer (FSDP) and the engine
   (tensor parallel) on disjoint device sets; each sync reshards the trainer's params into
   the engine's layout (bytes moved and seconds per sync in metrics.jsonl and the summary).

Files in `out`: run.json (options, written first), metrics.jsonl, completions.jsonl (every
sample of every step, unless --no-completions-log), checkpoints/,
base_model/, sft_model/, final_model/, demo.png. A directory holding a run is refused
unless --resume or --overwrite.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import pathlib
import signal
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from tqdm import tqdm

from jaxrl_cache.app.calculator import CalculatorEnv, CalculatorTask, parse_call, tool_sft_pairs
from jaxrl_cache.app.mesh_layout import MeshLayout
from jaxrl_cache.app.options import (ENVS, MAX_CHUNK_STEPS, MAX_COUNT, MAX_SEED,  # noqa: F401
                                      RESUMABLE, DemoOptions, resume_differences,
                                      train_config)
from jaxrl_cache.app.run_dir import PLOT, RUN_FILE, RunDir
from jaxrl_cache.app.tasks import CopyDigits, DatasetTask, Reward, char_tokenizer
from jaxrl_cache.interrupts import deferred_signals
from jaxrl_cache.models import (ModelConfig, from_pretrained, load_tokenizer, lora,
                                save_peft_adapter, save_pretrained)
from jaxrl_cache.models.families import family_of
from jaxrl_cache.models.hf import config_from_hf
from jaxrl_cache.models.hf_config import read_json
from jaxrl_cache.models.hub import resolve_model
from jaxrl_cache.rl.batch import advantages_for
from jaxrl_cache.rl.evaluate import evaluate as evaluate_policy
from jaxrl_cache.rl.checkpoint import (latest_checkpoint_version, restore_checkpoint,
                                       save_checkpoint)
from jaxrl_cache.rl.completions import CompletionsLog, completion_rows
from jaxrl_cache.rl.sft import pack_completions, sft_step
from jaxrl_cache.rl.sinks import Sinks, make_sinks
from jaxrl_cache.rl.health import SpreadWatch
from jaxrl_cache.rl.loop import AsyncRollouts, PolicyHistory, SyncRollouts, grpo_step
from jaxrl_cache.rl.memory import (available_bytes, check_memory, estimate_step_bytes,
                                    trim_after_compiles, trim_host_memory)
from jaxrl_cache.rl.rewards import RewardFn, Rewards, load_reward
from jaxrl_cache.rl.train import TrainState, make_optimizer
from jaxrl_cache.rl.train_config import TrainConfig
from jaxrl_cache.rollout import CacheConfig, RolloutEngine, SamplingParams, SchedulerConfig
from jaxrl_cache.rollout.scheduler import pages_for
from jaxrl_cache.versioning import MAX_POLICY_LAG, MAX_VERSION
from kernels_pallas import KERNELS_ENV, invariant_kernels

MIN_KV_PAGES = 64  # the smallest pool --kv-pages picks when not given (a synchronous step
# syncs a new version, so no prefix outlives it; 512 held 0.15 GiB of idle pages on SmolLM2)
HOST_BYTES_PER_TOKEN = 256  # rough host memory per token of a step's samples (token tuples,
#                             log-probs, versions, masks, the packed batch)
MAX_TURNS = 3  # --env calculator: a tool call, the answer, one spare

# DemoOptions, its checks and train_config live in app/options.py (no jax: a fast --help)
_train_config = train_config


def _optimizer(opts: DemoOptions):
    return make_optimizer(weight_decay=opts.weight_decay, max_grad_norm=opts.max_grad_norm,
                          b1=opts.adam_b1, b2=opts.adam_b2)


def _lr_schedule(opts: DemoOptions):
    lr = opts.lr or (3e-4 if opts.env else 1e-3)
    if opts.warmup_steps == 0:  # the first update at lr itself (not a step at lr 0)
        return optax.constant_schedule(lr)
    return optax.warmup_constant_schedule(0.0, lr, opts.warmup_steps)


def builtin_model_config(vocab_size: int) -> ModelConfig:
    """The demo's own policy: a ~0.2M-parameter Qwen2-style decoder (qkv bias) with its own
    LM head. Not tied: while the warm start predicts digits at their base rate (before it
    finds the copy), a tied head pulls the digits' shared embeddings together, and on some
    seeds a few collapsed for good (0, 1 and 5 at cosine 0.95 on seed 0): the policy could
    not tell them apart, and GRPO hardly separated them."""
    return ModelConfig.tiny(vocab_size=vocab_size, max_seq_len=128, tie_embeddings=False)


def _prepare(opts: DemoOptions, given=None):
    """(options, run directory, saved run record or None, task, mesh layout or None).

    A new run checks its inputs before it touches --out, then locks --out (one run per
    directory) and checks it against --overwrite. A resumed run locks --out, then reads its
    record, refuses settings in `given` that differ from its saved options (except
    RESUMABLE: --steps, --checkpoint-every, --eval-every, --report-to, --no-completions-log,
    which the command line sets), keeps the saved options for the rest, then checks the
    inputs. `given`: the names the caller set explicitly (None: every option that differs
    from its default)."""
    run, record = RunDir(opts.out), None
    if opts.resume:
        if not run.run_file.exists():
            raise ValueError(f"--resume: {run.path} holds no demo run (no {RUN_FILE})")
        run.lock()
        record = run.read_record()
        record["options"] = _upgraded(record["options"])
        given = {f.name for f in dataclasses.fields(opts) if getattr(opts, f.name) !=
                 f.default} if given is None else set(given)
        differences = resume_differences(record["options"], opts, given)
        if differences:
            raise ValueError(f"--resume: {run.path} was started with other settings: "
                             f"{'; '.join(differences)}; only --steps, --checkpoint-every, "
                             f"--eval-every, --report-to and --no-completions-log may change "
                             f"(or start over with --overwrite)")
        saved = {k: v for k, v in record["options"].items()
                 if k not in ("steps", "resume", "overwrite", "out", "report_to",
                              "completions_log")
                 and not (k in RESUMABLE and k in given)}
        try:
            opts = dataclasses.replace(opts, **saved)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{run.run_file}: the saved options are not valid ({e})") from None
    task, layout, opts = _check_inputs(opts)
    if not opts.resume:
        run.lock()
        if run.holds_run():
            if not opts.overwrite:
                raise ValueError(f"--out {run.path} holds a previous run; pass --resume to "
                                 f"continue it or --overwrite to replace it")
            run.clear()
    return opts, run, record, task, layout


def _upgraded(options) -> dict:
    """A run record's options in today's names: --task is now --dataset; a task run from
    before --answer-check scored exact matches, and one with --reward scored the answer too
    (the answer reward now joins --reward functions only with --answer-check)."""
    if not isinstance(options, dict) or "task" not in options:
        return options
    options = dict(options, dataset=options["task"])
    del options["task"]
    if options["dataset"] and "answer_check" not in options:
        options["answer_check"] = "exact"
    elif options["dataset"] and options.get("rewards") and options["answer_check"] is None:
        options["answer_check"] = "numeric"
    return options


def _check_inputs(opts: DemoOptions):
    """(task, mesh layout or None), once everything the run reads first is checked: the
    mesh against the devices, the task file, the --model directory's config and tokenizer,
    every task prompt (with the generation budget) against the model's max_seq_len, and
    the job the flags describe (`_check_job`). A task without answers has no warm start."""
    layout = None if opts.mesh is None else MeshLayout.parse(opts.mesh)
    if layout is not None:
        layout.check_devices(jax.device_count())
    task = _make_task(opts)
    if not task.has_answers:
        if opts.sft_steps:
            raise ValueError(f"--sft-steps {opts.sft_steps}: the warm start trains on "
                             f"reference answers; --dataset {opts.dataset} has no "
                             f"{opts.answer_key!r} column")
        if opts.eval_every:
            raise ValueError(f"--eval-every {opts.eval_every}: evaluation scores answers; "
                             f"--dataset {opts.dataset} has no {opts.answer_key!r} column")
        opts = dataclasses.replace(opts, sft_steps=0)
    if opts.model is None:
        tokenizer, model = char_tokenizer(), "the built-in model"
        config = builtin_model_config(tokenizer.vocab_size)
    else:
        model_dir = resolve_model(opts.model)  # a local directory, or a Hub id's snapshot
        config_file = model_dir / "config.json"
        config = config_from_hf(read_json(config_file), source=str(config_file))
        tokenizer, model = load_tokenizer(model_dir), f"--model {opts.model}"
    row = _longest_sample(opts, task, tokenizer, config.max_seq_len, model)
    opts = dataclasses.replace(opts, kv_pages=_job_kv_pages(opts, config, row))
    _check_job(opts, config, row, layout)
    return task, layout, opts


def _job_kv_pages(opts: DemoOptions, config: ModelConfig, row: int) -> int:
    """--kv-pages when given, else a pool for the job: every sample of its largest call (a
    rollout call's prompts x --group-size, or the eval) at its longest (`row` tokens), plus
    the null page, and at least MIN_KV_PAGES (room for the prefixes the cache keeps); shrunk
    to half the available memory when that holds less (at least one sample: a call queues
    the samples that do not fit)."""
    if opts.kv_pages is not None:
        return opts.kv_pages
    per_sample = pages_for(row - 1, opts.page_size)
    samples = max(opts.prompts_per_step // opts.rollout_calls * opts.group_size,
                  opts.eval_prompts * opts.eval_k)
    pages = max(MIN_KV_PAGES, samples * per_sample + 1)
    have = available_bytes()
    if have is not None:
        pages = min(pages, max(per_sample + 1,
                               int(have // 2 // _pool_bytes(config, 1, opts.page_size))))
    return min(pages, MAX_COUNT)


def _pool_bytes(config: ModelConfig, pages: int, page_size: int) -> int:
    """Bytes of a KV pool of `pages` pages of `page_size` tokens (shapes only, nothing
    allocated)."""
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(jax.eval_shape(
        lambda: family_of(config).decoder.init_kv_cache(config, pages, page_size))))


def _longest_sample(opts: DemoOptions, task, tokenizer, limit: int, model: str) -> int:
    """Tokens of the longest sample the job can make (prompt + --max-new-tokens; --env: an
    episode, up to max_seq_len); ValueError naming the prompt or flag that passes `limit`."""
    max_new = _max_new_tokens(opts, task)
    if opts.env is not None:
        if max_new >= limit:
            raise ValueError(f"--max-new-tokens {max_new} leaves no room for the episode's "
                             f"context within the max_seq_len {limit} of {model}")
        return limit
    examples = task.examples if opts.dataset is not None else task.sample(
        np.random.default_rng(opts.seed), 64)
    lengths = [len(p) for p in _encode_prompts(tokenizer, [e.prompt for e in examples],
                                               opts.chat_template_kwargs)]
    bad = next((i for i, n in enumerate(lengths) if n + max_new > limit), None)
    if bad is not None:
        where = task.where(bad) if opts.dataset is not None else "--max-new-tokens"
        raise ValueError(f"{where}: the prompt is {lengths[bad]} tokens; with {max_new} "
                         f"new tokens it exceeds the max_seq_len {limit} of {model}")
    return max(lengths) + max_new


def _check_job(opts: DemoOptions, config: ModelConfig, row: int, layout) -> None:
    """The flags against the job they describe, before any work (ValueError, one line):
    versions and the policy lag within their bounds, one sample of `row` tokens within the
    KV pool and a training micro-batch, the pool, a train step, the warm start's batch and
    a step's samples within memory, the mesh over the model and the step's samples."""
    train = _train_config(opts, async_rollouts=opts.async_rollouts)
    if opts.steps * train.updates > MAX_VERSION:
        raise ValueError(f"--steps {opts.steps} x {train.updates} updates per step passes the "
                         f"largest policy version {MAX_VERSION}")
    if opts.async_rollouts and opts.max_policy_lag * train.updates > MAX_POLICY_LAG:
        raise ValueError(f"--max-policy-lag {opts.max_policy_lag} x {train.updates} updates "
                         f"per step (--mini-batches) is a lag of more than {MAX_POLICY_LAG} "
                         f"versions, the engine's bound")
    need = pages_for(row - 1, opts.page_size)  # KV of every token but the last
    if need > opts.kv_pages - 1:  # page 0 is the null page
        what = "an episode (up to max_seq_len)" if opts.env else \
            "the longest prompt + --max-new-tokens"
        raise ValueError(f"--kv-pages {opts.kv_pages} cannot hold one sample: {what}, {row} "
                         f"tokens, needs {need} KV pages of {opts.page_size} tokens; use "
                         f"--kv-pages {need + 1} or more")
    if train.token_budget < row:
        raise ValueError(f"--token-budget {train.token_budget} cannot hold one sample of "
                         f"{row} tokens in a training micro-batch; use --token-budget {row} "
                         f"or more")
    _check_memory(opts, config, train, row)
    if opts.kl_beta > 0 and layout is not None:
        raise ValueError("--kl-beta with --mesh: the reference policy is not placed on the "
                         "trainer's devices; run it on one device")
    if layout is not None:
        state = jax.eval_shape(lambda: TrainState.create(
            family_of(config).decoder.init_params(config, jax.random.key(0)),
            _optimizer(opts), config=config,
            lr_schedule=_lr_schedule(opts)))
        layout.build(config, state, opts.prompts_per_step * opts.group_size)
    if opts.backend == "pallas" and jax.default_backend() != "gpu":
        raise ValueError(f"--backend pallas runs Triton kernels on a GPU; this machine runs "
                         f"{jax.default_backend()}: use auto, xla or interpret")
    kernels = invariant_kernels()  # --kernels, or the environment's (run_demo set it)
    if kernels == "pallas" and jax.default_backend() != "gpu":
        raise ValueError(f"--kernels pallas runs Triton kernels on a GPU ({KERNELS_ENV}="
                         f"pallas); this machine runs {jax.default_backend()}: use xla or "
                         f"interpret")
    if kernels is not None and config.head_dim % 16:
        raise ValueError(f"the batch-invariant kernels ({KERNELS_ENV}={kernels}) need a "
                         f"head_dim that is a multiple of 16; this model's is "
                         f"{config.head_dim}: use xla")


def _check_memory(opts: DemoOptions, config: ModelConfig, train: TrainConfig,
                  row: int) -> None:
    """The KV pool, a train step (TrainMemoryError), the warm start's batch and a step's
    (or the eval's) samples against the memory available (unknown: no check)."""
    check_memory(config, train, lora=opts.lora_config())
    have = available_bytes()
    if have is None:
        return
    pool = _pool_bytes(config, opts.kv_pages, opts.page_size)
    one = estimate_step_bytes(config, dataclasses.replace(train, token_budget=row), row)
    sft = one["state"] + opts.sft_batch * one["activations"] if _sft_steps(opts) else 0
    samples = max(opts.prompts_per_step * opts.group_size, opts.eval_prompts * opts.eval_k)
    for what, need in ((f"--kv-pages {opts.kv_pages}: a KV pool", pool),
                       (f"--sft-batch {opts.sft_batch}: a warm-start step", sft),
                       (f"{samples} samples (--prompts-per-step x --group-size, "
                        f"--eval-prompts)", samples * row * HOST_BYTES_PER_TOKEN)):
        if need > have:
            raise ValueError(f"{what} of {need / 2**30:.1f} GiB does not fit the "
                             f"{have / 2**30:.1f} GiB available")


def _max_new_tokens(opts: DemoOptions, task) -> int:
    """A turn's budget with --env: a tool call of two 3-digit operands or a 6-digit answer."""
    if opts.max_new_tokens:
        return opts.max_new_tokens
    return 12 if opts.env else (task.num_digits + 1 if opts.dataset is None else 64)


def _make_task(opts: DemoOptions):
    if opts.env == "calculator":
        return CalculatorTask()
    if opts.dataset is None:
        return CopyDigits()
    return DatasetTask(opts.dataset, Reward(opts.answer_regex, opts.answer_check or "numeric"),
                       prompt_key=opts.prompt_key, answer_key=opts.answer_key,
                       system_prompt=opts.system_prompt, split=opts.split,
                       config=opts.dataset_config, answers_required=opts.answer_in_rewards)


def _encode_prompts(tokenizer, prompts: list, template_kwargs: dict | None) -> list[list[int]]:
    """Plain text, or the model's chat template (one user message) when it has one, rendered
    with `template_kwargs` (--chat-template-kwargs); chat messages (a task's chat prompts,
    --system-prompt) and template kwargs need the template."""
    if tokenizer.chat_template is None:
        if template_kwargs:
            raise ValueError("--chat-template-kwargs needs a model with a chat template; "
                             "this one has none")
        if not all(isinstance(p, str) for p in prompts):
            raise ValueError("chat-format prompts (lists of messages, or --system-prompt) "
                             "need a model with a chat template; this one has none")
        return [tokenizer.encode(p) for p in prompts]
    return [tokenizer.apply_chat_template([{"role": "user", "content": p}]
                                          if isinstance(p, str) else list(p),
                                          **(template_kwargs or {}))
            for p in prompts]


def _warm_start(opts: DemoOptions, run: RunDir, task, base: pathlib.Path) -> pathlib.Path:
    """SFT of the HF model at `base` on reference answers; saved to out/sft_model."""
    config, params = from_pretrained(base)
    tokenizer = load_tokenizer(base)
    tx = optax.adam(opts.sft_lr or (5e-3 if opts.env else 2e-3))
    opt_state = tx.init(params)
    rng = np.random.default_rng([opts.seed, 1])
    stop = tokenizer.stop_token_ids[:1]
    smoothed, steps = None, 0
    bar = tqdm(range(opts.sft_steps), desc="SFT warm start", unit="step", dynamic_ncols=True,
               leave=False)
    stop_loss = opts.sft_stop_loss or (0.2 if opts.env else 0.5)
    for steps in bar:
        if opts.env:  # both turns of each episode (tool call, then the answer)
            prompts, answers = tool_sft_pairs(task.sample(rng, opts.sft_batch // 2), tokenizer)
        else:
            examples = task.sample(rng, opts.sft_batch)
            prompts = _encode_prompts(tokenizer, [e.prompt for e in examples],
                                      opts.chat_template_kwargs)
            answers = [tokenizer.encode(e.answer, add_special_tokens=False) + list(stop)
                       for e in examples]
        tokens, mask = pack_completions(prompts, answers)
        params, opt_state, loss = sft_step(params, opt_state, jnp.asarray(tokens),
                                           jnp.asarray(mask), config=config, tx=tx)
        smoothed = float(loss) if smoothed is None else 0.8 * smoothed + 0.2 * float(loss)
        bar.set_postfix(loss=f"{smoothed:.3f}", refresh=False)
        if smoothed < stop_loss:
            break
    bar.close()
    tqdm.write(f"SFT warm start: stopped after {steps + 1} steps at token loss {smoothed:.3f} "
               f"(target {stop_loss})")
    return save_pretrained(run.path / "sft_model", config, params, tokenizer=tokenizer)


def _initial_policy(opts: DemoOptions, run: RunDir, task) -> pathlib.Path:
    """The HF directory RL starts from (built-in model written first if no --model)."""
    if opts.model is not None:
        base = resolve_model(opts.model)
    else:
        tokenizer = char_tokenizer()
        config = builtin_model_config(tokenizer.vocab_size)
        params = family_of(config).decoder.init_params(config, jax.random.key(opts.seed))
        base = save_pretrained(run.path / "base_model", config, params, tokenizer=tokenizer)
    sft_steps = _sft_steps(opts)
    return _warm_start(dataclasses.replace(opts, sft_steps=sft_steps), run, task, base) \
        if sft_steps else base


def _sft_steps(opts: DemoOptions) -> int:
    """The warm start's step limit: --sft-steps, else 600 for the built-in model, 0 with
    --model."""
    if opts.sft_steps is not None:
        return opts.sft_steps
    return 0 if opts.model is not None else (400 if opts.env else 600)


class _Stop:
    """SIGINT/SIGTERM: finish the current step, save, exit. A second SIGINT aborts at once
    (the last checkpoint stays; a save in progress completes first: it defers signals)."""

    def __init__(self):
        self.requested = None

    def __call__(self, signum, frame):
        if self.requested is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.requested = signal.Signals(signum).name
        tqdm.write(f"{self.requested}: finishing the current step, then saving "
                   f"(Ctrl-C again to abort)")


def _evaluate(engine, state, tokenizer, task, opts, sampling, key) -> dict:
    """rl.evaluate's metrics on `eval_prompts` fixed prompts (`task.eval_examples`: a task
    file's held-out part): --eval-k samples (--env: episodes) each, exact match (the
    environment's reward of 1 with --env), and a greedy completion each with --eval-greedy."""
    examples = task.eval_examples(np.random.default_rng([opts.seed, 2]), opts.eval_prompts)
    if opts.env:
        prompts, episodes = examples, dict(env_factory=CalculatorEnv, max_turns=MAX_TURNS)

        def correct(i, episode, text) -> bool:
            return episode.reward == 1.0
    else:
        prompts = _encode_prompts(tokenizer, [e.prompt for e in examples],
                                  opts.chat_template_kwargs)
        episodes = None

        def correct(i, sample, text) -> bool:
            return task.reward(text, examples[i].answer) == 1.0
    return evaluate_policy(engine, state.model_params, int(state.version), prompts, correct,
                           sampling, rng=key, k=opts.eval_k, greedy=opts.eval_greedy,
                           decode=tokenizer.decode, episodes=episodes)


def _plot(rows: list[dict], path: pathlib.Path, title: str, start_exact: float | None,
          start_label: str) -> None:
    try:  # optional: the `plot` extra
        import matplotlib
    except ImportError:
        tqdm.write(f"matplotlib is not installed: no {path.name} (pip install "
                   f"'jaxrl-cache[plot]'); metrics.jsonl holds every step")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    steps = [r["step"] for r in rows]
    fig, axes = plt.subplots(4, 1, figsize=(7, 8.5), sharex=True)
    ax = axes[0]
    ax.plot(steps, [r["reward"] for r in rows], label="mean reward", alpha=0.8)
    if start_exact is not None:  # a task with answers
        ax.plot(steps, [r["exact_match"] for r in rows], label="exact match", alpha=0.8)
        ax.axhline(start_exact, color="gray", ls="--", lw=1, label=f"{start_label} (eval)")
    ax.set_ylim(-0.02, 1.02)
    ax.legend(loc="lower right", fontsize=8)
    for ax, key, label in zip(axes[1:], ("cache_hit_rate", "staleness_max", "version"),
                              ("prefix cache hit rate", "staleness (max)", "policy version")):
        ax.plot(steps, [r[key] for r in rows])
        ax.set_ylabel(label)
        if key == "cache_hit_rate":
            ax.set_ylim(-0.02, 1.02)
    for ax in axes:
        ax.grid(alpha=0.3)
    axes[-1].set_xlabel("GRPO step")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def run_demo(opts: DemoOptions, *, given=None) -> dict:
    """Runs (or resumes) the demo; returns the summary. See the module doc. given: the
    option names the caller set explicitly (the CLI: flags and --config); a --resume refuses
    those that differ from the run's (None: the options that differ from their defaults)."""
    t_start = time.perf_counter()
    trim_after_compiles()  # the peak of a step that compiles: its run, not compile + run
    with _kernels(opts.kernels):  # before anything traces
        opts, run, record, task, layout = _prepare(opts, given)
        return _run_prepared(opts, run, record, task, layout, t_start)


@contextlib.contextmanager
def _kernels(choice: str | None):
    """JAXRL_CACHE_KERNELS set to `choice` for the run (None: left as it is), restored after:
    every program of the run (engine, warm start, train steps, audit) traces under it."""
    if choice is None:
        yield
        return
    before = os.environ.get(KERNELS_ENV)
    os.environ[KERNELS_ENV] = choice
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(KERNELS_ENV, None)
        else:
            os.environ[KERNELS_ENV] = before


def _engine_config(config: ModelConfig, train: TrainConfig, opts: DemoOptions) -> ModelConfig:
    """The engine's model config: the trainer's, sampling in the train step's compute dtype
    where that is narrower (--compute-dtype bfloat16: the engine holds the bf16 cast of the
    fp32 params, so the step's forward reproduces its log-probs bit for bit). LoRA keeps the
    engine in the base's dtype (the base is lent to it as it is)."""
    narrower = np.dtype(train.compute_dtype).itemsize < np.dtype(config.dtype).itemsize
    if not narrower or opts.lora_rank:
        return config
    return dataclasses.replace(config, dtype=train.compute_dtype)


def _run_prepared(opts: DemoOptions, run: RunDir, record: dict | None, task, layout,
                  t_start: float) -> dict:
    """run_demo after its checks: warm start, GRPO, export, summary."""
    loaded = _load_policy(opts, run, record, task, layout)
    train = _train_config(opts, async_rollouts=opts.async_rollouts)
    lag = opts.max_policy_lag * train.updates if opts.async_rollouts else 0  # in versions
    placement = loaded.placement
    engine = RolloutEngine(_engine_config(loaded.config, train, opts),
                           CacheConfig(num_pages=opts.kv_pages, page_size=opts.page_size),
                           scheduler_config=SchedulerConfig(chunk_steps=opts.chunk_steps),
                           backend=opts.backend, version=loaded.start_version,
                           kv_policy=opts.kv_policy if opts.async_rollouts else "wait",
                           max_policy_lag=lag, tokenizer=loaded.tokenizer,
                           **({} if placement is None else placement.engine_kwargs()))
    seed_key = jax.random.key(opts.seed)
    record = loaded.record

    def evaluate_state(state) -> dict:  # the same prompts and key every time
        return _evaluate(engine, state, loaded.tokenizer, task, opts, loaded.sampling,
                         jax.random.fold_in(seed_key, 2**30))

    evaluate = evaluate_state if task.has_answers else None  # no answers: nothing to score
    if evaluate is None:
        record.setdefault("sft_exact_match", None)
    elif "sft_exact_match" not in record:
        record["sft_exact_match"] = evaluate(loaded.state)["exact_match"]
        run.write_record(record)
    if evaluate is not None:
        tqdm.write(f"exact match before GRPO (eval, {opts.eval_prompts} prompts): "
                   f"{record['sft_exact_match']:.3f}")
    engine.release_weights(drop_kv=True)  # the eval's copy: the loop lends the trainer's
    start_step = _steps_at(opts, loaded.start_version)
    source = _prompt_source(opts, task, loaded.tokenizer)
    rollouts = _rollouts(opts, engine, source, loaded.sampling, lag, seed_key, loaded.state,
                         start_step)
    state, rows, stop, buffer_metrics = _grpo_loop(
        opts, run, source, loaded, rollouts, PolicyHistory(lag), train, start_step,
        evaluate=evaluate)
    # checkpointed: the eval and the export need the params alone (the peak of a run's end)
    state, loaded.ref_params = state.replace(opt_state=None), None
    trim_host_memory()
    rl_exact = None if stop.requested or evaluate is None else evaluate(state)["exact_match"]
    engine.release_weights(drop_kv=True)
    trim_host_memory()
    exported = _export(run, loaded, state)
    warm_started = _sft_steps(opts) > 0
    title = f"jaxrl_cache demo: {'SFT -> ' if warm_started else ''}GRPO on {task.name}"
    if rows:
        _plot(rows, run.path / PLOT, title, record["sft_exact_match"],
              "after SFT" if warm_started else "before GRPO")
    return _summary(opts, task, loaded, rows, start_step, state, record, rl_exact,
                    warm_started, train, buffer_metrics, run, exported, stop,
                    time.perf_counter() - t_start)


def _export(run: RunDir, loaded, state: TrainState) -> pathlib.Path:
    """The final policy as an HF directory (LoRA: the adapters merged into the base, and
    the adapters alone as a PEFT directory, final_adapter/, beside it)."""
    if state.lora is None:
        return save_pretrained(run.path / "final_model", loaded.config, state.params,
                               tokenizer=loaded.tokenizer)
    save_peft_adapter(run.path / "final_adapter", loaded.config, state,
                      base_model_name_or_path=str(loaded.policy))
    return save_pretrained(run.path / "final_model", loaded.config,
                           lora.merged(state.model_params), tokenizer=loaded.tokenizer)


@dataclasses.dataclass
class _Loaded:
    """What a run starts GRPO from: its record, the policy and how it is placed."""
    record: dict
    policy: pathlib.Path
    config: ModelConfig
    tokenizer: object
    sampling: SamplingParams
    state: TrainState
    placement: object  # app.mesh_layout's placement, or None (one device)
    devices: str
    start_version: int
    rows: list  # the metrics rows of the steps run before (a resumed run)
    ref_params: object = None  # --kl-beta > 0: the policy GRPO started from (a copy)


def _steps_at(opts: DemoOptions, version: int) -> int:
    """The GRPO steps a checkpoint at `version` holds: every step makes exactly
    epochs x mini-batches updates (the version counts updates, the metrics rows count steps)."""
    updates = _train_config(opts, async_rollouts=opts.async_rollouts).updates
    steps, rest = divmod(version, updates)
    if rest:
        raise ValueError(f"the checkpoint at version {version} is not a whole number of steps "
                         f"of {updates} updates each; it was not written by this run")
    return steps


def _load_policy(opts: DemoOptions, run: RunDir, record: dict | None, task,
                 layout) -> _Loaded:
    """A fresh run: its record, the initial policy (warm start) and checkpoint 0; a resumed
    one: its record, checkpoint and rows. A fresh run that fails here leaves nothing."""
    start_version = None if record is None else latest_checkpoint_version(run.checkpoints)
    fresh = start_version is None  # a new run (or one killed before its first checkpoint)
    try:
        if fresh:
            run.clear()
            record = dict(options=dataclasses.asdict(opts))
            run.write_record(record)
            run.metrics.touch()
            policy = _initial_policy(opts, run, task)
            record = dict(record, policy=str(policy))
            run.write_record(record)
        policy = pathlib.Path(record["policy"])
        config, params = from_pretrained(policy)
        lora_config = opts.lora_config()
        ref_params = None if opts.kl_beta == 0 else params if lora_config else \
            jax.tree.map(jnp.copy, params)  # full fine-tuning may donate the state's arrays;
        #   LoRA's base is frozen (never donated), so it is the reference as it is
        tokenizer = load_tokenizer(policy)
        sampling = SamplingParams(n=opts.group_size, max_new_tokens=_max_new_tokens(opts, task),
                                  temperature=opts.temperature, top_p=opts.top_p,
                                  top_k=opts.top_k, min_p=opts.min_p,
                                  repetition_penalty=opts.repetition_penalty, stop=opts.stop,
                                  include_stop_str_in_output=opts.include_stop_str_in_output,
                                  stop_token_ids=tokenizer.stop_token_ids)
        state = TrainState.create(params, _optimizer(opts), config=config,
                                  lr_schedule=_lr_schedule(opts), lora=lora_config,
                                  rng=jax.random.key(opts.seed))
        placement = None if layout is None else layout.build(
            config, state, opts.prompts_per_step * opts.group_size)
        if placement is not None:  # restore_checkpoint reads into the template's layout
            state = placement.place_state(state)
        devices = f"one ({jax.devices()[0]})" if placement is None else placement.describe()
        tqdm.write(f"devices: {devices}")
        if fresh:
            save_checkpoint(run.checkpoints, state)
            rows, start_version = [], 0
        else:
            state = restore_checkpoint(run.checkpoints, state)
            start_version = int(state.version)
            rows = run.read_rows(_steps_at(opts, start_version))
            tqdm.write(f"resumed {run.path} at version {start_version}")
    except BaseException:
        if fresh:  # nothing to resume yet: leave no run behind, so the command can run again
            run.clear()
        raise
    return _Loaded(record, policy, config, tokenizer, sampling, state, placement, devices,
                   start_version, rows, ref_params)


@dataclasses.dataclass(frozen=True)
class _PromptSource:
    prompts_of: Callable  # call -> (prompts, examples)
    reward: Rewards | None  # the answer reward and --reward's; None: episode returns
    exact: Callable | None  # (examples, sample, text) -> bool; None: the task has no answers
    episodes: dict | None  # rollout_episodes keyword arguments (--env)
    prompt: Callable  # (examples, sample) -> its prompt as the task gave it (completions.jsonl)


def _prompt_source(opts: DemoOptions, task, tokenizer) -> _PromptSource:
    """The call-th rollout call's prompts (--env: the examples are the tasks) and examples
    (step call // rollout_calls), and how a completion is scored (the rewards: see
    DemoOptions.answer_in_rewards)."""
    per_call = opts.prompts_per_step // opts.rollout_calls

    def prompts_of(call: int):
        step, part = divmod(call, opts.rollout_calls)
        examples = task.sample(np.random.default_rng([opts.seed, 0, step]),
                               opts.prompts_per_step)[part * per_call:(part + 1) * per_call]
        if opts.env:
            return examples, examples
        return _encode_prompts(tokenizer, [e.prompt for e in examples],
                               opts.chat_template_kwargs), examples

    def answer(examples, sample, text: str) -> float | None:
        return task.reward(text, examples[sample.group].answer)

    def exact(examples, sample, text: str) -> bool:
        if opts.env:  # an Episode: the environment's reward
            return sample.reward == 1.0
        return task.reward(text, examples[sample.group].answer) == 1.0

    def columns(examples, sample) -> dict:  # --reward functions' keywords, as TRL's
        e = examples[sample.group]
        return {**(getattr(e, "row", None) or {"answer": e.answer}), "prompt": e.prompt}

    episodes = dict(env_factory=CalculatorEnv, max_turns=MAX_TURNS) if opts.env else None
    answers = [RewardFn(answer, name="answer")] if opts.answer_in_rewards else []
    rewards = None if opts.env else Rewards(
        (*answers, *map(load_reward, opts.rewards)), columns=columns, max_steps=opts.steps)
    return _PromptSource(prompts_of, rewards, exact if task.has_answers else None, episodes,
                         prompt=lambda examples, sample: examples[sample.group].prompt)


def _rollouts(opts: DemoOptions, engine, source: _PromptSource, sampling, lag: int, seed_key,
              state, start_step: int):
    """SyncRollouts, or AsyncRollouts (--async) continuing the run's sequence of calls."""
    if opts.async_rollouts:
        return AsyncRollouts(engine, source.prompts_of, sampling, calls=opts.rollout_calls,
                             max_policy_lag=lag, key=jax.random.fold_in(seed_key, 2**31 - 1),
                             state=state, first_call=start_step * opts.rollout_calls,
                             episodes=source.episodes,
                             borrow=True)  # its trainer never donates the params (train_config)
    return SyncRollouts(engine, source.prompts_of, sampling, calls=opts.rollout_calls,
                        key=seed_key, episodes=source.episodes)


def _grpo_loop(opts: DemoOptions, run: RunDir, source: _PromptSource, loaded: _Loaded,
               rollouts, history: PolicyHistory, train: TrainConfig, start_step: int, *,
               evaluate: Callable | None = None):
    """GRPO steps until --steps or a stop signal: each step's row appended with its state,
    checkpoints every --checkpoint-every steps and a final one (even under a second
    Ctrl-C); every --eval-every steps, evaluate(state)'s metrics join the row as "eval/...".
    Returns (state, rows, the stop flag, the rollouts' closing metrics)."""
    state, rows, placement = loaded.state, loaded.rows, loaded.placement
    loaded.state = None  # the loop's `state` alone holds it: a step frees what it replaced
    stop = _Stop()
    handlers = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    buffer_metrics = {}
    saved_version = loaded.start_version
    bar = tqdm(range(start_step, opts.steps), initial=start_step, total=opts.steps,
               desc="GRPO", unit="step", dynamic_ncols=True)
    sinks, watch = Sinks([]), SpreadWatch(warn=False)  # --report-to; the no-spread log line
    # cut to the checkpoint's steps even when off now (a later run may turn it on again)
    completions = CompletionsLog(run.completions, start_step=start_step) \
        if opts.completions_log or run.completions.exists() else None
    try:
        sinks = make_sinks(opts.report_to, run.path, start_step=start_step,
                           config=dataclasses.asdict(opts))
        for step in bar:
            try:
                result = grpo_step(step, state, rollouts, source.reward,
                                   decode=loaded.tokenizer.decode, history=history,
                                   train=train, ref_params=loaded.ref_params,
                                   advantages=advantages_for(opts.scale_rewards),
                                   mesh=None if placement is None else placement.trainer)
            except Exception as e:  # the step may have donated `state`: keep its intact copy
                state = _intact_state(e, state)
                raise
            row = _step_row(opts, result, source, placement)
            if evaluate is not None and opts.eval_every and (step + 1) % opts.eval_every == 0:
                row.update({f"eval/{k}": v for k, v in evaluate(result.state).items()})
                bar.write(f"step {step:4d} eval: " + ", ".join(
                    f"{k} {v:.3f}" for k, v in row.items() if k.startswith("eval/")))
            with deferred_signals():  # the state and its metrics row move together
                run.append_row(row)
                if opts.completions_log:
                    completions.write(completion_rows(result, source.prompt))
                rows.append(row)
                state = result.state
            sinks.write(step, row)  # each step as it completes (flushed)
            if (note := watch.update(row)) is not None:
                bar.write(note)
            bar.set_postfix(v=int(state.version), reward=f"{row['reward']:.2f}",
                            exact=f"{row.get('exact_match', math.nan):.2f}",
                            hit=f"{row['cache_hit_rate']:.2f}", refresh=False)
            if step % 20 == 0 or step == opts.steps - 1:
                _say_step(step, row)
            if (step + 1) % opts.checkpoint_every == 0:
                with deferred_signals():
                    save_checkpoint(run.checkpoints, state)
                saved_version = int(state.version)
            if stop.requested:
                bar.write(f"{stop.requested}: stopping after step {step}")
                break
    finally:
        bar.close()
        sinks.close()  # never raises
        buffer_metrics = rollouts.close()
        try:
            with deferred_signals():  # the final save completes even under a second Ctrl-C
                if int(state.version) != saved_version:
                    save_checkpoint(run.checkpoints, state)
        finally:  # after the section: it reinstalls the handlers it found on entry
            for sig, handler in handlers.items():
                signal.signal(sig, handler)
    return state, rows, stop, buffer_metrics


def _intact_state(error: BaseException, state):
    """The state to save after a failed step: the unchanged input a refused update carries
    (NonFiniteUpdate / AttributionFailure `.state`, also when grpo_step re-raised it as the
    audit's RuntimeError), else `state` (no update was attempted, nothing donated)."""
    for e in (error, error.__context__):
        if e is not None and getattr(e, "state", None) is not None:
            return e.state
    return state


def _step_row(opts: DemoOptions, result, source: _PromptSource, placement) -> dict:
    """A step's metrics row: grpo_step's record, exact match, the bytes synced and one
    sample (the first)."""
    examples, sample, completion = result.texts[0]
    example = examples[sample.group]
    sync_bytes = (result.record["sync_bytes"] if placement is None
                  else placement.sync_bytes(result.state.params))
    row = dict(result.record, sync_bytes=sync_bytes,
               sample=dict(prompt=example.prompt, completion=completion, answer=example.answer))
    if source.exact is not None:
        row["exact_match"] = float(np.mean([source.exact(m, s, t) for m, s, t in result.texts]))
    if opts.env:  # episodes whose turns include a well-formed tool call
        row["tool_use"] = float(np.mean([any(parse_call(t) for t in s.turn_texts)
                                         for _, s, _ in result.texts]))
    return row


def _say_step(step: int, row: dict) -> None:
    sample, sync_bytes = row["sample"], row["sync_bytes"]
    moved = (f"copied {sync_bytes / 2**20:.1f} MiB" if sync_bytes else
             "lent the params (nothing copied)")
    if row.get("transposed_bytes"):
        moved += f", wrote {row['transposed_bytes'] / 2**20:.1f} MiB of decode transposes"
    prompt = sample["prompt"] if isinstance(sample["prompt"], str) else \
        sample["prompt"][-1]["content"]  # chat messages: the last one
    answer = "" if sample["answer"] is None else f" (answer {sample['answer']!r})"
    tqdm.write(f"step {step:4d}  {prompt[-24:]!r} -> {sample['completion']!r}{answer}; "
               f"sync {moved} in {row['sync_seconds']:.2f} s")


def _summary(opts: DemoOptions, task, loaded: _Loaded, rows: list, start_step: int, state,
             record: dict, rl_exact, warm_started: bool, train: TrainConfig,
             buffer_metrics: dict, run: RunDir, exported, stop, seconds: float) -> dict:
    """The run's summary (the CLI prints it)."""
    totals = {k: sum(r.get(k, 0) for r in rows) for k in (
        "generated_tokens", "prompt_tokens", "cached_tokens", "reused_tokens", "audited_samples",
        "audit_failed", "mixed_tokens", "recomputed_tokens")}
    window = max(1, min(10, len(rows) // 4))
    mean = lambda key, part: float(np.mean([r[key] for r in part])) if part else 0.0  # noqa
    syncs = [r for r in rows if "sync_seconds" in r]  # rows of runs before --mesh lack them
    return dict(
        task=task.name, policy=str(loaded.policy), steps_run=len(rows) - start_step,
        final_version=int(state.version), reward_first=mean("reward", rows[:window]),
        reward_last=mean("reward", rows[-window:]),
        exact_first=mean("exact_match", rows[:window]) if task.has_answers else None,
        exact_last=mean("exact_match", rows[-window:]) if task.has_answers else None,
        tool_use_first=mean("tool_use", rows[:window]) if opts.env else None,
        tool_use_last=mean("tool_use", rows[-window:]) if opts.env else None,
        sft_exact_match=record["sft_exact_match"], rl_exact_match=rl_exact,
        warm_started=warm_started,
        eval_prompts=opts.eval_prompts, generated_tokens=totals["generated_tokens"],
        prompt_tokens=totals["prompt_tokens"], prefill_tokens_saved=totals["reused_tokens"],
        radix_cached_tokens=totals["cached_tokens"],
        audited_samples=totals["audited_samples"], audit_failures=totals["audit_failed"],
        seconds=seconds, updates_per_step=train.updates,
        mode=("async/" + opts.kv_policy) if opts.async_rollouts else "sync",
        mixed_tokens=totals["mixed_tokens"], recomputed_tokens=totals["recomputed_tokens"],
        dropped_stale_calls=buffer_metrics.get("dropped_calls", 0),
        staleness_histogram=buffer_metrics.get("staleness", {}),
        devices=loaded.devices, syncs=len(syncs), sync_bytes=mean("sync_bytes", syncs),
        sync_seconds_median=float(np.median([r["sync_seconds"] for r in syncs]))
        if syncs else 0.0,
        out=str(run.path), exported=str(exported), interrupted=stop.requested is not None,
        stopped_by=stop.requested)
