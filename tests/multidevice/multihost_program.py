"""One program, run by every process: a sharded train step, a reshard of the new params into
the engine's tensor-parallel layout, and a sharded paged prefill + greedy decode.

    JAX_COORDINATOR_ADDRESS=localhost:PORT JAX_NUM_PROCESSES=2 JAX_PROCESS_ID=i \
        python -m tests.multidevice.multihost_program OUT.npz

joins a multi-process run (CPU collectives over gloo); without the variables it runs alone.
Either way the global mesh has 8 devices (XLA_FLAGS sets each process's device count), and
every process writes the gathered results.
"""
import sys

from jaxrl_cache.parallel.distributed import initialize_from_env

initialize_from_env()

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402

from jaxrl_cache.models import decode_forward, prefill_forward  # noqa: E402
from jaxrl_cache.parallel import (engine_kv_cache, make_mesh, place, reshard,  # noqa: E402
                                  rollout_shardings, shard_forward, train_state_shardings)
from jaxrl_cache.rl.train import train_step  # noqa: E402
from tests.multidevice import common  # noqa: E402


def main(out: str) -> None:
    assert jax.device_count() == 8, jax.device_count()
    train_mesh = make_mesh({"data": 2, "fsdp": 4})
    engine_mesh = make_mesh({"tensor": 8})
    state = common.train_state()
    state = place(state, train_state_shardings(state, train_mesh))
    state, metrics = train_step(state, common.train_batch(), mesh=train_mesh)

    params, stats = reshard(state.params, rollout_shardings(state.params, common.CONFIG,
                                                             engine_mesh))
    prefill = jax.jit(lambda p, kv, *a: shard_forward(prefill_forward, engine_mesh)(
        p, common.CONFIG, kv, *a, backend="xla"))
    decode = jax.jit(lambda p, kv, *a: shard_forward(decode_forward, engine_mesh)(
        p, common.CONFIG, kv, *a, backend="xla"))
    kv = engine_kv_cache(common.CONFIG, common.NUM_PAGES, common.PAGE_SIZE, engine_mesh)
    tokens, logits, _ = common.greedy(prefill, decode, params, kv, steps=3)

    gather = lambda x: np.asarray(multihost_utils.process_allgather(x, tiled=True))
    flat = {jax.tree_util.keystr(k): gather(v)
            for k, v in jax.tree_util.tree_leaves_with_path(params)}
    np.savez(out, tokens=tokens, logits=logits, loss=float(metrics["loss"]),
             version=int(state.version), process_count=jax.process_count(),
             bytes_moved=stats.bytes_moved, **flat)


if __name__ == "__main__":
    main(sys.argv[1])
