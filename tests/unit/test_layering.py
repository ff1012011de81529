"""The house rules, checked: one direction of imports, no import cycles, and a planner that
provably touches nothing on the host."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"


def _module_name(path: Path) -> str:
    rel = path.relative_to(SRC).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(path: Path, modules: set[str]) -> set[str]:
    """Every envctl module `path` imports, at module level or inside functions, except under
    `if TYPE_CHECKING:` (those never run)."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("envctl"))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1]
                                + ([base] if base else []))
            if base.startswith("envctl"):
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    found.add(sub if sub in modules else base)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text()))
    found.discard(name)
    return found


def _graph() -> dict[str, set[str]]:
    files = {_module_name(p): p for p in SRC.rglob("*.py")}
    return {name: _imports(path, set(files)) for name, path in files.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def strong(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in graph:
                continue
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            strong(v)
    return out


def test_no_import_cycles():
    assert _cycles(_graph()) == []


def test_spec_and_plan_never_import_the_host_the_engine_or_the_cli():
    banned = ("envctl.host", "envctl.engine", "envctl.app", "envctl.cli", "envctl.workspace",
              "envctl.render")
    bad = {m: sorted(i for i in deps if i.startswith(banned))
           for m, deps in _graph().items() if m.startswith(("envctl.spec", "envctl.plan"))}
    assert {m: d for m, d in bad.items() if d} == {}


def test_facts_are_pure_values():
    assert _graph()["envctl.facts"] == set()


def test_the_default_parent_has_one_value():
    """envctl.facts and envctl.spec.naming (which the launch path imports instead of the
    facts) name the same default parent cgroup."""
    from envctl import facts
    from envctl.spec import naming

    assert facts.DEFAULT_PARENT == naming.DEFAULT_PARENT == "envctl"


def test_planning_every_shipped_spec_touches_nothing():
    """Plan the shipped specs with hand-made facts under an audit hook that fails on any file
    opened, directory listed, socket, process, ctypes library or syscall: the planner is a pure
    function of the spec and the facts."""
    code = r'''
import sys
from pathlib import Path
from envctl.facts import (GpuFact, GpuHostFacts, HostFacts, ModuleFact, PlacedFile,
                          RootfsFacts)
from envctl.plan.planner import plan_env
from envctl.spec.loader import load_spec

import envctl.resources.mounts, envctl.resources.rootfs  # noqa: E401 - the planner imports
# these kinds lazily, when a spec has a rootfs: loading envctl's own code is not host I/O.

specs = [load_spec(p).spec for p in sorted(Path(sys.argv[1]).glob("*.yaml"))]
tree = RootfsFacts(files=(PlacedFile("/usr/bin/bash", "/usr/bin/bash"),),
                   links=(("bin", "usr/bin"),), binds=("/usr/lib/python3.11",),
                   python="/usr/bin/python3")
gpu = GpuHostFacts(driver="550.54.15", gpus=(GpuFact(0, "GPU-0", minor=0),
                                             GpuFact(1, "GPU-1", minor=1)),
                   majors={"nvidia-frontend": 195, "nvidia-uvm": 509},
                   libraries=(PlacedFile("/usr/lib/libcuda.so.550.54.15",
                                         "/usr/lib/libcuda.so.550.54.15"),))
facts = HostFacts(cpus=tuple(range(8)), modules={
    m: ModuleFact("available") for m in ("nvidia", "nvidia_uvm", "nvidia_modeset")},
    sysctls=frozenset(n for s in specs for n in s.host.sysctls),
    rootfs={s.name: tree for s in specs}, gpu=gpu, groups={"video": 44, "users": 100},
    resolv_conf="nameserver 10.0.0.2\n")
EVENTS = ("open", "os.listdir", "os.scandir", "os.walk", "socket.", "subprocess.", "os.system",
          "os.exec", "os.posix_spawn", "os.fork", "ctypes.", "os.chmod", "os.mkdir", "os.remove",
          "os.rename", "os.rmdir", "os.symlink", "os.truncate", "shutil.", "fcntl.")
seen = []

def hook(event, args):
    if event.startswith(EVENTS):
        seen.append((event, args))

sys.addaudithook(hook)
plans = [plan_env(s, facts) for s in specs]
print(len(plans), len(seen), seen[:5])
'''
    res = subprocess.run([sys.executable, "-c", code, str(SRC.parent / "configs")],
                         capture_output=True, text=True, check=False)
    assert res.returncode == 0, res.stderr
    count, events = res.stdout.split(" ", 1)
    assert int(count) >= 2
    assert events.strip() == "0 []"


def test_planning_for_cgroupfs_loads_no_systemd_code():
    """Start-up time: a host on the cgroupfs driver never imports the systemd driver."""
    code = r'''
import sys
from pathlib import Path
from envctl.facts import HostFacts
from envctl.plan.planner import plan_env
from envctl.spec.loader import load_spec
from envctl.plan.builder import PlanError
spec = load_spec(Path(sys.argv[1]) / "cpu-compute.yaml").spec
facts = HostFacts(sysctls=frozenset(spec.host.sysctls))
try:
    plan_env(spec, facts)
except PlanError as exc:  # what this host lacks does not matter here, the imports do
    print(exc, file=sys.stderr)
print(sorted(m for m in sys.modules if "systemd" in m))
'''
    res = subprocess.run([sys.executable, "-c", code, str(SRC.parent / "configs")],
                         capture_output=True, text=True, check=False)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "[]"


def test_planning_an_environment_without_a_rootfs_loads_no_rootfs_or_mount_code():
    code = r'''
import sys
from envctl.facts import HostFacts
from envctl.plan.planner import plan_env
from envctl.spec.loader import parse_spec
spec = parse_spec("name: n\nkind: cpu\nnetwork: {bridge: br0, bridge_address: 10.1.0.1/24, "
                  "address: 10.1.0.2}\n", "n.yaml").spec
plan_env(spec, HostFacts())
print(sorted(m for m in sys.modules if m in ("envctl.resources.mounts", "envctl.resources.rootfs",
                                             "envctl.host.elf", "envctl.host.mounts")))
'''
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=False)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "[]"
