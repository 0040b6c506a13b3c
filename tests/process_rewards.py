"""Reward functions for the process=True tests (module level, so a worker process can
import them; no jax import, so a fresh worker loads them at once)."""
import os
import re
import sys
import time

CATASTROPHIC = re.compile(r"(a+)+$")  # exponential backtracking on "a" * n + "b"


def catastrophic(meta, sample, text):
    """Holds the GIL for ~2**40 steps on sample 4 (a C regex: no thread can stop it)."""
    if sample.prompt_ids[1] == 4:
        CATASTROPHIC.match("a" * 40 + "b")
    return 1.0


def catastrophic_always(meta, sample, text):
    CATASTROPHIC.match("a" * 40 + "b")
    return 1.0


def length(meta, sample, text):
    print("noise on stdout", text)  # must not reach the answers' pipe
    return float(len(text))


def pid(meta, sample, text):
    return float(os.getpid())


def crashes(meta, sample, text):
    if sample.prompt_ids[1] == 2:
        os._exit(7)
    return 0.0


def raises(meta, sample, text):
    if sample.prompt_ids[1] == 3:
        raise KeyError("no such column")
    return 0.0


def exits(meta, sample, text):
    sys.exit(5)


def hangs(meta, sample, text):
    time.sleep(3600)
    return 0.0


class Custom(BaseException):
    """A BaseException that is neither Exception, SystemExit nor KeyboardInterrupt."""


def raise_system_exit(meta, sample, text):
    raise SystemExit(4)


def raise_cancelled(meta, sample, text):
    import asyncio
    raise asyncio.CancelledError("cancelled")


def raise_generator_exit(meta, sample, text):
    raise GeneratorExit()


def raise_custom(meta, sample, text):
    raise Custom("custom")


def raise_keyboard_interrupt(meta, sample, text):
    raise KeyboardInterrupt()
