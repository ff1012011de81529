"""The C library, opened once, for the calls Python's os module lacks (mount, unshare, setns,
syscall). `CDLL(None)` is dlopen(NULL): the libc this interpreter already runs on, without
`ctypes.util.find_library`, which runs `ldconfig -p` in a subprocess (~5 ms per call)."""

from __future__ import annotations

import ctypes

libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
