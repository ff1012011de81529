"""Parsers for the human-friendly quantities a spec may use: sizes, percentages, CPU lists."""

from __future__ import annotations

import re

# ASCII digits only: `\d` would also take digits of other scripts ('²'), which int() refuses.
_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([KMGTP]?)(i?)B?\s*$", re.IGNORECASE)
_PERCENT_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*%\s*$")
_MULT = {"": 0, "K": 1, "M": 2, "G": 3, "T": 4, "P": 5}


def parse_size(text: str | int | float) -> int:
    """Bytes from `1073741824`, `512M`, `16GiB` or `1.5G` (binary units, like systemd)."""
    if isinstance(text, bool):
        raise ValueError("expected a size such as 512M or 16G, got a boolean")
    if isinstance(text, float) and not text.is_integer():  # .nan and .inf included
        raise ValueError(f"'{text}' is not a whole number of bytes: add a unit, like 1.5G")
    if isinstance(text, int | float):
        if text < 0:
            raise ValueError("a size cannot be negative")
        return int(text)
    m = _SIZE_RE.match(str(text))
    if not m:
        raise ValueError(f"'{text}' is not a size: use bytes or a number with K, M, G, T or P")
    number, unit, _ = m.groups()
    if not unit and "." in number:
        raise ValueError(f"'{text}' is not a whole number of bytes: add a unit, like 1.5G")
    # Exact integer arithmetic (a float would round large sizes and overflow on long digit
    # strings), rounded down as int() of the exact value; not fractions.Fraction, whose import
    # (numbers, decimal) every command that reads a size would pay.
    whole, _, frac = number.partition(".")
    return int(whole + frac) * 1024 ** _MULT[unit.upper()] // 10 ** len(frac)


def parse_percent(text: str) -> float | None:
    """The number in `'70%'`, or None when the text is not a percentage."""
    m = _PERCENT_RE.match(str(text))
    return float(m.group(1)) if m else None


def parse_cpu_list(text: str | int | list[int], *, most: int | None = None,
                   what: str = "CPU") -> tuple[int, ...]:
    """CPU numbers from the kernel's list syntax (`0-3,8,10-11`), an int or a list of ints.

    `most` bounds each number, checked before a range is expanded (a spec's `0-999999999`
    would otherwise build a billion-item list); `what` names the numbers in errors."""
    if isinstance(text, bool):
        raise ValueError(f"expected {what} numbers, got a boolean")
    spans: list[tuple[int, int]] = []
    if isinstance(text, int):
        spans.append((text, text))
    elif isinstance(text, list):
        for x in text:
            spans.extend((n, n) for n in parse_cpu_list(x, most=most, what=what))
    else:
        for part in str(text).replace(" ", "").split(","):
            if not part:
                continue
            lo_s, dash, hi_s = part.partition("-")
            if dash and not (_digits(lo_s) and _digits(hi_s)):
                raise ValueError(f"'{part}' is not a {what} range like 2-5")
            if not dash and not _digits(part):
                raise ValueError(f"'{part}' is not a {what} number")
            lo, hi = int(lo_s), int(hi_s or lo_s)
            if lo > hi:
                raise ValueError(f"{what} range '{part}' runs backwards")
            spans.append((lo, hi))
    for lo, hi in spans:
        if lo < 0:
            raise ValueError(f"{what} numbers cannot be negative")
        if most is not None and hi > most:
            raise ValueError(f"{what} numbers run from 0 to {most}, not {_short(hi)}")
    items = [n for lo, hi in spans for n in range(lo, hi + 1)]
    if len(set(items)) != len(items):
        raise ValueError(f"a {what} is listed twice")
    return tuple(sorted(items))


def _digits(text: str) -> bool:
    return text.isascii() and text.isdigit()


def _short(n: int) -> str:
    text = str(n)
    return text if len(text) <= 20 else text[:17] + "..."


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
