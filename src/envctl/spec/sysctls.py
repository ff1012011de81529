"""Sysctl names: one spelling per kernel value, so aliases share one ledger key and one check.

Pure: used by the planner, the conflict check and the /proc/sys adapter alike.
"""

from __future__ import annotations

# Names that are the same kernel variable, each mapped to the spelling envctl uses. In
# net/ipv4/devinet.c `ip_forward` points at the very int behind `conf/all/forwarding`: writing
# either changes both (checked on this kernel). `conf/default/forwarding` is not an alias: a
# write to ip_forward copies into it, but it has its own value.
ALIASES = {
    "net.ipv4.conf.all.forwarding": "net.ipv4.ip_forward",
}

_SWAP = str.maketrans("./", "/.")


def dotted(name: str) -> str:
    """`name` with '.' separators. sysctl(8) takes both spellings: when the first separator is
    '/', dots and slashes trade places (net/ipv4/conf/eth0.100/rp_filter is
    net.ipv4.conf.eth0/100.rp_filter: the '/' stands for a dot inside an interface name)."""
    first = next((c for c in name if c in "./"), ".")
    return name.translate(_SWAP) if first == "/" else name


def canonical(name: str) -> str:
    """The one spelling of the kernel value `name` names: dotted, aliases resolved."""
    name = dotted(name)
    return ALIASES.get(name, name)


def proc_path(name: str) -> str:
    """Where `name` lives under /proc/sys (relative): the canonical name, separators as '/'."""
    return canonical(name).translate(_SWAP)
