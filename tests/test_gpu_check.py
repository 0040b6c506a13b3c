"""benchmarks/gpu_check.py's pieces that must work the first time a GPU is lent: every XLA
flag set of its exactness variants parses (an unknown flag aborts the child, wasting the
GPU's time), and a child's output is read without ever raising."""
import os
import subprocess
import sys

import pytest

from benchmarks.gpu_check import EXACTNESS_VARIANTS, FLAG_SETS, child_result


@pytest.mark.parametrize("name", sorted(set(v[3] for v in EXACTNESS_VARIANTS)))
def test_every_flag_set_parses(name):
    env = dict(os.environ, XLA_FLAGS=FLAG_SETS[name], JAX_PLATFORMS="cpu")
    done = subprocess.run([sys.executable, "-c", "import jax, jax.numpy as jnp; "
                           "print(float(jax.jit(lambda x: x * 2 + 1)(jnp.ones(()))))"],
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "3.0", done.stderr[-500:]


def test_a_childs_output_is_read_without_raising():
    exact = '{"exact": true, "tokens": 4}'
    assert child_result({}, exact + "\n", "", 0) == {"exact": True, "tokens": 4}
    # not exact: the probe's line is owed
    row = child_result({}, '{"exact": false}\n{"probe": {"x": 1}, "summary": "s"}\n', "", 0)
    assert row["probe_summary"] == "s" and "error" not in row
    assert "error" in child_result({}, '{"exact": false}\n', "boom", 0)
    # stray lines, a crash before any row, a clean exit with nothing printed
    assert child_result({}, "{not json\n[1]\n" + exact, "", 0)["tokens"] == 4
    assert child_result({}, "", "Traceback ... Boom", 1)["error"].endswith("Boom")
    assert child_result({}, "", "", 0)["error"] == "exit 0"
