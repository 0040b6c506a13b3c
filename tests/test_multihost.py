"""Multi-host: two processes x 4 CPU devices join through jax.distributed (gloo collectives on
localhost) and run one program: a train step on a data x fsdp mesh, a reshard into the
engine's tensor-parallel layout, a sharded paged prefill + greedy decode. Every process's
results equal the single-device ones computed here."""
import os
import pathlib
import socket
import subprocess
import sys

import jax
import numpy as np
import pytest

from jaxrl_cache.models import decode_forward, init_kv_cache, prefill_forward
from jaxrl_cache.parallel.distributed import initialize_from_env
from jaxrl_cache.rl.train import train_step
from tests.multidevice import common

ROOT = pathlib.Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def launch(out_dir: pathlib.Path, processes: int = 2) -> list[subprocess.Popen]:
    """The processes inherit this one's XLA_FLAGS (conftest's optimisation level): the same
    code as the single-device reference, so their results differ only by the sharded
    programs' reduction order (with another level, by up to 3e-5 in the logits on one CPU)."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=(
        os.environ.get("XLA_FLAGS", "")
        + f" --xla_force_host_platform_device_count={8 // processes}").strip())
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.update(JAX_COORDINATOR_ADDRESS=f"localhost:{free_port()}",
               JAX_NUM_PROCESSES=str(processes))
    return [subprocess.Popen(
        [sys.executable, "-m", "tests.multidevice.multihost_program", str(out_dir / f"{i}.npz")],
        cwd=ROOT, env=dict(env, JAX_PROCESS_ID=str(i)), stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True) for i in range(processes)]


# the single-device prefill and decode, jitted once (the spread's draws reuse their programs)
FORWARDS = [jax.jit(lambda p, kv, *a, f=f: f(p, common.CONFIG, kv, *a, backend="xla"))
            for f in (prefill_forward, decode_forward)]


def _greedy(params):
    """(tokens [4, 2], logits f32 [4, 2, V]) of the single-device prefill + 3 decode steps."""
    kv = init_kv_cache(common.CONFIG, common.NUM_PAGES, common.PAGE_SIZE)
    return common.greedy(*FORWARDS, params, kv, steps=3)[:2]


def one_ulp_logit_spread(params, draws: int = 2) -> float:
    """How far this machine's single-device logits move when every weight moves by one ulp
    (each by a random sign): the scale reduction-order differences in the weights reach
    after three decode steps of this sharp model, measured here rather than pinned."""
    base = _greedy(params)[1]
    leaves, tree = jax.tree.flatten(params)
    spread = 0.0
    for d in range(draws):
        keys = jax.random.split(jax.random.key(d), len(leaves))
        moved = tree.unflatten([x * (1 + 2.0**-23 * jax.random.rademacher(k, x.shape, x.dtype))
                                for x, k in zip(leaves, keys)])
        spread = max(spread, float(np.abs(_greedy(moved)[1] - base).max()))
    return spread


def single_device_reference():
    state, metrics = train_step(common.train_state(), common.train_batch())
    tokens, logits = _greedy(state.params)
    params = {jax.tree_util.keystr(k): np.asarray(v)
              for k, v in jax.tree_util.tree_leaves_with_path(state.params)}
    return dict(tokens=tokens, logits=logits, loss=float(metrics["loss"]), params=params,
                spread=one_ulp_logit_spread(state.params))


def test_two_processes_match_single_device(tmp_path):
    procs = launch(tmp_path)
    try:
        ref = single_device_reference()
        logs = [p.communicate(timeout=600)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log[-4000:]
    for i in range(len(procs)):
        got = np.load(tmp_path / f"{i}.npz")
        assert int(got["process_count"]) == 2 and int(got["version"]) == 1
        np.testing.assert_array_equal(got["tokens"], ref["tokens"])
        # params within fp32 reduction order of the train step (a few ulps of the weights),
        # and the sharded decode's own order: within a few one-ulp spreads of the weights
        np.testing.assert_allclose(got["logits"], ref["logits"], atol=4 * ref["spread"],
                                   rtol=0)
        np.testing.assert_allclose(float(got["loss"]), ref["loss"], rtol=1e-5)
        for name, want in ref["params"].items():
            np.testing.assert_allclose(got[name], want, atol=1e-6, rtol=1e-5, err_msg=name)


def test_initialize_from_env_refuses_incomplete_settings():
    with pytest.raises(ValueError, match="JAX_PROCESS_ID"):
        initialize_from_env({"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_NUM_PROCESSES": "2"})
    with pytest.raises(ValueError, match="outside"):
        initialize_from_env({"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_NUM_PROCESSES": "2",
                             "JAX_PROCESS_ID": "2"})
    assert initialize_from_env({}) is False
