"""Reading spec files: YAML with line marks, validation, errors naming file, line and field."""

from __future__ import annotations

import copy
import dataclasses
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml
from pydantic import BaseModel, ValidationError

from envctl.errors import Problem, SpecError
from envctl.spec.models import EnvSpec, FieldFault
from envctl.spec.surprises import surprises

if TYPE_CHECKING:
    from envctl.facts import HostFacts

Loc = tuple[str | int, ...]


@dataclass(frozen=True)
class LoadedSpec:
    """A validated spec plus where each of its values came from.

    A `partial` one is what is left of an invalid spec once the values with errors are taken
    out (`dropped`, at their places in the file): it is never planned, only checked against
    the others, so that one run reports a spec's conflicts together with its field errors."""

    spec: EnvSpec
    path: str
    marks: dict[Loc, tuple[int, int]] = field(default_factory=dict, compare=False, repr=False)
    # Values that are valid but rarely mean what they say (`quota: 1.5`): see spec.surprises.
    warnings: tuple[Problem, ...] = field(default=(), compare=False)
    partial: bool = field(default=False, compare=False)
    dropped: frozenset[Loc] = field(default=frozenset(), compare=False, repr=False)
    # list in the file (by its place there) -> the places of the items kept, when some were
    # dropped: the spec's list indices are renumbered, the file's are not.
    kept: dict[Loc, tuple[int, ...]] = field(default_factory=dict, compare=False, repr=False)

    def problem(self, loc: Loc, message: str) -> Problem:
        """A Problem pointing at the closest recorded position of `loc` in this file."""
        loc = self.in_file(loc)
        line, col = _nearest_mark(self.marks, loc)
        return Problem(self.path, line, col, _dotted(loc), message)

    def in_file(self, loc: Loc) -> Loc:
        """`loc` of the spec as the place in the file (list items dropped renumber the rest)."""
        return _in_file(self.kept, loc)

    def knows(self, *locs: Loc) -> bool:
        """Whether the values at `locs` are the file's own: not dropped (nor a default
        standing in for a dropped value), nor containing a dropped value."""
        for loc in locs:
            place = self.in_file(loc)
            for gone in self.dropped:
                n = min(len(gone), len(place))
                if gone[:n] == place[:n]:
                    return False
        return True


def _in_file(kept: dict[Loc, tuple[int, ...]], loc: Loc) -> Loc:
    out: Loc = ()
    for part in loc:
        if isinstance(part, int) and out in kept and 0 <= part < len(kept[out]):
            part = kept[out][part]
        out += (part,)
    return out


def _dotted(loc: Loc) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _nearest_mark(marks: dict[Loc, tuple[int, int]], loc: Loc) -> tuple[int | None, int | None]:
    for n in range(len(loc), -1, -1):
        if loc[:n] in marks:
            return marks[loc[:n]]
    return None, None


# A spec is a few hundred values. YAML aliases repeat a node without repeating its text, so
# ten levels of ten aliases each make ten billion values from a few hundred bytes.
MAX_VALUES = 100_000


class _Unbuildable(Exception):
    """The YAML cannot become plain data: it refers to itself or expands past MAX_VALUES."""

    def __init__(self, message: str, node: yaml.Node):
        super().__init__(message)
        self.at = (node.start_mark.line + 1, node.start_mark.column + 1)


NULL_TAG = "tag:yaml.org,2002:null"


class _Builder:
    """Turns a composed YAML node tree into plain data, remembering each value's position."""

    def __init__(self, path: str):
        self.path = path
        self.marks: dict[Loc, tuple[int, int]] = {}
        self.key_marks: dict[Loc, tuple[int, int]] = {}
        # The source text of each plain (unquoted) scalar: what YAML 1.1 read as a boolean or a
        # number where a string was meant (`yes`, `on`, `1e3`, `3.10`) is named as written.
        self.plain: dict[Loc, str] = {}
        self.problems: list[Problem] = []
        self._constructor = yaml.SafeLoader("")
        self._budget = MAX_VALUES
        self._open: set[int] = set()  # collections being built: an alias to one is a cycle

    def build(self, node: yaml.Node, loc: Loc = ()) -> Any:
        self.marks[loc] = (node.start_mark.line + 1, node.start_mark.column + 1)
        self._budget -= 1
        if self._budget < 0:
            raise _Unbuildable(f"the spec expands to more than {MAX_VALUES} values (YAML "
                               "aliases repeat what they refer to); write the values out", node)
        if isinstance(node, yaml.MappingNode | yaml.SequenceNode):
            if id(node) in self._open:
                raise _Unbuildable("a YAML alias refers to a value that contains itself", node)
            self._open.add(id(node))
            try:
                return self._build_collection(node, loc)
            finally:
                self._open.discard(id(node))
        if isinstance(node, yaml.ScalarNode) and not node.style:  # None, or "" (libyaml)
            self.plain[loc] = node.value
            if len(loc) == 3 and loc[:2] == ("rootfs", "env") and node.tag != NULL_TAG:
                # An environment variable's value is text, written to /etc/environment as
                # typed: `DEBUG: on` is "on" and `VERSION: 3.10` is "3.10", never YAML 1.1's
                # boolean true or the number 3.1.
                return node.value
        return self._constructor.construct_object(node, deep=True)

    def _build_collection(self, node: yaml.Node, loc: Loc) -> Any:
        if isinstance(node, yaml.MappingNode):
            out: dict[Any, Any] = {}
            for key_node, value_node in node.value:
                key = self._constructor.construct_object(key_node, deep=True)
                if isinstance(key, list | dict):
                    self._problem(key_node, loc, "a mapping key must be a plain value")
                    continue
                if key in out:
                    self._problem(key_node, loc + (key,), f"key '{key}' appears twice")
                    continue
                self.key_marks[loc + (key,)] = (key_node.start_mark.line + 1,
                                                key_node.start_mark.column + 1)
                out[key] = self.build(value_node, loc + (key,))
            return out
        return [self.build(item, loc + (i,)) for i, item in enumerate(node.value)]

    def _problem(self, node: yaml.Node, loc: Loc, message: str) -> None:
        self.problems.append(Problem(self.path, node.start_mark.line + 1,
                                     node.start_mark.column + 1, _dotted(loc), message))


def _allowed_fields(model: type[BaseModel], loc: tuple[Any, ...]) -> list[str] | None:
    """Field names allowed at `loc` (pydantic's location of the parent of an unknown key,
    union tags included), walking the model tree: a tag picks its branch of a union
    (`dedicated`'s NearGpuCpus or ReservedCpus), else the union's first model."""
    current: Any = model
    for part in loc:
        if isinstance(part, int):
            continue
        tagged = _model_named(current, str(part))
        if tagged is not None:
            current = tagged
            continue
        if not _clean_loc((part,)):
            continue  # another tag pydantic adds (a validator's, a union branch's)
        found = current if isinstance(current, type) and issubclass(current, BaseModel) \
            else _first_model(current)
        info = found.model_fields.get(str(part)) if found is not None else None
        if info is None:
            return None
        current = info.annotation
    found = current if isinstance(current, type) and issubclass(current, BaseModel) \
        else _first_model(current)
    return sorted(found.model_fields) if found is not None else None


def _model_named(annotation: Any, name: str) -> Any:
    """The model named `name` among the members of the union `annotation` (None if none)."""
    for arg in getattr(annotation, "__args__", ()) or ():
        if isinstance(arg, type) and issubclass(arg, BaseModel) and arg.__name__ == name:
            return arg
        found = _model_named(arg, name)
        if found is not None:
            return found
    return None


def _first_model(annotation: Any) -> Any:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in getattr(annotation, "__args__", ()) or ():
        found = _first_model(arg)
        if found is not None:
            return found
    return None


def _clean_loc(loc: tuple[Any, ...]) -> Loc:
    # pydantic adds union-branch and validator tags to locations; keep only the data path.
    out: list[str | int] = []
    for part in loc:
        if isinstance(part, int) or isinstance(part, str) and not (
            "[" in part or part.startswith(("function-", "tagged-union")) or part in
            ("tuple[int, ...]", "ReservedCpus", "NearGpuCpus", "constrained-str", "str", "int",
             "float")
        ):
            out.append(part)
    return tuple(out)


def _findings(err: dict[str, Any]) -> list[tuple[Loc, str | None]]:
    """(location, own message or None) for one pydantic error: a FieldFault holds findings
    about entries below the value its validator checked, each at its own place."""
    loc = _clean_loc(err["loc"])
    fault = (err.get("ctx") or {}).get("error")
    if isinstance(fault, FieldFault):
        return [(loc + tuple(at), message) for at, message in fault.faults]
    return [(loc, None)]


def _message(err: dict[str, Any], loc: Loc, plain: dict[Loc, str] | None = None) -> str:
    kind = err["type"]
    msg = err["msg"]
    value = err.get("input")
    raw = (plain or {}).get(loc)
    if kind == "string_type" and raw is not None and isinstance(value, bool | int | float):
        # YAML 1.1 reads yes/no/on/off/true/false as booleans and 1e3, 3.10 as numbers.
        what = (f"the boolean {str(value).lower()}" if isinstance(value, bool)
                else f"the number {value}")
        return (f"expected a string, but YAML read {raw} as {what}; quote it (\"{raw}\") to "
                "keep it as written")
    if kind == "extra_forbidden":
        allowed = _allowed_fields(EnvSpec, tuple(err["loc"])[:-1])
        text = f"unknown field '{loc[-1]}'"
        return text + (f"; allowed here: {', '.join(allowed)}" if allowed else "")
    if kind == "missing":
        return "this field is required"
    if kind == "string_pattern_mismatch" and loc and loc[-1] == "name" and len(loc) == 1:
        return ("must be 1-32 characters of a-z, 0-9 and '-', start with a letter and not end "
                "with '-' (it names the netns, the cgroup and the hostname)")
    if kind == "string_pattern_mismatch" and "^[A-Za-z0-9_.-]{1,15}$" in msg:
        return "must be a network interface name: 1-15 characters of A-Z, a-z, 0-9, '_', '.', '-'"
    msg = msg.removeprefix("Value error, ").removeprefix("Assertion failed, ")
    return msg


# libyaml's parser (PyYAML's C binding) when PyYAML was built with it: ~15x faster than the
# pure-Python one, with the same nodes and marks. Values are still built by _Builder.
_COMPOSER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def _tab_at(text: str, line: int, column: int) -> bool:
    """Whether the YAML error at (line, column), 0-based, is a tab in the line's indentation."""
    lines = text.splitlines()
    if not 0 <= line < len(lines):
        return False
    indent = lines[line][:len(lines[line]) - len(lines[line].lstrip(" \t"))]
    return "\t" in indent and column <= len(indent)


def parse_spec(text: str, path: str) -> LoadedSpec:
    """Validate one spec's YAML text; raise SpecError listing every problem in it."""
    try:
        nodes = list(yaml.compose_all(text, Loader=_COMPOSER))
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
        line = mark.line + 1 if mark else None
        col = mark.column + 1 if mark else None
        reason = getattr(exc, "problem", None) or str(exc)
        if mark is not None and _tab_at(text, mark.line, mark.column):
            reason = ("a tab in the indentation: YAML indents with spaces only; replace the "
                      "tab with spaces")
        raise SpecError([Problem(path, line, col, "", f"YAML syntax error: {reason}")]) from None
    nodes = [n for n in nodes if n is not None]
    if len(nodes) != 1:
        what = "is empty" if not nodes else "holds several YAML documents"
        raise SpecError([Problem(path, 1, 1, "", f"file {what}: one environment per file")])
    builder = _Builder(path)
    try:
        data = builder.build(nodes[0])
    except _Unbuildable as exc:
        raise SpecError([Problem(path, *exc.at, "", str(exc))]) from None
    if not isinstance(data, dict):
        raise SpecError([Problem(path, 1, 1, "", "a spec is a mapping with name, kind, …")])
    marks = {**builder.marks, **{k: v for k, v in builder.key_marks.items()}}
    problems = list(builder.problems)
    warnings = tuple(Problem(path, *_nearest_mark(marks, loc), _dotted(loc), message)
                     for loc, message in surprises(data))
    try:
        spec = EnvSpec.model_validate(data)
    except ValidationError as exc:
        errors = exc.errors()
        for err in errors:
            for loc, own in _findings(err):
                line, col = _nearest_mark(marks, loc)
                problems.append(Problem(path, line, col, _dotted(loc),
                                        own or _message(err, loc, builder.plain)))
        raise SpecError(problems, warnings=warnings,
                        partial=_salvage(data, errors, path, marks, warnings)) from None
    loaded = LoadedSpec(spec, path, marks, warnings)
    if problems:
        raise SpecError(problems, warnings=warnings, partial=dataclasses.replace(
            loaded, partial=True))
    return loaded


# A spec with errors at every level of nesting is rebuilt a few times at most: each round
# takes out every value the last one refused.
SALVAGE_ROUNDS = 12


def _salvage(data: dict[str, Any], errors: list[dict[str, Any]], path: str,
             marks: dict[Loc, tuple[int, int]],
             warnings: tuple[Problem, ...]) -> LoadedSpec | None:
    """What is left of an invalid spec without the values it has errors in, validated; None
    when nothing useful is (its name or kind is wrong). Conflicts with other specs are checked
    on it, so that they are reported in the same run as the field errors."""
    data = copy.deepcopy(data)
    dropped: set[Loc] = set()
    kept: dict[Loc, tuple[int, ...]] = {}
    for _ in range(SALVAGE_ROUNDS):
        progress = False
        # Deepest first, and list items from the last: removing one renumbers only later ones.
        places = sorted({_at_error(err, loc) for err in errors for loc, _ in _findings(err)},
                        key=lambda loc: (len(loc), loc[-1] if loc and isinstance(loc[-1], int)
                                         else -1), reverse=True)
        for loc in places:
            if _drop(data, loc, kept, dropped):
                progress = True
        if not progress:
            return None
        try:
            spec = EnvSpec.model_validate(data)
        except ValidationError as exc:
            errors = exc.errors()
            continue
        return LoadedSpec(spec, path, marks, warnings, partial=True,
                          dropped=frozenset(dropped), kept=dict(kept))
    return None


def _at_error(err: dict[str, Any], loc: Loc) -> Loc:
    # A required value that is missing cannot be taken out: the value holding it goes.
    return loc[:-1] if err["type"] == "missing" else loc


def _stand_in_address(bridge: Any) -> str | None:
    import ipaddress

    from envctl.spec.models import Network

    try:
        iface = ipaddress.IPv4Interface(bridge if bridge is not None else
                                        Network.model_fields["bridge_address"].default)
    except (ValueError, TypeError):
        return None
    return next((str(h) for h in iface.network.hosts() if h != iface.ip), None)


def _drop(data: Any, loc: Loc, kept: dict[Loc, tuple[int, ...]], dropped: set[Loc]) -> bool:
    """Take the value at `loc` (as the spec is now) out of `data`, or the deepest value on the
    way there; record its place in the file. False when that would be the whole spec, or one
    of the values without which nothing else means anything (name, kind)."""
    node, place, parent, key = data, (), None, None
    for part in loc:
        if isinstance(node, dict) and part in node:
            parent, key, node, place = node, part, node[part], place + (part,)
        elif isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node):
            in_file = kept.get(place, tuple(range(len(node))))[part]
            parent, key, node, place = node, part, node[part], place + (in_file,)
        else:
            break
    if parent is None or place in (("name",), ("kind",)):
        return False
    if place == ("network", "address") and place not in dropped:
        # Required: without one the whole network section (its ports, its bridge) would go
        # too. A stand-in takes its place; being dropped, it is never claimed.
        stand_in = _stand_in_address(parent.get("bridge_address"))
        if stand_in is not None:
            parent[key] = stand_in
            dropped.add(place)
            return True
    if isinstance(parent, list):
        where = place[:-1]
        kept[where] = tuple(i for i in kept.get(where, range(len(parent))) if i != place[-1])
    del parent[key]
    dropped.add(place)
    return True


def load_spec(path: str | os.PathLike[str]) -> LoadedSpec:
    """Read and validate one spec file."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise SpecError([Problem(str(p), None, None, "", f"cannot read: {exc.strerror}")]) from None
    return parse_spec(text, str(p))


def spec_files(directory: str | os.PathLike[str]) -> list[Path]:
    d = Path(directory)
    return sorted(p for p in d.iterdir() if p.suffix in (".yaml", ".yml") and p.is_file())


def unsafe_spec_paths(paths: list[Path]) -> list[Problem]:
    """Spec files, their directory and its ancestors that someone other than root could
    change (changeable_by_others). Checked only when running as root, which is when it
    matters."""
    if os.geteuid() != 0:
        return []
    return [Problem(str(path), None, None, "", (
        f"{q} {why}: envctl reads host settings (sysctls, kernel modules) from specs as root, "
        f"so only root may be able to change them; chown root and chmod go-w {q}"))
        for path, q, why in changeable_by_others(paths)]


def changeable_by_others(paths: list[Path], *, trusted: frozenset[int] = frozenset({0})
                         ) -> list[tuple[Path, Path, str]]:
    """For each of `paths` that someone whose uid is not in `trusted` could change: (the path
    given, the first file or directory on the way to it that lets them, why). On the way:
    the path, every directory above it, and every symlink met resolving it and where each
    leads (_walked). Changeable: owned by an untrusted uid, or writable by group or others (a
    world-writable directory with the sticky bit, such as /tmp, is fine above a trusted
    entry: nobody else can replace that entry). Paths that do not exist are skipped."""
    out: list[tuple[Path, Path, str]] = []
    seen: set[Path] = set()
    for path, p in ((given, q) for given in paths for q in _walked(given.absolute())):
        chain = [p, *p.parents]
        for i, q in enumerate(chain):
            if q in seen:
                break
            seen.add(q)
            try:
                st = os.stat(q)
            except OSError:
                continue
            sticky_dir = stat.S_ISDIR(st.st_mode) and st.st_mode & stat.S_ISVTX
            why = ""
            if st.st_uid not in trusted:
                why = f"is owned by uid {st.st_uid}, not root"
            elif st.st_mode & 0o022 and not (sticky_dir and i > 0):
                who = " and ".join(w for w, bit in (("group", 0o020), ("others", 0o002))
                                   if st.st_mode & bit)
                why = f"is writable by {who} (mode {stat.S_IMODE(st.st_mode):04o})"
            if why:
                out.append((path, q, why))
                break
    return out


def _walked(path: Path) -> list[Path]:
    """`path` and every path that resolving it goes through: each symlink met on the way (at
    any component, a link's target resolved the same way in turn) and where it leads, so that
    a link in a root-owned directory pointing into a directory someone else owns is seen (its
    target's directory, and any link on the way there, is checked as the path itself is).
    At most 40 links are followed, as the kernel does (ELOOP)."""
    out = [path]
    parts = list(path.parts[1:])
    here = Path("/")
    links = 0
    while parts:
        name = parts.pop(0)
        if name in ("", "."):
            continue
        if name == "..":
            here = here.parent
            continue
        nxt = here / name
        try:
            target = os.readlink(nxt)
        except OSError:  # not a link, or not there: go on below it
            here = nxt
            continue
        links += 1
        if links > 40:
            break
        out.append(nxt)
        if os.path.isabs(target):
            here = Path("/")
        parts = list(Path(target).parts[1:] if os.path.isabs(target) else
                     Path(target).parts) + parts
    if links:
        out.append(here)
    return out


@dataclass
class Loaded:
    """Several spec files, each validated on its own."""

    specs: list[LoadedSpec]  # the valid ones
    # Valid and partial (what is left of an invalid one), in file order: what conflicts
    # between specs are checked on, so that they come in the same run as field errors.
    checked: list[LoadedSpec]
    problems: list[Problem]
    warnings: list[Problem]


def read_each(paths: list[Path]) -> Loaded:
    """Validate each file on its own: the specs that are valid, and every problem of the rest."""
    out = Loaded([], [], [], [])
    for p in paths:
        try:
            ls = load_spec(p)
        except SpecError as exc:
            out.problems.extend(exc.problems)
            out.warnings.extend(exc.warnings)
            if isinstance(exc.partial, LoadedSpec):
                out.checked.append(exc.partial)
            continue
        out.specs.append(ls)
        out.checked.append(ls)
        out.warnings.extend(ls.warnings)
    return out


def load_each(paths: list[Path]) -> tuple[list[LoadedSpec], list[Problem]]:
    """Validate each file on its own: the specs that are valid, and every problem of the rest."""
    loaded = read_each(paths)
    return loaded.specs, loaded.problems


def load_specs(paths: list[Path], facts: HostFacts | None = None) -> list[LoadedSpec]:
    """Validate several files together: every problem of every file, then every conflict."""
    from envctl.spec.conflicts import find_conflicts

    loaded = read_each(paths)
    problems = loaded.problems + find_conflicts(loaded.checked, facts)
    if problems:
        raise SpecError(problems, warnings=tuple(loaded.warnings))
    return loaded.specs
