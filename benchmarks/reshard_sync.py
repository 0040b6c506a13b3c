"""Weight sync across meshes: bytes moved and seconds per `reshard` of trainer (FSDP) params
into the engine's tensor-parallel layout, on 8 simulated CPU devices.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m benchmarks.reshard_sync

Layouts: trainer fsdp 4 on devices 0-3 -> engine tensor 4 on devices 4-7 (disjoint), and
trainer fsdp 8 -> engine tensor 8 on the same devices (shared). Median of 5 syncs after one
warm-up (the first sync of a layout pair compiles its transfer).
"""
import statistics

import jax

from jaxrl_cache.models import ModelConfig, init_params
from jaxrl_cache.models.sharding import TRAIN_RULES
from jaxrl_cache.parallel import (make_mesh, reshard, rollout_shardings,
                                  tree_shardings)

CONFIG = ModelConfig(vocab_size=8192, d_model=512, n_layers=8, n_heads=8, n_kv_heads=2,
                     head_dim=64, d_ff=1536, max_seq_len=2048)


def sync(trainer_devices, engine_devices, repeats=5):
    trainer = make_mesh({"fsdp": len(trainer_devices)}, trainer_devices)
    engine = make_mesh({"tensor": len(engine_devices)}, engine_devices)
    params = init_params(CONFIG, jax.random.key(0))
    params = jax.device_put(params, tree_shardings(params, TRAIN_RULES, trainer))
    target = rollout_shardings(params, CONFIG, engine)
    reshard(params, target)
    runs = [reshard(params, target)[1] for _ in range(repeats)]
    return runs[0], statistics.median(r.seconds for r in runs)


def main():
    assert jax.device_count() == 8, "set XLA_FLAGS=--xla_force_host_platform_device_count=8"
    n = sum(x.size for x in jax.tree.leaves(jax.eval_shape(
        lambda: init_params(CONFIG, jax.random.key(0)))))
    print(f"model: {n / 1e6:.1f}M params, {n * 4 / 2**20:.0f} MiB fp32")
    devices = jax.devices()
    for name, (t, e) in {"disjoint 4+4": (devices[:4], devices[4:]),
                         "shared 8": (devices, devices)}.items():
        stats, seconds = sync(t, e)
        print(f"{name:<13} moved {stats.bytes_moved / 2**20:7.1f} MiB of "
              f"{stats.bytes_resident / 2**20:7.1f} MiB resident; {seconds * 1e3:7.1f} ms/sync")


if __name__ == "__main__":
    main()
