"""Runs tests/multidevice (meshes, sharded rollout and training, resharding, compiled
collectives) in a subprocess with 8 simulated CPU devices; this process keeps one device."""
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_multidevice_suite():
    env = dict(os.environ, JAXRL_MULTIDEVICE="1", XLA_FLAGS=(
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip())
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "tests/multidevice", "-q", "-x", "-s",
         "-p", "no:cacheprovider"]
        + ([] if os.environ.get("JAXRL_FULL_SWEEP") == "1" else ["-m", "not slow"]), cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=900)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
