"""benchmarks/train_memory.py's compiled memory plan (`--analysis`) under the default
TrainConfig, whose remat is "auto": the plan resolves it as `train_step` does (it raised a
KeyError in the layer scan before)."""
import jax
import numpy as np

from benchmarks.train_memory import _update_memory_plan, fake_rollouts
from jaxrl_cache.models.config import ModelConfig
from jaxrl_cache.models.llama import init_params
from jaxrl_cache.rl.batch import make_batch
from jaxrl_cache.rl.train import TrainState
from jaxrl_cache.rl.train_config import TrainConfig


def test_the_memory_plan_of_the_default_config_compiles():
    config = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                         head_dim=8, d_ff=64, max_seq_len=128)
    state = TrainState.create(init_params(config, jax.random.key(0)), config=config,
                              lr_schedule=1e-3)
    batch = make_batch(fake_rollouts(4, 48, config.vocab_size),  # 32 prompt tokens + 16
                       np.random.default_rng(1).uniform(0, 1, 4))
    assert TrainConfig().remat == "auto"
    plan = _update_memory_plan(state, batch, TrainConfig())
    assert plan["argument_size_in_bytes"] > 0 and plan["temp_size_in_bytes"] > 0
