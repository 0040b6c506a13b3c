"""Test-session setup.

pytest-xdist starts its workers with SIGINT ignored; the interrupt tests (like users'
programs) run under Python's default handler, which raises KeyboardInterrupt.

XLA compilations are cached on disk for the test session (and the next one), shared by the
xdist workers and every subprocess a test starts (demo runs, a kill -9 and resume, the
8-device and two-process suites inherit the environment): most of the suite's time is
compiling the same programs again. JAX_COMPILATION_CACHE_DIR set by the caller wins.
"""
import os
import pathlib
import signal
import threading

if threading.current_thread() is threading.main_thread() and \
        signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

os.environ.setdefault("JAX_COMPILATION_CACHE_DIR",
                      str(pathlib.Path(__file__).resolve().parents[1] / ".pytest_cache" / "xla"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")
# The suite's programs are tiny: XLA:CPU's LLVM optimisation costs more than it saves (the
# same HLO programs; 20-25% less wall time). Inherited by test subprocesses.
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_backend_optimization_level=0").strip()

import jax  # noqa: E402  (after the environment: jax reads it once, at import)
import pytest  # noqa: E402

jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
jax.config.update("jax_persistent_cache_min_compile_time_secs",
                  float(os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"]))

# Files that take longest run first (`--dist loadfile --no-loadscope-reorder` hands files to
# the workers in collection order; xdist's default reorders them by test count, which put the
# one-test 170 s multidevice file last, alone): longest-first keeps the workers even instead
# of one finishing a long file alone at the end. Order within a file is unchanged. Ranked by
# a cold-cache CI run's durations (2026-12-06).
LONG_FILES = ("test_multidevice.py", "test_invariant_kernels.py", "test_demo.py",
              "test_train_scale.py", "test_exactness.py", "test_numerics.py",
              "test_multihost.py", "test_step_audit.py", "test_lora_demo.py", "test_eval.py",
              "test_episodes.py", "test_offpolicy.py", "test_episode_training.py",
              "test_training.py", "test_lora.py", "test_validation.py", "test_engine.py",
              "test_kernels.py", "test_async_engine.py", "test_model.py",
              "test_engine_stateful.py")


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONG_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(LONG_FILES)))


@pytest.fixture(autouse=True, scope="module")
def _free_compiled_programs():
    """Each test file's compiled programs are freed when it ends (the disk cache keeps the
    next file's compiles cheap). An xdist worker that kept every program of a dozen files
    alive crashed XLA:CPU inside a later compile or its cache write (SIGSEGV / SIGABRT in
    test_exactness's train step, every run; each file passes alone)."""
    yield
    jax.clear_caches()
