"""The choice of firewall backend (nftables or iptables) and one adapter per host and backend."""

from __future__ import annotations

import os
import shutil

BACKENDS = ("nftables", "iptables")


def detect_backend(environ: dict[str, str] | os._Environ[str] = os.environ) -> str:
    """The backend `auto` means here: $ENVCTL_FIREWALL if set, nftables when `nft` (or its
    library) is installed, else iptables (legacy xtables through python-iptables)."""
    forced = environ.get("ENVCTL_FIREWALL", "")
    if forced in BACKENDS:
        return forced
    if shutil.which("nft") or any(os.path.exists(f"{d}/libnftables.so.1") for d in LIB_DIRS):
        return "nftables"
    return "iptables"


LIB_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib")


_ADAPTERS: dict[tuple[int, str], object] = {}


def adapter(host: object, backend: str):  # noqa: ANN201 - the backends import lazily
    """One adapter per host handle and backend."""
    key = (id(host), backend)
    if key not in _ADAPTERS:
        if backend == "nftables":
            from envctl.host.nft import Nftables

            _ADAPTERS[key] = Nftables()
        elif backend == "iptables":
            from envctl.host.iptables import Iptables

            _ADAPTERS[key] = Iptables()
        else:
            raise ValueError(f"unknown firewall backend {backend!r}")
    return _ADAPTERS[key]
