"""The choice of firewall backend (nftables or iptables) and one adapter per host and backend
(plus `nftables-bridge`, envctl's bridge-family table, which every backend uses for
anti-spoofing where nft is installed)."""

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
    if nft_installed():
        return "nftables"
    return "iptables"


def nft_installed() -> bool:
    """Whether nftables can be driven here: the `nft` command or libnftables is installed.
    (The fact anti-spoofing planning needs, `HostFacts.extra["nft"]`, whatever the backend.)"""
    return bool(shutil.which("nft")) or any(os.path.exists(f"{d}/libnftables.so.1")
                                            for d in LIB_DIRS)


LIB_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib")


_ADAPTERS: dict[tuple[int, str], object] = {}


def adapter(host: object, backend: str):  # noqa: ANN201 - the backends import lazily
    """One adapter per host handle and backend."""
    key = (id(host), backend)
    if key not in _ADAPTERS:
        if backend in ("nftables", "nftables-bridge"):
            from envctl.host.nft import BridgeNftables, Nftables, NftTable

            table = Nftables() if backend == "nftables" else BridgeNftables()
            other = _ADAPTERS.get((id(host), "nftables-bridge" if backend == "nftables"
                                   else "nftables"))
            if isinstance(other, NftTable):
                table.link(other)  # one ruleset generation counts both tables' transactions
            _ADAPTERS[key] = table
        elif backend == "iptables":
            from envctl.host.iptables import Iptables

            _ADAPTERS[key] = Iptables()
        else:
            raise ValueError(f"unknown firewall backend {backend!r}")
    return _ADAPTERS[key]
