"""DaemonThreads: a fixed number of daemon worker threads for user code that may hang
(environment calls, reward functions).

Unlike concurrent.futures' pool, whose threads the interpreter joins at exit, a call stuck
forever here never keeps the process alive (its thread stays parked). Callers enforce their
own timeouts and drop late answers; `fn` must not raise (callers wrap it to report faults).
"""
from __future__ import annotations

import queue
import threading
from typing import Callable


class DaemonThreads:
    """`submit(fn, *args, done=cb)` runs cb(fn(*args)) on a worker; `close()` drops the
    queued calls and lets idle threads end (a running call finishes, its answer unread)."""

    def __init__(self, workers: int, name: str = "worker"):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._closed, self._workers = False, workers
        for i in range(workers):
            threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True).start()

    def submit(self, fn, *args, done: Callable) -> None:
        self._jobs.put((fn, args, done))

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None or self._closed:
                return
            fn, args, done = job
            done(fn(*args))

    def close(self) -> None:
        self._closed = True
        while True:  # queued calls are dropped
            try:
                self._jobs.get_nowait()
            except queue.Empty:
                break
        for _ in range(self._workers):  # one stop mark per thread: idle ones end now
            self._jobs.put(None)
