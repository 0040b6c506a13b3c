"""Critical sections that Ctrl-C cannot split: SIGINT/SIGTERM deferred until the commit is over.

CPython runs Python signal handlers in the main thread between bytecodes (SIGINT's default
handler raises KeyboardInterrupt there), so any statement of a multi-statement update can be
interrupted. Inside `deferred_signals()` every Python-level handler of SIGINT and SIGTERM is
swapped for one that only records the signal; on leaving the outermost section the original
handlers are restored and each recorded signal is handed to its handler once, in order (so the
KeyboardInterrupt surfaces right after the commit). Nested sections defer to the outermost.
Other threads never run Python signal handlers, so there the section does nothing. Signals
whose disposition is not a Python callable (SIG_DFL, SIG_IGN) are left alone: they never raise
inside Python. Not covered: a second signal within the microseconds of the handler swap itself.

A long call can open a window where signals are delivered at once: inside the outermost
section, `allow_signals(fn, *args)` runs fn so that a signal landing in fn's frames (or
below) is handed to its handler immediately, unless a nested section is open there. So a
public call can hold a lock for a long generation, stay interruptible inside it, and still
never be interrupted between taking and releasing the lock.

Cost: a section swaps handlers through the C-level `_signal` functions (`signal.signal` wraps
each call in enum conversions, about 100x slower), so one section is about a microsecond:
one sigaction to install and one to restore per Python-handled signal.
"""
from __future__ import annotations

import _signal
import os
import signal
import sys
import threading
from _thread import get_ident as _get_ident

_SIGNALS = (int(signal.SIGINT), int(signal.SIGTERM))
_getsignal, _setsignal = _signal.getsignal, _signal.signal
_main_ident = threading.main_thread().ident  # refreshed in a forked child (its only thread)


def _after_fork() -> None:
    global _main_ident
    _main_ident = threading.main_thread().ident


os.register_at_fork(after_in_child=_after_fork)


class _State:
    owner = None  # the outermost open section (main thread only)
    saved: dict = {}  # signal -> handler to restore
    pending: list = []  # (signum, frame) received while deferred
    allowed = None  # frame of the allow_signals call whose callees take signals at once
    depth = 0  # nested sections open inside the allowed window


_state = _State()


def _in_window(frame) -> bool:
    """True if `frame` runs inside the allow_signals window and no nested section is open."""
    marker = _state.allowed
    if marker is None or _state.depth:
        return False
    while frame is not None:
        if frame is marker:
            return True
        frame = frame.f_back
    return False


def _record(signum, frame):
    if _in_window(frame):
        handler = _state.saved.get(signum)
        if callable(handler):
            handler(signum, frame)
        return
    _state.pending.append((signum, frame))


def _deliver_pending() -> None:
    pending, _state.pending = _state.pending, []
    for signum, frame in pending:
        handler = _state.saved.get(signum)
        if callable(handler):
            handler(signum, frame)


def _uninstall() -> list:
    """Restores the handlers; returns the signals recorded meanwhile with their handlers."""
    saved, pending = _state.saved, _state.pending
    _state.owner, _state.allowed, _state.depth = None, None, 0
    for sig, handler in saved.items():
        _setsignal(sig, handler)
    return [(saved.get(signum), signum, frame) for signum, frame in pending] if pending else ()


class deferred_signals:
    """`with deferred_signals(): ...` runs the body with SIGINT/SIGTERM deferred (see module).
    Lean on purpose: the radix cache opens one per request step."""
    __slots__ = ("_nested",)

    def __enter__(self):
        state = _state
        if _get_ident() != _main_ident:
            self._nested = None  # another thread: nothing to do
            return self
        if state.owner is not None:
            state.depth += 1  # nested: defers even inside an allow_signals window
            self._nested = True
            return self
        self._nested = False
        try:
            state.owner, state.saved, state.pending, state.allowed, state.depth = (
                self, {}, [], None, 0)
            for sig in _SIGNALS:
                handler = _getsignal(sig)
                if handler is not _record and callable(handler):
                    state.saved[sig] = handler
                    _setsignal(sig, _record)
        except BaseException:
            _uninstall()
            raise
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        nested = self._nested
        if nested:
            self._nested = False
            _state.depth -= 1
            if _state.pending and _in_window(sys._getframe()):
                _deliver_pending()  # what arrived during the nested commit, right after it
        elif nested is False and _state.owner is self:
            for handler, signum, frame in _uninstall():
                if callable(handler):
                    handler(signum, frame)
        return False


def allow_signals(fn, *args, **kwargs):
    """Runs fn(*args, **kwargs) with signals delivered at once inside it (see module doc);
    outside a deferred section, or off the main thread, simply calls it."""
    if _state.owner is None or _get_ident() != _main_ident:
        return fn(*args, **kwargs)
    _state.allowed = sys._getframe()
    _deliver_pending()  # a signal that arrived just before the window opens: raise now
    return fn(*args, **kwargs)
