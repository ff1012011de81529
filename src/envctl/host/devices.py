"""Device rules whose major is named, not numbered ("c nvidia-uvm:0 rw"): resolved from
/proc/devices when a step runs, because drivers such as nvidia-uvm get a dynamic major that is
known only once the module is loaded (possibly by the same `up`) and may change at reboot."""

from __future__ import annotations

from pathlib import Path

from envctl.errors import HostError


def char_majors(proc: Path) -> dict[str, int]:
    """Character-device driver name -> major, from `proc`/devices ({} when unreadable)."""
    try:
        return parse_char_majors((proc / "devices").read_text())
    except OSError:
        return {}


def parse_char_majors(text: str) -> dict[str, int]:
    """Character-device driver name -> major of a /proc/devices text, in its order (the first
    major of a name wins); the block section is never read."""
    out: dict[str, int] = {}
    chars = False
    for line in text.splitlines():
        if line.startswith("Character"):
            chars = True
        elif line.startswith("Block"):
            chars = False
        elif chars and len(parts := line.split()) == 2 and parts[0].isdigit():
            out.setdefault(parts[1], int(parts[0]))
    return out


def is_named(rule: str) -> bool:
    major = rule.split()[1].split(":")[0]
    return not (major.isdigit() or major == "*")


def resolve_rules(rules: tuple[str, ...], proc: Path) -> tuple[str, ...]:
    """`rules` with every named major replaced by its number; HostError naming the driver when
    /proc/devices does not list it (its module is not loaded)."""
    if not any(is_named(r) for r in rules):
        return rules
    majors = char_majors(proc)
    out = []
    for rule in rules:
        if is_named(rule):
            kind, numbers, access = rule.split()
            name, minor = numbers.split(":")
            if name not in majors:
                raise HostError(f"device '{name}' is not in {proc}/devices: its driver is not "
                                f"loaded (modprobe {name.replace('-', '_')}, or list it in "
                                "host.modules)")
            rule = f"{kind} {majors[name]}:{minor} {access}"
        out.append(rule)
    return tuple(out)
