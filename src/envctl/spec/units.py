"""Parsers for the human-friendly quantities a spec may use: sizes, percentages, CPU lists."""

from __future__ import annotations

import re

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGTP]?)(i?)B?\s*$", re.IGNORECASE)
_PERCENT_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*%\s*$")
_MULT = {"": 0, "K": 1, "M": 2, "G": 3, "T": 4, "P": 5}


def parse_size(text: str | int) -> int:
    """Bytes from `1073741824`, `512M`, `16GiB` or `1.5G` (binary units, like systemd)."""
    if isinstance(text, bool):
        raise ValueError("expected a size such as 512M or 16G, got a boolean")
    if isinstance(text, int):
        if text < 0:
            raise ValueError("a size cannot be negative")
        return text
    m = _SIZE_RE.match(str(text))
    if not m:
        raise ValueError(f"'{text}' is not a size: use bytes or a number with K, M, G, T or P")
    number, unit, _ = m.groups()
    return int(float(number) * 1024 ** _MULT[unit.upper()])


def parse_percent(text: str) -> float | None:
    """The number in `'70%'`, or None when the text is not a percentage."""
    m = _PERCENT_RE.match(str(text))
    return float(m.group(1)) if m else None


def parse_cpu_list(text: str | int | list[int]) -> tuple[int, ...]:
    """CPU numbers from the kernel's list syntax (`0-3,8,10-11`), an int or a list of ints."""
    if isinstance(text, bool):
        raise ValueError("expected CPU numbers, got a boolean")
    if isinstance(text, int):
        items = [text]
    elif isinstance(text, list):
        items = []
        for x in text:
            items.extend(parse_cpu_list(x))
    else:
        items = []
        for part in str(text).replace(" ", "").split(","):
            if not part:
                continue
            if "-" in part:
                lo_s, _, hi_s = part.partition("-")
                if not (lo_s.isdigit() and hi_s.isdigit()):
                    raise ValueError(f"'{part}' is not a CPU range like 2-5")
                lo, hi = int(lo_s), int(hi_s)
                if lo > hi:
                    raise ValueError(f"CPU range '{part}' runs backwards")
                items.extend(range(lo, hi + 1))
            elif part.isdigit():
                items.append(int(part))
            else:
                raise ValueError(f"'{part}' is not a CPU number")
    for cpu in items:
        if cpu < 0:
            raise ValueError("CPU numbers cannot be negative")
    if len(set(items)) != len(items):
        raise ValueError("a CPU is listed twice")
    return tuple(sorted(items))


def format_cpu_list(cpus: tuple[int, ...] | list[int]) -> str:
    """The kernel's compact list syntax for a set of CPUs: (0,1,2,5) -> '0-2,5'."""
    out: list[str] = []
    cpus = sorted(cpus)
    i = 0
    while i < len(cpus):
        j = i
        while j + 1 < len(cpus) and cpus[j + 1] == cpus[j] + 1:
            j += 1
        out.append(str(cpus[i]) if i == j else f"{cpus[i]}-{cpus[j]}")
        i = j + 1
    return ",".join(out)


def format_size(n: int) -> str:
    """A short binary-unit rendering of a byte count, for plans and status."""
    value = float(n)
    for unit in ("", "K", "M", "G", "T"):
        if value < 1024 or unit == "T":
            break
        value /= 1024
    text = f"{value:.1f}".removesuffix(".0")
    return f"{text}{unit}"
