"""Names envctl gives the kernel objects it makes for an environment (pure, no I/O)."""

from __future__ import annotations

import hashlib

IFNAMSIZ = 15  # usable characters of an interface name (16 bytes with the NUL)
VETH_PREFIX = "ve-"
TAG_PREFIX = "envctl:"


def short_hash(text: str, length: int = 5) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:length]


def host_veth(env: str) -> str:
    """Host side of the environment's veth pair: `ve-` + up to 6 characters of the name + `-` +
    5 hex digits of its hash, so names sharing a prefix (`gpu-compute-a`, `gpu-compute-b`) never
    collide and every name fits IFNAMSIZ."""
    head = env[: IFNAMSIZ - len(VETH_PREFIX) - 6].rstrip("-")
    return f"{VETH_PREFIX}{head}-{short_hash(env)}"


def rule_tag(env: str) -> str:
    """The tag that opens the comment of every firewall rule made for `env`."""
    return f"{TAG_PREFIX}{env}"


def env_of_comment(comment: str | None) -> str | None:
    """The environment a rule comment names, or None for a rule envctl did not tag."""
    if not comment or not comment.startswith(TAG_PREFIX):
        return None
    return comment[len(TAG_PREFIX):].split(" ", 1)[0] or None
