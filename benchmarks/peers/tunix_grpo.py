"""GRPO with tunix's GRPOLearner (RLCluster, vanilla rollout, llama3 nnx model loaded from
SmolLM2's safetensors) on the shared workload of common.py. One `STEP {json}` line per
global step. Benchmark-only dependency, in its own venv beside jax 0.10:

    python3.11 -m venv /work/tunixvenv
    /work/tunixvenv/bin/pip install google-tunix "jax==0.10.*" "jaxlib==0.10.*"
    /work/tunixvenv/bin/python benchmarks/peers/tunix_grpo.py --steps 8
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))
import common  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import transformers  # noqa: E402
from tunix.models.llama3 import model as llama_lib  # noqa: E402
from tunix.models.llama3 import params as llama_params  # noqa: E402
from tunix.rl import rl_cluster as rl_cluster_lib  # noqa: E402
from tunix.rl.grpo import grpo_learner  # noqa: E402
from tunix.rl.rollout import base_rollout  # noqa: E402


def smollm2_config(path: str) -> llama_lib.ModelConfig:
    """tunix's llama3 config from the HF config.json (plain rope, tied embeddings)."""
    hf = json.load(open(os.path.join(path, "config.json")))
    rope = hf.get("rope_parameters") or {"rope_theta": hf.get("rope_theta")}
    return llama_lib.ModelConfig(
        num_layers=hf["num_hidden_layers"], vocab_size=hf["vocab_size"],
        embed_dim=hf["hidden_size"], hidden_dim=hf["intermediate_size"],
        num_heads=hf["num_attention_heads"], head_dim=hf["head_dim"],
        num_kv_heads=hf["num_key_value_heads"], rope_theta=int(rope["rope_theta"]),
        norm_eps=hf["rms_norm_eps"], weight_tying=hf["tie_word_embeddings"],
        remat_config=llama_lib.RematConfig.NONE)  # BLOCK: flax TraceContextError in rollout


class Timer:
    """Per global step: wall seconds, generation (+ reward) and actor-update seconds."""

    def __init__(self):
        self.t0 = self.gen = self.update = None
        self.rewards, self.step = [], 0

    def start(self):
        now = time.perf_counter()
        if self.t0 is not None:
            self.flush(now)
        self.t0, self.gen, self.update, self.rewards = now, 0.0, 0.0, []

    def flush(self, now):
        common.emit(step=self.step, seconds=now - self.t0, generation_seconds=self.gen,
                    update_seconds=self.update,
                    reward=sum(self.rewards) / max(len(self.rewards), 1),
                    samples=len(self.rewards), peak_rss_mib=common.peak_rss_mib())
        self.step += 1

    def wrap(self, fn, field):
        def timed(*a, **kw):
            t = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                setattr(self, field, getattr(self, field) + time.perf_counter() - t)
        return timed


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--shape", default=common.SHAPES[0], help="prompts x group x new tokens")
    args = p.parse_args()
    common.set_shape(args.shape)
    # Auto axes: jax 0.10's make_mesh defaults to Explicit, which tunix's embedding gather
    # rejects (ShardingTypeError)
    mesh = jax.make_mesh((1, 1), ("fsdp", "tp"),
                         axis_types=(jax.sharding.AxisType.Auto,) * 2)
    config = smollm2_config(common.MODEL)
    model = llama_params.create_model_from_safe_tensors(common.MODEL, config, mesh,
                                                        dtype=jnp.float32)
    tok = transformers.AutoTokenizer.from_pretrained(common.MODEL)
    def chat(prompt):  # the chat template as text (tunix tokenizes prompts itself)
        return tok.apply_chat_template(common.messages(prompt), tokenize=False,
                                       add_generation_prompt=True)

    prompt_len = max(len(tok.encode(chat(r["prompt"]))) for r in common.examples())
    timer = Timer()

    def reward(prompts, completions, answer, **kw):
        out = [common.reward(c, a) for c, a in zip(completions, answer)]
        timer.rewards.extend(out)
        return out

    optimizer = optax.chain(optax.clip_by_global_norm(1.0),  # HF Trainer's AdamW defaults
                            optax.adamw(common.LR, b1=0.9, b2=0.999, eps=1e-8,
                                        weight_decay=0.0))
    rollout = base_rollout.RolloutConfig(
        max_tokens_to_generate=common.MAX_NEW_TOKENS, max_prompt_length=prompt_len,
        kv_cache_size=prompt_len + common.MAX_NEW_TOKENS + 8, temperature=common.TEMPERATURE,
        top_p=1.0, top_k=None, eos_tokens=[tok.eos_token_id], data_type=jnp.float32)
    training = rl_cluster_lib.RLTrainingConfig(
        actor_optimizer=optimizer, eval_every_n_steps=10**9, max_steps=args.steps,
        mini_batch_size=common.PROMPTS_PER_STEP,
        train_micro_batch_size=common.PROMPTS_PER_STEP,
        checkpoint_root_directory=None,
        metrics_logging_options=None)
    cluster = rl_cluster_lib.RLCluster(
        actor=model, reference=model, tokenizer=tok,
        cluster_config=rl_cluster_lib.ClusterConfig(
            role_to_mesh={rl_cluster_lib.Role.ACTOR: mesh, rl_cluster_lib.Role.REFERENCE: mesh,
                          rl_cluster_lib.Role.ROLLOUT: mesh},
            rollout_engine="vanilla", offload_to_cpu=False, training_config=training,
            rollout_config=rollout))
    algo = grpo_learner.GRPOConfig(num_generations=common.GROUP, num_iterations=1, beta=0.0,
                                   loss_agg_mode="token-mean")
    learner = grpo_learner.GRPOLearner(rl_cluster=cluster, algo_config=algo,
                                       reward_fns=reward)
    learner._generate_and_compute_advantage = timer.wrap(
        learner._generate_and_compute_advantage, "gen")
    cluster.update_actor = timer.wrap(cluster.update_actor, "update")
    run_step = learner._run_global_step

    def step(*a, **kw):
        timer.start()
        return run_step(*a, **kw)

    learner._run_global_step = step
    rows = common.examples()
    data = [{"prompts": np.array([chat(r["prompt"]) for r in common.step_examples(s)]),  # [B] str
             "answer": np.array([r["answer"] for r in common.step_examples(s)])}  # [B] str
            for s in range(args.steps)]  # tunix repeats each leaf G times: arrays, not lists
    print(f"tunix loaded; devices {jax.devices()}; {len(rows)} task rows", file=sys.stderr)
    learner.train(data)
    timer.flush(time.perf_counter())


if __name__ == "__main__":
    main()
