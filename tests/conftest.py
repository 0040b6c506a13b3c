"""pytest-xdist starts its workers with SIGINT ignored; the interrupt tests (like users'
programs) run under Python's default handler, which raises KeyboardInterrupt."""
import signal
import threading

if threading.current_thread() is threading.main_thread() and \
        signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)
