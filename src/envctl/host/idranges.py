"""The host's user and group ids in use: every uid of /etc/passwd, gid of /etc/group and range
of /etc/subuid and /etc/subgid, which no environment's user namespace may overlap; and, for
the id an environment's root is, the users and groups the name service knows (LDAP, SSSD:
their ranges may cover envctl's pool, and are not in /etc/passwd).

Read-only; a missing file is an empty one (a host without subordinate ids)."""

from __future__ import annotations

from pathlib import Path

# (first id, one past the last, what holds them): "uid 1000 (alice)", "/etc/subuid alice".
IdRange = tuple[int, int, str]


def host_id_ranges(etc: Path = Path("/etc")) -> tuple[IdRange, ...]:
    """The ids the host's users, groups and subordinate ranges hold, sorted."""
    out: list[IdRange] = []
    for name, kind in (("passwd", "uid"), ("group", "gid")):
        for fields in _lines(etc / name):
            if len(fields) > 2 and fields[2].isdigit():
                n = int(fields[2])
                out.append((n, n + 1, f"{kind} {n} ({fields[0]})"))
    for name in ("subuid", "subgid"):
        for fields in _lines(etc / name):
            if len(fields) == 3 and fields[1].isdigit() and fields[2].isdigit():
                lo = int(fields[1])
                out.append((lo, lo + int(fields[2]), f"/etc/{name} range of {fields[0]}"))
    return tuple(sorted(out))


def _lines(path: Path) -> list[list[str]]:
    try:
        text = path.read_text(errors="replace")
    except (FileNotFoundError, NotADirectoryError):
        return []
    return [line.split(":") for line in text.splitlines()
            if line.strip() and not line.startswith("#")]


def nss_holder(n: int) -> str | None:
    """Who holds id `n` as the name service (NSS: files, LDAP, SSSD, …) answers: "uid N
    (name)" or "gid N (name)", or None. One lookup each: a directory-joined host's users are
    not in /etc/passwd, and its ranges (SSSD's 200000-2000200000) may cover envctl's pool."""
    import grp
    import pwd

    try:
        return f"uid {n} ({pwd.getpwuid(n).pw_name}, from the name service)"
    except (KeyError, OverflowError):
        pass
    try:
        return f"gid {n} ({grp.getgrgid(n).gr_name}, from the name service)"
    except (KeyError, OverflowError):
        return None
