"""The example playbook and the envctl role across two sandboxed hosts: changes, idempotence,
check mode and diff, one host's bad spec, and pruning to zero residue."""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import stat
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import pytest

from tests.fleet.harness import (
    EXAMPLES,
    REPO,
    ansible_tool,
    inventory,
    make_host,
    run_playbook,
    write_interpreter,
)

pytestmark = pytest.mark.root

ALPHA = {"kind": "cpu", "host": {"sysctls": {"net.ipv4.ip_forward": 1}}}
# The same environment asking for a memory limit: a changed cgroup.
ALPHA_CHANGED = {**ALPHA, "resources": {"memory": {"max": "256M"}}}
BETA = {"kind": "cpu", "network": {"bridge": "fl-br0", "bridge_address": "10.231.0.1/24",
                                   "address": "10.231.0.2"}}
GAMMA = {"kind": "cpu", "description": "joins the fleet"}
BAD = {"kind": "cpu", "resources": {"memory": {"max": "lots"}}}


@pytest.fixture
def fleet(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("needs root")
    if not os.path.exists(ansible_tool("ansible-playbook")):
        pytest.skip("ansible-core is not installed (the test extra)")
    hosts = []
    try:
        for name in ("h1", "h2"):
            hosts.append(make_host(name, tmp_path / name))
        (tmp_path / "work").mkdir()
        yield tmp_path / "work", hosts
    finally:
        for h in hosts:
            h.sandbox.close()


def test_role_applies_each_host_alone_is_idempotent_checks_and_prunes_to_nothing(fleet):
    work, (h1, h2) = fleet
    site = EXAMPLES / "site.yml"

    def play(envs: dict[str, dict], *args: str, prune: bool = False):
        return run_playbook(work, inventory([h1, h2], {
            h.name: {"envctl_environments": envs.get(h.name, {}), "envctl_prune": prune}
            for h in (h1, h2)}), site, *args)

    # First run: each host gets its own environment, and only its own.
    first = play({"h1": {"alpha": ALPHA}, "h2": {"beta": BETA}})
    assert first.rc == 0, first.output
    # Two changed tasks each: the boot units, then the environment.
    assert first.counts("h1")["changed"] == 2 and first.counts("h2")["changed"] == 2
    assert h1.up() == {"alpha": "up"} and h2.up() == {"beta": "up"}
    for h in (h1, h2):
        assert (h.unit_dir / "envctl.service").is_file()
        assert str(h.sandbox.config_dir) in (h.unit_dir / "envctl.service").read_text()
    assert h1.sandbox.links() == [] and "fl-br0" in h2.sandbox.links()

    # Second run (rolling, one host at a time): nothing to change anywhere.
    second = play({"h1": {"alpha": ALPHA}, "h2": {"beta": BETA}}, "-e", "envctl_serial=1")
    assert second.rc == 0, second.output
    assert second.counts("h1")["changed"] == 0 and second.counts("h2")["changed"] == 0

    # Check mode on a changed spec: reported with the plan's lines, and nothing happens.
    before = (h1.spec_files(), h1.sandbox.envctl_json("status"), h1.sandbox.cgroups())
    check = play({"h1": {"alpha": ALPHA_CHANGED}, "h2": {"beta": BETA}}, "--check", "--diff")
    assert check.rc == 0, check.output
    assert check.counts("h1")["changed"] == 1 and check.counts("h2")["changed"] == 0
    assert "envctl plan alpha" in check.output and "~ cgroup alpha" in check.output
    assert "+    max: 256M" in check.output  # the spec file's own diff
    assert (h1.spec_files(), h1.sandbox.envctl_json("status"), h1.sandbox.cgroups()) == before

    # A bad spec on h1 fails h1 alone, with envctl's error; h2 goes on with its change.
    bad = play({"h1": {"alpha": ALPHA, "broken": BAD}, "h2": {"beta": BETA, "gamma": GAMMA}})
    assert bad.rc == 2, bad.output
    assert bad.counts("h1")["failed"] == 1 and bad.counts("h1")["changed"] == 0
    assert bad.counts("h2")["failed"] == 0 and bad.counts("h2")["changed"] == 1
    assert "envctl plan broken failed (exit 2)" in bad.output
    assert "broken.yaml" in bad.output and "lots" in bad.output, bad.output
    assert str(h1.sandbox.config_dir / "broken.yaml") in bad.output  # not the staging copy
    assert "broken.yaml" not in h1.spec_files() and h1.up() == {"alpha": "up"}
    assert h2.up() == {"beta": "up", "gamma": "up"}

    # Everything leaves the inventory: prune takes it all down, to nothing.
    pruned = play({}, prune=True)
    assert pruned.rc == 0, pruned.output
    assert pruned.counts("h1")["changed"] == 1 and pruned.counts("h2")["changed"] == 1
    for h in (h1, h2):
        assert h.spec_files() == {}
        residue = h.sandbox.residue()
        # The boot units stay installed (a host-level choice): their record, and so envctl's
        # lock file beside it, is all that remains in the state directory.
        assert residue.pop("state_dir", []) == ["lock", "units.json"], h.name
        assert residue == {}, h.name


def test_the_example_inventory_has_two_gpu_hosts_and_one_cpu_host_with_valid_specs(tmp_path):
    """Each host's specs in the example inventory pass `envctl validate` together."""
    import subprocess

    import yaml

    inv = yaml.safe_load((EXAMPLES / "inventory.yml").read_text())
    groups = inv["envctl_hosts"]["children"]
    assert len(groups["gpu_hosts"]["hosts"]) == 2 and len(groups["cpu_hosts"]["hosts"]) == 1
    for group in groups.values():
        d = tmp_path / "specs"
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir()
        for name, spec in group["vars"]["envctl_environments"].items():
            (d / f"{name}.yaml").write_text(yaml.safe_dump({"name": name, **spec}))
        res = subprocess.run([os.path.join(os.path.dirname(ansible_tool("x")), "envctl"),
                              "validate", str(d)], capture_output=True, text=True)
        assert res.returncode == 0, res.stderr


# The venv the role makes on a sandboxed host, whose network namespace reaches no package
# index: envctl-partitions' dependencies come from this test run's own venv through a .pth
# line, so that pip finds them installed (the wheel itself is installed as on any host).
MAKE_VENV = """#!/bin/sh
set -e
[ "$1" != --help ] || exec {python} -m venv --help  # the pip module reads its options
for last in "$@"; do :; done  # it appends -p<python>, then the directory
{python} -m venv "$last"
echo {site} > "$last/lib/python{major}.{minor}/site-packages/envctl-test-deps.pth"
"""
WHEEL = "envctl_partitions-0.1.0-py3-none-any.whl"


def install_vars(h, **extra) -> tuple[dict, dict[str, Path]]:
    """An inventory of `h` alone with the role's install part on, into a venv, a cache
    directory and a venv maker of its own (MAKE_VENV); and those paths."""
    root = h.sandbox.root
    make_venv = root / "make-venv"
    # The dependencies without this run's own envctl-partitions: pip would find that version
    # installed already and skip it (and its hash check), whatever the role asks for.
    deps = root / "deps"
    deps.mkdir()
    purelib = Path(sysconfig.get_paths()["purelib"])
    for entry in purelib.iterdir():
        if not re.match(r"(__editable__[._])?envctl", entry.name, re.I) \
                and entry.suffix != ".pth":
            (deps / entry.name).symlink_to(entry)
    make_venv.write_text(MAKE_VENV.format(
        python=sys._base_executable, site=deps,
        major=sys.version_info.major, minor=sys.version_info.minor))
    make_venv.chmod(0o755)
    paths = {"venv": root / "venv", "cache": root / "cache",
             "site": root / "venv" / "lib" /
             f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"}
    inv = inventory([h], {h.name: {
        "envctl_install": True, "envctl_system_packages_install": False,
        "envctl_venv": str(paths["venv"]), "envctl_bin": str(paths["venv"] / "bin" / "envctl"),
        "envctl_cache_dir": str(paths["cache"]), "envctl_virtualenv_command": str(make_venv),
        **extra}})
    inv["envctl_hosts"]["vars"].pop("envctl_install")
    # No PYTHONPATH at this checkout's src on a host that installs envctl: pip would find the
    # checkout's envctl_partitions.egg-info there, count the requirement as installed and skip
    # it, hash check included.
    interp = root / "python-installed"
    write_interpreter(h.sandbox, interp, pythonpath=False)
    inv["envctl_hosts"]["hosts"][h.name]["ansible_python_interpreter"] = str(interp)
    return inv, paths


def build_wheel(work: Path, out: Path, marker: str = "") -> Path:
    """A wheel of a copy of this checkout (the checkout's own tree untouched), with an empty
    module `marker` added when given."""
    src = work / f"src-{out.name}"
    shutil.copytree(REPO, src, ignore=shutil.ignore_patterns(
        ".git", ".venv", "build", "*.egg-info", "__pycache__", "tests", "docs", "bench"))
    if marker:
        (src / "src" / "envctl" / f"{marker}.py").write_text("")
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                            "--wheel-dir", str(out), str(src)],
                           capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr
    return out / WHEEL


def test_role_installs_this_checkouts_wheel_in_a_root_venv_starts_units_and_is_idempotent(
        fleet):
    """envctl_install with envctl_source: the controller builds this checkout's wheel, the
    host gets it in a root-owned venv, install-units points the units at that envctl and
    notifies the start handler, the wheel's copy notifies the restart handler; the second run
    changes nothing and runs no handler. No pip invocation names the bare PyPI `envctl`."""
    work, (h1, _) = fleet
    inv, paths = install_vars(h1, envctl_source=str(REPO), envctl_environments={"alpha": ALPHA})
    venv, cache, site = paths["venv"], paths["cache"], paths["site"]

    started = time.time()
    first = run_playbook(work, inv, EXAMPLES / "site.yml", "-vvv", timeout=600)
    assert first.rc == 0, first.output[-6000:]
    for handler in ("Start the envctl units", "Restart the envctl daemons"):
        assert f"RUNNING HANDLER [envctl.fleet.envctl : {handler}]" in first.output
    # The wheel built from this checkout, and only it, installed into the venv.
    assert sorted(p.name for p in cache.iterdir()) == [WHEEL]
    assert (site / "envctl_partitions-0.1.0.dist-info").is_dir()
    assert (site / "envctl" / "cli.py").read_bytes() == (REPO / "src/envctl/cli.py").read_bytes()
    st = venv.stat()
    assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (0, 0, 0o755)
    # Every unit (the wheel carries every template) runs the installed envctl.
    for unit in ("envctl.service", "envctl-monitor.service", "envctl-daemon.service",
                 "envctl-retry.service"):
        assert f"ExecStart={venv}/bin/envctl " in (h1.unit_dir / unit).read_text(), unit
    assert (h1.unit_dir / "envctl-daemon.socket").is_file()
    assert h1.up() == {"alpha": "up"}
    # The pip tasks' rendered arguments: the copied wheel's path, never a bare name.
    names = re.findall(r'"name": \[\s*"([^"]*)"', first.output)
    assert names and set(names) == {str(cache / WHEEL)}, names
    assert not re.search(r"\benvctl(==|>=|~=|\s*$)", " ".join(names))
    assert "envctl==" not in first.output

    second = run_playbook(work, inv, EXAMPLES / "site.yml", timeout=600)
    assert second.rc == 0, second.output[-6000:]
    assert second.counts("h1")["changed"] == 0, second.output[-6000:]
    assert "RUNNING HANDLER" not in second.output
    assert not (REPO / "build").exists() or (REPO / "build").stat().st_mtime < started

    # An upgrade: another wheel of the same version (a marker module added), given as
    # envctl_wheel. It replaces the installed files and restarts the daemons; the units,
    # unchanged, are not started again.
    new = build_wheel(work, work / "new", marker="upgrade_marker")
    inv["envctl_hosts"]["hosts"]["h1"].update(envctl_source="", envctl_wheel=str(new))
    third = run_playbook(work, inv, EXAMPLES / "site.yml", timeout=600)
    assert third.rc == 0, third.output[-6000:]
    assert (site / "envctl" / "upgrade_marker.py").is_file()
    assert "RUNNING HANDLER [envctl.fleet.envctl : Restart the envctl daemons]" in third.output
    assert "Start the envctl units]" not in third.output
    assert h1.up() == {"alpha": "up"}

    down = h1.sandbox.envctl("down", "alpha")
    assert down.returncode == 0, down.stderr


def test_role_installs_from_hash_pinned_requirements_and_refuses_a_wrong_hash(fleet):
    """envctl_requirements: pip runs with --require-hashes (against a local index here, as an
    operator's mirror): a requirements file whose hash is not the wheel's installs nothing
    and fails the host; the right hash installs that wheel and notifies the restart."""
    work, (h1, _) = fleet
    wheel = build_wheel(work, work / "index")
    good = hashlib.sha256(wheel.read_bytes()).hexdigest()
    reqs = work / "requirements.txt"
    inv, paths = install_vars(h1, envctl_requirements=str(reqs),
                              envctl_pip_extra_args=f"--no-index --find-links {wheel.parent}")

    reqs.write_text(f"envctl-partitions==0.1.0 --hash=sha256:{'0' * 64}\n")
    bad = run_playbook(work, inv, EXAMPLES / "site.yml", timeout=600)
    assert bad.rc == 2 and bad.counts("h1")["failed"] == 1, bad.output[-6000:]
    assert "THESE PACKAGES DO NOT MATCH THE HASHES" in bad.output, bad.output[-6000:]
    assert not (paths["site"] / "envctl_partitions-0.1.0.dist-info").exists()

    reqs.write_text(f"envctl-partitions==0.1.0 --hash=sha256:{good}\n")
    ok = run_playbook(work, inv, EXAMPLES / "site.yml", "-vvv", timeout=600)
    assert ok.rc == 0, ok.output[-6000:]
    assert (paths["site"] / "envctl_partitions-0.1.0.dist-info").is_dir()
    assert "RUNNING HANDLER [envctl.fleet.envctl : Restart the envctl daemons]" in ok.output
    assert '"extra_args": "--require-hashes --no-index --find-links' in ok.output
    assert sorted(p.name for p in paths["cache"].iterdir()) == ["requirements.txt"]


def test_role_refuses_to_install_without_a_source(fleet):
    """No envctl_source, envctl_wheel or envctl_requirements: the role stops before anything,
    naming the three (the default is not `pip install envctl`, someone else's project)."""
    work, (h1, _) = fleet
    cache = h1.sandbox.root / "cache"
    inv = inventory([h1], {"h1": {"envctl_install": True, "envctl_cache_dir": str(cache),
                                  "envctl_venv": str(h1.sandbox.root / "venv"),
                                  "envctl_system_packages_install": False}})
    inv["envctl_hosts"]["vars"].pop("envctl_install")
    res = run_playbook(work, inv, EXAMPLES / "site.yml")
    assert res.rc == 2 and res.counts("h1")["failed"] == 1, res.output
    assert "set exactly one of envctl_source" in res.output and "unrelated project" in res.output
    assert not cache.exists() and not (h1.sandbox.root / "venv").exists()
    assert h1.spec_files() == {}
