"""DemoOptions: every setting of `jaxrl-cache grpo` and `jaxrl-cache demo` (the same run:
`grpo` on a --dataset, `demo` on the built-in task), checked once, in a module that imports
no jax (the CLI reads its defaults to build `--help`; the checks import what they need).

Rewards: the built-in task scores its answer; a --dataset's rewards are the --reward
functions (TRL's reward_funcs) when given, plus the answer reward when --answer-check is
given, and the answer reward alone without --reward (`answer_in_rewards`).

Which settings a `--resume` may change (`RESUMABLE`): the ones that do not change what the
run trains on or how: the step count, the checkpoint and eval cadence, where metrics go.
Any other setting given with `--resume` must equal the run's (`resume_differences`).
"""
from __future__ import annotations

import dataclasses
import pathlib

MAX_SEED = 2**32 - 1
ENVS = ("calculator",)
MAX_CHUNK_STEPS = 4096  # decode steps per chunk: a static shape ([slots, chunk_steps] outputs)
MAX_COUNT = 2**31 - 1  # every other count flag: they reach int32 shapes and jitted arguments
# --page-size: tokens per KV page. A power of two (the Pallas kernels load whole pages in
# power-of-two blocks) up to CacheConfig's largest page; 8 by default: the built-in task's
# prompts share a 9-token prefix, so one whole page of it is cached and shared.
DEFAULT_PAGE_SIZE = 8
MAX_PAGE_SIZE = 2**16
# kernels_pallas.KERNEL_CHOICES (JAXRL_CACHE_KERNELS), spelled here: this module imports no jax
KERNELS = ("xla", "pallas", "interpret")
# The smallest training temperature above 0 (greedy): the gradient of log-probs of
# logits / T scales as 1 / T and its squared norm overflows float32 below ~1e-19 (measured:
# 1e-18 trains, 1e-20 gives a NaN gradient norm); 1e-15 keeps a 1,000x margin.
MIN_TRAIN_TEMPERATURE = 1e-15
RESUMABLE = ("steps", "checkpoint_every", "eval_every", "report_to",  # may change on resume
             "completions_log")
NOT_SETTINGS = ("resume", "overwrite", "out")  # how to run, not what: never compared


@dataclasses.dataclass(frozen=True)
class DemoOptions:
    steps: int = 120  # GRPO steps (= final policy version)
    sft_steps: int | None = None  # at most; None: 600 for the built-in model, 0 with --model
    sft_stop_loss: float | None = None  # the warm start stops once its smoothed token loss
    #   is below this; None: 0.5, or 0.2 with --env calculator (the tool format needs more)
    sft_lr: float | None = None  # warm-start Adam lr; None: 2e-3, or 5e-3 with --env calculator
    sft_batch: int = 32
    group_size: int = 8
    prompts_per_step: int = 8
    rollout_calls: int = 1  # rollout calls per step (> 1: later ones hit the cached prefix;
    # decode reads every weight once per step of a call, so one call of all rows is fastest)
    max_new_tokens: int | None = None  # None: built-in task answer + <eos>; 64 with --dataset
    temperature: float = 1.0
    top_p: float = 1.0  # SamplingParams.top_p (rollouts and sampled evals)
    top_k: int = 0  # SamplingParams.top_k (0: off)
    min_p: float = 0.0  # SamplingParams.min_p (0: off)
    repetition_penalty: float = 1.0  # SamplingParams.repetition_penalty (1: off)
    stop: tuple = ()  # stop strings (SamplingParams.stop)
    include_stop_str_in_output: bool = False
    lr: float | None = None  # GRPO peak lr; None: 1e-3, or 3e-4 with --env calculator
    warmup_steps: int = 5
    weight_decay: float = 0.0  # make_optimizer's (decoupled, AdamW style)
    max_grad_norm: float = 1.0
    adam_b1: float = 0.9
    adam_b2: float = 0.99
    eval_prompts: int = 64
    eval_every: int = 0  # evaluate every N GRPO steps (0: before and after GRPO only)
    eval_k: int = 1  # samples per eval prompt (pass@k for k > 1)
    eval_greedy: bool = False  # also score one greedy completion per eval prompt
    checkpoint_every: int = 10
    kv_pages: int | None = None  # None: sized from the job (`_job_kv_pages`)
    page_size: int = DEFAULT_PAGE_SIZE  # tokens per KV page (a power of two)
    chunk_steps: int = 16  # decode steps per on-device chunk (async updates land between)
    seed: int = 0
    backend: str = "auto"
    kernels: str | None = None  # JAXRL_CACHE_KERNELS for the run (KERNELS); None: the env's
    model: str | None = None  # a local HF directory or a Hub id (models.hub.resolve_model)
    dataset: str | None = None  # a file, directory or Hub name (dataset_source.read_dataset)
    split: str | None = None  # the dataset's split (None: "train" where it has splits)
    dataset_config: str | None = None  # a Hub dataset's configuration ("main" for gsm8k)
    prompt_key: str = "prompt"  # the rows' prompt field (text or chat messages)
    answer_key: str = "answer"  # the rows' answer field (str or number; GSM8K's "#### N")
    system_prompt: str | None = None  # prepended as a system message (chat template)
    chat_template_kwargs: dict | None = None  # extra chat template variables (enable_thinking)
    env: str | None = None  # "calculator": multi-turn episodes with a tool (ENVS)
    answer_regex: str | None = None
    answer_check: str | None = None  # rl.answers.CHECKS; None: numeric with --dataset, else
    #                                  exact; given with --reward: the answer reward joins them
    rewards: tuple = ()  # --reward module:function[=weight] specs (rl.rewards.load_reward)
    out: str = "runs/demo"
    resume: bool = False
    overwrite: bool = False
    async_rollouts: bool = False  # a RolloutWorker generates while the trainer trains
    kv_policy: str = "recompute"  # async: what an update does to rows in flight
    max_policy_lag: int = 1  # async: steps a trained sample's oldest token may lag behind
    mini_batches: int = 1  # optimizer updates per step (the batch split into this many)
    epochs: int = 1  # passes over a step's batch (updates per step: mini_batches x epochs)
    token_budget: int = 4096  # tokens per training micro-batch (sets the trainer's memory)
    loss_type: str = "dapo"  # "dapo" token mean, "grpo" sequence mean, "dr_grpo"
    clip_eps: float = 0.2  # PPO clip range
    epsilon_high: float | None = None  # upper clip range (clip-higher); None: clip_eps
    scale_rewards: str | None = None  # TRL's "group" / "batch" / "none"; None: this
    #   library's group normalisation (rl.batch.group_advantages)
    mask_truncated_completions: bool = False
    importance_sampling_level: str = "token"  # or "sequence" (GSPO)
    entropy_coef: float = 0.0
    dual_clip: float | None = None
    is_cap: float = 2.0  # decoupled correction's importance-weight cap
    kl_beta: float = 0.0  # > 0: k3 KL to the policy GRPO started from
    remat: str = "auto"
    compute_dtype: str = "float32"
    logprob_chunk: int = 128
    correction: str = "none"  # train_step's off-policy correction ("none": PPO-clip
    #   against behavior; "decoupled": proximal = the params before the step's first update)
    mesh: str | None = None  # "trainer=T,engine=E" (see MeshLayout); None: one device
    lora_rank: int = 0  # > 0: train LoRA adapters of this rank over the frozen model
    lora_alpha: float = 8.0  # LoRA scale = alpha / rank (PEFT's default alpha)
    lora_targets: tuple = ()  # PEFT module names or "all-linear"; (): q_proj, v_proj
    report_to: str | None = None  # metrics sinks, "tensorboard,csv" (rl.sinks)
    completions_log: bool = True  # completions.jsonl: every sample of every step

    def __post_init__(self):
        for name in ("steps", "group_size", "prompts_per_step", "rollout_calls", "sft_batch",
                     "eval_prompts", "checkpoint_every", "kv_pages", "chunk_steps", "max_new_tokens",
                     "sft_steps", "warmup_steps", "eval_every", "eval_k"):
            value = getattr(self, name)
            low = 0 if name in ("sft_steps", "warmup_steps", "eval_every") else 1
            if value is None and name in ("sft_steps", "max_new_tokens", "kv_pages"):
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"--{name.replace('_', '-')} must be an integer >= {low}, "
                                 f"got {value!r}")
            high = MAX_CHUNK_STEPS if name == "chunk_steps" else MAX_COUNT
            if value > high:
                raise ValueError(f"--{name.replace('_', '-')} must be at most {high}, got "
                                 f"{value}")
        self._check_page_size()
        if self.group_size < 2:
            raise ValueError("--group-size must be >= 2: GRPO advantages compare samples of "
                             "a group")
        if self.prompts_per_step % self.rollout_calls:
            raise ValueError(f"--prompts-per-step ({self.prompts_per_step}) must be a multiple "
                             f"of --rollout-calls ({self.rollout_calls})")
        if self.kernels not in (None,) + KERNELS:
            raise ValueError(f"--kernels must be one of {KERNELS}, got {self.kernels!r}")
        if self.env not in (None,) + ENVS:
            raise ValueError(f"--env must be one of {ENVS}, got {self.env!r}")
        if self.env is not None and (self.dataset is not None or self.model is not None):
            raise ValueError("--env calculator runs the built-in model on its own questions; "
                             "it excludes --dataset and --model")
        for name in ("lr", "sft_lr", "sft_stop_loss"):
            if getattr(self, name) is None:
                continue
            if not 0 < getattr(self, name) < float("inf"):
                raise ValueError(f"--{name.replace('_', '-')} must be a finite number > 0, "
                                 f"got {getattr(self, name)}")
        if not 0 <= self.temperature < float("inf"):
            raise ValueError(f"--temperature must be a finite number >= 0, got "
                             f"{self.temperature}")
        if 0 < self.temperature < MIN_TRAIN_TEMPERATURE:
            raise ValueError(f"--temperature {self.temperature:g} is below "
                             f"{MIN_TRAIN_TEMPERATURE:g}: the policy gradient scales as "
                             f"1 / temperature and its norm overflows float32 (NaN at 1e-20); "
                             f"0 samples greedily")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) \
                or not 0 <= self.seed <= MAX_SEED:
            raise ValueError(f"--seed must be an integer in [0, 2**32 - 1], got {self.seed!r}")
        if self.kv_policy not in ("recompute", "keep"):
            raise ValueError(f"--kv-policy must be 'recompute' or 'keep', got "
                             f"{self.kv_policy!r}")
        self._check_max_policy_lag()
        self._check_library_settings()
        if self.mini_batches > self.prompts_per_step * self.group_size:
            raise ValueError(f"--mini-batches ({self.mini_batches}) exceeds the samples of a "
                             f"step ({self.prompts_per_step * self.group_size})")
        if self.resume and self.overwrite:
            raise ValueError("--resume and --overwrite exclude each other")
        self._check_task_settings()
        self._check_rewards()
        self._check_lora()
        from jaxrl_cache.rl.sinks import parse_report_to
        parse_report_to(self.report_to)
        if self.mesh is not None:
            from jaxrl_cache.app.mesh_layout import MeshLayout
            MeshLayout.parse(self.mesh)
        out = pathlib.Path(self.out)
        if out.exists() and not out.is_dir():
            raise ValueError(f"--out {out} is a file, not a directory")

    def _check_page_size(self) -> None:
        value = self.page_size
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= \
                MAX_PAGE_SIZE or value & (value - 1):
            raise ValueError(f"--page-size must be a power of two in [1, {MAX_PAGE_SIZE}], "
                             f"got {value!r}")

    def _check_max_policy_lag(self) -> None:
        from jaxrl_cache.versioning import MAX_POLICY_LAG
        if isinstance(self.max_policy_lag, bool) or not isinstance(self.max_policy_lag, int) \
                or not 0 <= self.max_policy_lag <= MAX_POLICY_LAG:
            raise ValueError(f"--max-policy-lag must be an integer in [0, {MAX_POLICY_LAG}], "
                             f"got {self.max_policy_lag!r}")

    def _check_library_settings(self) -> None:
        """The settings the library checks (TrainConfig, SamplingParams, the optimizer's),
        as one-line ValueErrors naming the flag."""
        if isinstance(self.stop, (list, str)):  # a run record (JSON) or a config file
            object.__setattr__(self, "stop", (self.stop,) if isinstance(self.stop, str)
                               else tuple(self.stop))
        from jaxrl_cache.rl.batch import advantages_for
        from jaxrl_cache.rollout.sampling import SamplingParams
        try:
            train_config(self, async_rollouts=self.async_rollouts)
            SamplingParams(n=self.group_size, temperature=self.temperature, top_p=self.top_p,
                           top_k=self.top_k, min_p=self.min_p,
                           repetition_penalty=self.repetition_penalty, stop=self.stop,
                           include_stop_str_in_output=self.include_stop_str_in_output)
            advantages_for(self.scale_rewards)
        except (TypeError, ValueError) as e:
            name = str(e).split(" ", 1)[0].split("[", 1)[0]
            raise ValueError(f"--{name.replace('_', '-')}: {e}") from None
        if self.kl_beta > 0 and (self.top_k or self.top_p < 1 or self.min_p > 0):
            raise ValueError("--kl-beta with --top-k/--top-p/--min-p: the train step scores "
                             "the reference policy under the same truncation, so a token "
                             "outside its top-k/top-p/min-p set has an infinite KL; use "
                             "--kl-beta with plain temperature sampling")
        for name, low, high in (("weight_decay", 0.0, float("inf")),
                                ("max_grad_norm", 0.0, float("inf")),
                                ("adam_b1", 0.0, 1.0), ("adam_b2", 0.0, 1.0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or not low <= value < high or (name == "max_grad_norm" and value == 0):
                positive = " and > 0" if name == "max_grad_norm" else ""
                raise ValueError(f"--{name.replace('_', '-')} must be a number in "
                                 f"[{low}, {high}){positive}, got {value!r}")

    def lora_config(self):
        """The models.lora.LoraConfig of --lora-rank/--lora-alpha/--lora-targets, or None
        (full fine-tuning)."""
        if not self.lora_rank:
            return None
        from jaxrl_cache.models.lora import LoraConfig
        return LoraConfig(rank=self.lora_rank, alpha=self.lora_alpha,
                          **({"targets": self.lora_targets} if self.lora_targets else {}))

    def _check_lora(self) -> None:
        if isinstance(self.lora_targets, (list, str)):  # a flag, a run record, a config file
            names = self.lora_targets.split(",") if isinstance(self.lora_targets, str) \
                else self.lora_targets
            object.__setattr__(self, "lora_targets", tuple(n.strip() for n in names))
        if isinstance(self.lora_rank, bool) or not isinstance(self.lora_rank, int) \
                or self.lora_rank < 0:
            raise ValueError(f"--lora-rank must be an integer >= 0, got {self.lora_rank!r}")
        if not self.lora_rank and (self.lora_targets or self.lora_alpha != 8.0):
            raise ValueError("--lora-alpha / --lora-targets need --lora-rank R (> 0)")
        if self.lora_rank and self.mesh is not None:
            raise ValueError("--lora-rank with --mesh is not supported: LoRA runs on one "
                             "device (the engine shares the trainer's base weights)")
        try:
            self.lora_config()
        except ValueError as e:
            raise ValueError(f"--lora-{str(e).split(' ', 2)[1]}: {e}") from None

    def _check_task_settings(self) -> None:
        from jaxrl_cache.app.tasks import Reward
        for name, why in (("answer_regex", "the built-in task scores exact matches"),
                          ("system_prompt", "the built-in task has plain prompts"),
                          ("split", "the built-in task has no splits"),
                          ("dataset_config", "the built-in task has no configurations")):
            if getattr(self, name) is not None and self.dataset is None:
                raise ValueError(f"--{name.replace('_', '-')} applies to a --dataset; {why}")
        for name in ("prompt_key", "answer_key", "dataset", "split", "dataset_config"):
            value = getattr(self, name)
            if (value is not None or name in ("prompt_key", "answer_key")) and \
                    (not isinstance(value, str) or not value):
                raise ValueError(f"--{name.replace('_', '-')} must be a non-empty name, got "
                                 f"{value!r}")
        kwargs = self.chat_template_kwargs
        if isinstance(kwargs, str):  # a flag's JSON text
            object.__setattr__(self, "chat_template_kwargs", parse_json_object(
                kwargs, "--chat-template-kwargs"))
        elif kwargs is not None and not (isinstance(kwargs, dict) and all(
                isinstance(k, str) for k in kwargs)):
            raise ValueError(f"--chat-template-kwargs must be a mapping of names to values, "
                             f"got {kwargs!r:.80}")
        Reward(self.answer_regex)  # validates the regex

    @property
    def answer_in_rewards(self) -> bool:
        """The answer reward is one of the run's rewards (see the module doc)."""
        return self.dataset is None or not self.rewards or self.answer_check is not None

    def _check_rewards(self) -> None:
        """--answer-check (math-verify installed) and --reward (each function imported
        here, so a bad one fails before any work; names unique, "answer" included when the
        answer reward is one of them)."""
        if isinstance(self.rewards, (list, str)):  # a run record (JSON) or a config file
            object.__setattr__(self, "rewards", (self.rewards,) if isinstance(
                self.rewards, str) else tuple(self.rewards))
        if self.answer_check is not None and self.dataset is None:
            raise ValueError("--answer-check applies to a --dataset; the built-in task "
                             "scores exact matches")
        if self.rewards and self.env is not None:
            raise ValueError("--reward: with --env calculator the environment's return is "
                             "the reward")
        from jaxrl_cache.app.tasks import Reward
        from jaxrl_cache.rl.rewards import RewardFn, Rewards, load_reward
        Reward(self.answer_regex, self.answer_check or "exact")
        if not all(isinstance(spec, str) for spec in self.rewards):
            raise ValueError(f"--reward takes module:function[=weight] strings, got "
                             f"{self.rewards!r:.80}")
        try:
            Rewards((*[RewardFn(float, name="answer")] * self.answer_in_rewards,
                     *map(load_reward, self.rewards)))
        except TypeError as e:
            raise ValueError(f"--reward: {e}") from None


def parse_json_object(text: str, flag: str) -> dict:
    """The JSON object in `text` (a flag's value); ValueError naming `flag` otherwise."""
    import json
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{flag}: not valid JSON ({e.msg}): {text!r:.80}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{flag}: expected a JSON object such as "
                         f'\'{{"enable_thinking": false}}\', got {text!r:.80}')
    return value


def train_config(opts: DemoOptions, *, async_rollouts: bool):
    """The trainer's settings (a TrainConfig); the synchronous loop donates the old state
    (the audit needs only the current version's params, and the engine has released them),
    the asynchronous one its optimizer state (its engine decodes with the params, lent, while
    the trainer updates)."""
    from jaxrl_cache.rl.train_config import TrainConfig
    return TrainConfig(correction=opts.correction, mini_batches=opts.mini_batches,
                       epochs=opts.epochs, token_budget=opts.token_budget,
                       loss_type=opts.loss_type, clip_eps=opts.clip_eps,
                       epsilon_high=opts.epsilon_high,
                       importance_sampling_level=opts.importance_sampling_level,
                       entropy_coef=opts.entropy_coef,
                       mask_truncated_completions=opts.mask_truncated_completions,
                       dual_clip=opts.dual_clip, is_cap=opts.is_cap, kl_beta=opts.kl_beta,
                       remat=opts.remat, compute_dtype=opts.compute_dtype,
                       logprob_chunk=opts.logprob_chunk,
                       donate=False if opts.mesh is not None else
                       "optimizer" if async_rollouts else True)


def resume_differences(saved: dict, opts: DemoOptions, given) -> list[str]:
    """'--flag VALUE (the run has SAVED)' for each setting in `given` (names the caller set
    explicitly) whose value in `opts` differs from the run's saved options, except
    RESUMABLE and NOT_SETTINGS; a setting the run's record lacks (a run from before it
    existed) counts as its default."""
    defaults = DemoOptions.__dataclass_fields__
    out = []
    for name in sorted(given):
        if name in RESUMABLE or name in NOT_SETTINGS or name not in defaults:
            continue
        value, have = getattr(opts, name), saved.get(name, defaults[name].default)
        if isinstance(value, tuple):
            value = list(value)
        if value != have:
            out.append(f"--{name.replace('_', '-')} {value!r} (the run has {have!r})")
    return out
