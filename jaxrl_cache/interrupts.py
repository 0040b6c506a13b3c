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
"""
from __future__ import annotations

import signal
import threading

_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class _State:
    owner = None  # the outermost open section (main thread only)
    saved: dict = {}  # signal -> handler to restore
    pending: list = []  # (signum, frame) received while deferred


_state = _State()


def _record(signum, frame):
    _state.pending.append((signum, frame))


def _install(owner) -> None:
    _state.owner, _state.saved, _state.pending = owner, {}, []
    for sig in _SIGNALS:
        handler = signal.getsignal(sig)
        if callable(handler) and handler is not _record:
            _state.saved[sig] = handler
            signal.signal(sig, _record)


def _uninstall() -> list:
    """Restores the handlers; returns the signals recorded meanwhile with their handlers."""
    saved, pending = _state.saved, _state.pending
    _state.owner = None
    for sig, handler in saved.items():
        signal.signal(sig, handler)
    return [(saved.get(signum), signum, frame) for signum, frame in pending]


class deferred_signals:
    """`with deferred_signals(): ...` runs the body with SIGINT/SIGTERM deferred (see module)."""

    def __enter__(self):
        if _state.owner is not None or threading.current_thread() is not threading.main_thread():
            return self
        try:
            _install(self)
        except BaseException:
            _uninstall()
            raise
        return self

    def __exit__(self, *exc) -> bool:
        if _state.owner is self:
            for handler, signum, frame in _uninstall():
                if callable(handler):
                    handler(signum, frame)
        return False
