"""Benchmark: `envctl up` of a 7-instance MIG layout on the fake GPU host (envctl's own cost),
then a no-op `up`, then `down`.

Run as root from the repository root: `python bench/mig_up.py [--runs 5] [--smoke]`. Each run
uses a fresh sandbox (the integration tests' throwaway net + mount namespace) and a fresh fake
host (tests/fakes/gpuhost.py: one H200, MIG off, device nodes made with mknod, the fake NVML
keeping its state in its JSON file). The spec asks for seven 1g.18gb instances on GPU 0
(`gpus: {mig: [{gpu: 0, profile: 1g.18gb, count: 7}]}`) and a small rootfs, as
tests/integration/test_gpu_mig.py's: the first `up` turns MIG mode on and makes the seven GPU
and compute instances, the second finds everything in place, `down` destroys them and turns
MIG mode off again. The same three commands with the whole GPU instead (`gpus: {count: 1}`)
follow on the same sandbox, so that what MIG adds shows against what every GPU spec costs
(the rootfs, cgroup, device nodes, CDI). Each command is a whole process (interpreter start
included), timed in wall time and in CPU (user + system of the process and everything it
waited for). Checked on every run: the second `up` made no NVML write, `down` left NVML's
state as it was, and no residue.

What this does not measure: the driver's own cost. A real H100/H200 takes its time in
nvmlDeviceSetMigMode and in each instance's creation (NVIDIA documents no figure); the fake
NVML writes a JSON file instead. Asserts nothing beyond the checks above; `--smoke` is the
suite's tiny run (1 run).
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.common import exit_on_signals, precompile  # noqa: E402
from tests.fakes import gpuhost  # noqa: E402
from tests.integration.sandbox import Sandbox  # noqa: E402

SPEC = """name: mig-bench
kind: gpu
rootfs:
  binaries: [bash, ls, cat]
gpus: {mig: [{gpu: 0, profile: 1g.18gb, count: 7}]}
"""
WHOLE = SPEC.replace("{mig: [{gpu: 0, profile: 1g.18gb, count: 7}]}", "{count: 1}")
STEPS = ("up", "up again (no-op)", "down")


def nvml(env: dict[str, str]) -> dict:
    return json.loads(Path(env["FAKE_NVML_JSON"]).read_text())


def timed(sb: Sandbox, env: dict[str, str], *argv: str) -> tuple[float, float]:
    """(wall, CPU) seconds of `envctl ARGV` in the sandbox; SystemExit when it fails."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    res = sb.envctl(*argv, env=env)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if res.returncode != 0:
        raise SystemExit(f"envctl {' '.join(argv)} failed:\n{res.stdout[-2000:]}\n"
                         f"{res.stderr[-2000:]}")
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def one_run() -> tuple[list[tuple[float, float]], list[tuple[float, float]], int]:
    """The (wall, CPU) of each of STEPS on a fresh sandbox and fake host, with the MIG layout
    and then with the whole GPU, and how many NVML writes the first `up` made."""
    with tempfile.TemporaryDirectory(prefix="envctl-bench-mig-", dir="/var/tmp") as tmp:
        sb = Sandbox(Path(tmp) / "sb")
        try:
            env = gpuhost.make_host(Path(tmp) / "gpuroot", gpus=1, numa=1)
            before = nvml(env)["gpus"]
            sb.write_spec("mig-bench", SPEC)
            out = [timed(sb, env, "up", "mig-bench", "--json")]
            state = nvml(env)
            made = len(state.get("writes", []))
            instances = len(state["gpus"][0].get("gpu_instances") or [])
            if not state["gpus"][0]["mig"] or instances != 7:
                raise SystemExit(f"up made {instances} instances (MIG mode "
                                 f"{state['gpus'][0]['mig']}), not 7")
            out.append(timed(sb, env, "up", "mig-bench", "--json"))
            if len(nvml(env).get("writes", [])) != made:
                raise SystemExit("the second up wrote to NVML")
            out.append(timed(sb, env, "down", "mig-bench", "--json"))
            if nvml(env)["gpus"] != before:
                raise SystemExit("down did not leave NVML as it was before the first up")
            if sb.residue():
                raise SystemExit(f"residue after down: {sb.residue()}")
            sb.write_spec("mig-bench", WHOLE)
            whole = [timed(sb, env, "up", "mig-bench", "--json"),
                     timed(sb, env, "up", "mig-bench", "--json"),
                     timed(sb, env, "down", "mig-bench", "--json")]
            if len(nvml(env).get("writes", [])) != 2 * made or sb.residue():
                raise SystemExit("the whole GPU's up/down wrote to NVML or left residue")
            return out, whole, made
        finally:
            sb.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--smoke", action="store_true", help="1 run")
    args = ap.parse_args()
    if args.smoke:
        args.runs = 1
    if shutil.which("gcc") is None or shutil.which("ldconfig") is None:
        raise SystemExit("bench/mig_up.py: needs gcc and ldconfig for the fake driver "
                         "libraries (scripts/install-deps installs them)")
    exit_on_signals()
    precompile()
    runs, wholes, writes = [], [], 0
    for _ in range(args.runs):
        steps, whole, writes = one_run()
        runs.append(steps)
        wholes.append(whole)
    print(f"one H200, seven 1g.18gb MIG instances from the spec; {args.runs} run(s), "
          f"medians; the first up made {writes} NVML writes (MIG mode, 7 GPU + 7 compute "
          "instances), the second none")
    for i, label in enumerate(STEPS):
        wall = statistics.median(r[i][0] for r in runs) * 1000
        cpu = statistics.median(r[i][1] for r in runs) * 1000
        wall1 = statistics.median(r[i][0] for r in wholes) * 1000
        cpu1 = statistics.median(r[i][1] for r in wholes) * 1000
        print(f"envctl {label}: wall {wall:.0f} ms, CPU {cpu:.0f} ms; whole GPU: wall "
              f"{wall1:.0f} ms, CPU {cpu1:.0f} ms")


if __name__ == "__main__":
    main()
