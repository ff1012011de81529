"""Benchmark: `envctl gpus` on an 8-GPU HGX H200 host with 56 MIG instances (the fake host).

Run as root from the repository root: `python bench/gpus.py [--runs 15] [--smoke]`. The host is
tests/fakes/gpuhost.py's (`--gpus 8 --numa 2 --mig`: seven 1g.18gb instances on each GPU, their
access nodes made with mknod, so discovery asks the fake NVML as it would the real one); eight
environments that are up each hold one GPU's seven instances (journals of this boot). Each
command is timed as a whole process (interpreter start included, as an operator waits for it),
`--runs` times, with `envctl --version` as the floor of any command; then discovery alone
(`discover_gpus`, in-process) and the report (`gpu_report`). Target: `envctl gpus` <= 150 ms.
Asserts nothing; `--smoke` is the suite's tiny run (1 run). The real driver's cost (NVML over
libnvidia-ml on a GPU) is not measured: no GPU here.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.common import precompile  # noqa: E402
from tests.fakes import gpuhost  # noqa: E402


def boot_id() -> str:
    return Path("/proc/sys/kernel/random/boot_id").read_text().strip()


def hold(state: Path, gpus: int) -> None:
    """Environment hN up and holding GPU N's seven instances (claims as `up` records them)."""
    sys.path.insert(0, str(REPO / "src"))
    from envctl.engine.journal import Entry, Journal
    from envctl.resources.dirs import Directory

    for g in range(gpus):
        env = f"h{g}"
        uuids = [gpuhost.mig_uuid(g, gi["id"], 0)
                 for gi in gpuhost.layout("H200", ["1g.18gb"] * 7)]
        journal = Journal.open(state, env)
        step = Directory("state", f"envs/{env}", 0o755)
        journal.put(Entry(step.key, step.to_dict(), {}, "applied", boot=boot_id()))
        journal.set_meta({"claims": {"gpus": {"all": False, "indices": [], "uuids": uuids}}})
        journal.save()


CPU: list[float] = []  # the CPU time (user + system) of each timed child, in order


def timed(env: dict[str, str], *args: str) -> tuple[float, str]:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t = time.perf_counter()
    res = subprocess.run([sys.executable, "-m", "envctl", *args], capture_output=True,
                         text=True, env=env, timeout=120, check=False)
    dt = time.perf_counter() - t
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    CPU.append(after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime)
    if res.returncode != 0:
        raise SystemExit(f"envctl {' '.join(args)} failed:\n{res.stdout[-2000:]}\n"
                         f"{res.stderr[-2000:]}")
    return dt, res.stdout


def runs_of(env: dict[str, str], runs: int, *args: str) -> tuple[list[float], list[float]]:
    """Wall and CPU times of `runs` runs of `envctl ARGS`."""
    wall = [timed(env, *args)[0] for _ in range(runs)]
    return wall, CPU[-runs:]


def line(label: str, times: list[float], target: str = "", cpu: list[float] | None = None
         ) -> str:
    ms = sorted(x * 1000 for x in times)
    text = (f"{label}: median {statistics.median(ms):.1f} ms, min-max {ms[0]:.1f}-"
            f"{ms[-1]:.1f} ms over {len(ms)} run(s)")
    if cpu:
        text += f"; CPU median {statistics.median(cpu) * 1000:.1f} ms"
    return text + target


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=15)
    ap.add_argument("--smoke", action="store_true", help="1 run")
    args = ap.parse_args()
    runs = 1 if args.smoke else args.runs
    precompile()
    if os.geteuid() != 0:
        print("bench/gpus.py: not root, so the fake host has no device nodes and discovery does "
              "not ask NVML (no MIG instances): run it as root", file=sys.stderr)
    with tempfile.TemporaryDirectory(prefix="envctl-bench-gpus-") as tmp:
        root, state = Path(tmp) / "hgx", Path(tmp) / "state"
        fake = gpuhost.make_host(root, gpus=8, numa=2, mig=True)
        hold(state, 8)
        env = {**os.environ, **fake, "ENVCTL_STATE_DIR": str(state),
               "ENVCTL_RUN_DIR": str(Path(tmp) / "run"), "PYTHONDONTWRITEBYTECODE": "1"}
        _, out = timed(env, "gpus", "--json")
        report = json.loads(out)
        instances = sum(len(g.get("instances") or []) for g in report["gpus"])
        held = sum(1 for g in report["gpus"] for i in g.get("instances") or [] if i.get("env"))
        print(f"host: {len(report['gpus'])} GPUs, {instances} MIG instances ({held} held by "
              f"8 environments), source {report['source']}")
        floor, floor_cpu = runs_of(env, runs, "--version")
        plain, plain_cpu = runs_of(env, runs, "gpus")
        as_json, json_cpu = runs_of(env, runs, "gpus", "--json")
        print(line("envctl --version", floor, cpu=floor_cpu))
        print(line("envctl gpus", plain, " (target <= 150 ms)", cpu=plain_cpu))
        print(line("envctl gpus --json", as_json, " (target <= 150 ms)", cpu=json_cpu))
        print(f"envctl gpus above --version: median "
              f"{(statistics.median(plain) - statistics.median(floor)) * 1000:.1f} ms wall, "
              f"{(statistics.median(plain_cpu) - statistics.median(floor_cpu)) * 1000:.1f} ms "
              "CPU")
        in_process(root, state, fake, runs)


def in_process(root: Path, state: Path, fake: dict[str, str], runs: int) -> None:
    """Discovery and the whole report without the interpreter's start."""
    os.environ.update(fake)
    sys.path.insert(0, fake["PYTHONPATH"].split(":")[0])
    sys.path.insert(0, str(REPO / "src"))
    from envctl.gpus import gpu_report
    from envctl.host.context import Host
    from envctl.host.gpus import discover_gpus

    host = Host(state_dir=state, run_dir=state.parent / "run")
    disc, rep = [], []
    for _ in range(max(runs, 3)):
        t = time.perf_counter()
        discover_gpus(root)
        disc.append(time.perf_counter() - t)
        t = time.perf_counter()
        gpu_report(host, root)
        rep.append(time.perf_counter() - t)
    print(line("in-process discover_gpus", disc))
    print(line("in-process gpu_report (discovery, journals, health)", rep))


if __name__ == "__main__":
    main()
