"""The C library, opened once, for the calls Python's os module lacks (mount, unshare, setns,
syscall), and the signal mask a thread holds while it is in another namespace. `CDLL(None)` is
dlopen(NULL): the libc this interpreter already runs on, without `ctypes.util.find_library`,
which runs `ldconfig -p` in a subprocess (~5 ms per call)."""

from __future__ import annotations

import contextlib
import ctypes
import signal
from collections.abc import Iterator

libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long

# Every signal a thread can hold back: not SIGKILL and SIGSTOP (the kernel never blocks them),
# nor the faults it raises for the instruction just run (blocked, they kill the process at once
# instead of reaching faulthandler or a debugger).
_HELD = signal.valid_signals() - {
    signal.SIGKILL, signal.SIGSTOP, signal.SIGSEGV, signal.SIGBUS, signal.SIGFPE, signal.SIGILL,
    signal.SIGTRAP, signal.SIGSYS}


@contextlib.contextmanager
def signals_held() -> Iterator[None]:
    """Block signals in this thread for the block, then restore the mask it found.

    For a thread that enters another namespace and comes back: Python runs a signal's handler
    (KeyboardInterrupt, a SIGTERM handler that raises) between any two bytecodes, and one that
    ran while the thread is away would leave it there, where rollback would act on the wrong
    host. Held, a signal stays pending and is delivered when the mask is restored: at home,
    raised from the end of the block."""
    # The mask as it is first, changing nothing: CPython runs handlers already due after it
    # changes a mask, so the call that blocks may itself raise, after blocking.
    old = signal.pthread_sigmask(signal.SIG_BLOCK, ())
    try:
        signal.pthread_sigmask(signal.SIG_BLOCK, _HELD)
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)
