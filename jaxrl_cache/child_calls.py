"""ChildCalls: run picklable calls in worker processes that can be killed mid-call.

A thread cannot stop a call that holds the GIL (a catastrophic regex runs in C for
minutes); a process can be killed. Each worker is `python -m jaxrl_cache.child_calls` (no
multiprocessing spawn: the parent's `__main__` is never re-run, and jax is never imported
there unless the called code imports it), talking pickles over its stdin / stdout.

Invariants:
- One call at a time per worker; idle workers are reused across calls. `kill(key)` kills
  the worker running the call `key` (its caller gets `ChildDied`); nothing else is shared.
- A call's exception comes back as `ChildError` carrying its type's name and message (the
  exception object itself may not pickle); a worker that dies mid-call is `ChildDied`.
- Modules loaded from a file path (the CLI's `--reward file.py:fn`) are registered with
  `register_file_module` and loaded in the worker under the same name before a call, so
  their functions unpickle there.
- Workers end with the parent: their stdin closes, and `atexit` kills any still running.
"""
from __future__ import annotations

import atexit
import importlib.util
import os
import pickle
import subprocess
import sys
import threading

_FILE_MODULES: dict = {}  # module name -> file path, loaded in each worker on demand


def register_file_module(name: str, path: str) -> None:
    _FILE_MODULES[name] = str(path)


class ChildError(Exception):
    """The call raised in the worker: `type_name` and the first line of its message."""

    def __init__(self, type_name: str, message: str):
        super().__init__(message)
        self.type_name = type_name


class ChildDied(Exception):
    """The worker ended mid-call (killed past a deadline, or the code crashed it)."""


class ChildCalls:
    def __init__(self):
        self._idle: list = []
        self._busy: dict = {}  # key -> Popen
        self._lock = threading.Lock()
        atexit.register(self.close)

    def call(self, key, started, fn, *args, **kwargs):
        """fn(*args, **kwargs) in a worker; ChildError / ChildDied as above. `started()`
        runs once the worker has loaded the function (a fresh worker's imports are not
        the call's time). Pickling errors (a lambda, a closure) raise here, in the
        caller."""
        job = pickle.dumps((dict(_FILE_MODULES), list(sys.path),
                            pickle.dumps((fn, args, kwargs))))
        with self._lock:
            proc = self._idle.pop() if self._idle else _start()
            self._busy[key] = proc
        try:
            proc.stdin.write(len(job).to_bytes(8, "little") + job)
            proc.stdin.flush()
            if proc.stdout.read(1) != b"s":
                raise EOFError
            started()
            ok, value = pickle.load(proc.stdout)
        except (EOFError, OSError, pickle.UnpicklingError):
            with self._lock:
                self._busy.pop(key, None)
            proc.kill()
            proc.wait()
            raise ChildDied(f"its worker process ended mid-call (exit code "
                            f"{proc.returncode})") from None
        with self._lock:
            reusable = self._busy.pop(key, None) is proc  # else kill() took it
            if reusable:
                self._idle.append(proc)
        if not reusable:
            proc.wait()
        if not ok:
            raise ChildError(*value)
        return value

    def kill(self, key) -> None:
        """Kills the worker running call `key`, if it still runs."""
        with self._lock:
            proc = self._busy.pop(key, None)
            if proc is not None:
                proc.kill()

    def close(self) -> None:
        with self._lock:
            procs, self._idle = self._idle + list(self._busy.values()), []
        for proc in procs:
            proc.kill()
            proc.wait()


def _start() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "jaxrl_cache.child_calls"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE)


def _serve() -> None:
    """The worker's loop: read a job, run it, answer (ok, value | (type name, message))."""
    answers = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # the called code's prints go to stderr, never into the answers
    sys.stdout = sys.stderr
    jobs = sys.stdin.buffer
    while size := jobs.read(8):
        modules, path, call = pickle.loads(jobs.read(int.from_bytes(size, "little")))
        try:
            sys.path[:] = path
            for name, file in modules.items():
                _load(name, file)
            fn, args, kwargs = pickle.loads(call)  # after the modules it may name
        except BaseException as e:  # noqa: BLE001 -- reported to the caller
            fn, args, kwargs = _raise, (e,), {}
        answers.write(b"s")
        answers.flush()
        try:
            answer = pickle.dumps((True, fn(*args, **kwargs)))
        except BaseException as e:  # noqa: BLE001 -- reported to the caller
            answer = pickle.dumps((False, (type(e).__name__, exception_line(e))))
        answers.write(answer)
        answers.flush()


def _raise(e: BaseException):
    raise e


def _load(name: str, file: str) -> None:
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, file)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)


def exception_line(e: BaseException) -> str:
    """The first line of str(e), or a note when its __str__ itself raises."""
    try:
        text = str(e)
    except Exception:  # noqa: BLE001 -- user code: its __str__ may raise
        return "(its message could not be read)"
    return text.splitlines()[0] if text.strip() else ""


if __name__ == "__main__":
    _serve()
