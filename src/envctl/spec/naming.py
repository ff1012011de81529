"""Names envctl gives the kernel objects it makes for an environment (pure, no I/O).

Imports nothing of envctl's and nothing costly: the launch path (`exec`, `submit-job`) names
the systemd driver's slice with it."""

from __future__ import annotations

# The default name of envctl's parent cgroup / slice (ENVCTL_CGROUP_PARENT overrides it):
# envctl.facts's, which imports nothing of envctl's (tests/unit/test_layering.py checks that
# the two are the same).
DEFAULT_PARENT = "envctl"

IFNAMSIZ = 15  # usable characters of an interface name (16 bytes with the NUL)
VETH_PREFIX = "ve-"
TAG_PREFIX = "envctl:"


def short_hash(text: str, length: int = 5) -> str:
    import hashlib  # here: ~2 ms (OpenSSL) that the launch path never needs

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


# ---------------------------------------------------------------- systemd slices


def escape(text: str) -> str:
    """`systemd-escape TEXT`: keep [A-Za-z0-9:_.], '/' becomes '-', anything else (also '-')
    becomes \\xHH; a leading '.' is escaped too."""
    out = []
    for i, ch in enumerate(text):
        if ch == "/":
            out.append("-")
        elif (ch.isascii() and ch.isalnum()) or ch in ":_" or (ch == "." and i > 0):
            out.append(ch)
        else:
            out.extend(f"\\x{b:02x}" for b in ch.encode())
    return "".join(out)


def _label(name: str) -> str:
    # In a slice name '-' means "child of": envctl-cpu-compute.slice would sit under
    # envctl-cpu.slice. Like kubelet (pod UIDs), '-' becomes '_'; environment names are
    # [a-z0-9-], so this cannot make two of them collide. Anything else is escaped.
    return escape(name.replace("-", "_"))


def parent_slice(parent: str = DEFAULT_PARENT) -> str:
    """The slice every environment's slice sits in: `envctl.slice`."""
    return f"{_label(parent)}.slice"


def env_slice(env: str, parent: str = DEFAULT_PARENT) -> str:
    """An environment's slice: `envctl-cpu_compute.slice` for `cpu-compute`."""
    return f"{_label(parent)}-{_label(env)}.slice"


def slice_cgroup(env: str, parent: str = DEFAULT_PARENT) -> str:
    """The slice's cgroup, relative to a hierarchy's root: `envctl.slice/envctl-x.slice`."""
    return f"{parent_slice(parent)}/{env_slice(env, parent)}"
