"""Benchmark: one `envctl monitor` tick over 32 environments and 8 GPUs, and RSS over 10,000
ticks.

Run from the repository root (no root needed): `python bench/monitor_tick.py [--envs 32]
[--gpus 8] [--ticks 10000]`. The host is the unit tests' fake (tests/unit/test_monitor.py:
`fake_host`): cgroup v1 files of plain files for every environment, journals as the engine
writes them, a job record per environment, the fake pynvml (tests/fakes/pynvml) with 8 GPUs
and two processes each, attributed through a fake /proc. A tick is what the monitor does each
interval without its health loop: sample (cgroups, service and job records, NVML, psutil), CSV
rows, the textfile (exposition, temporary file, rename) and the /metrics snapshot.

`--mig` makes it the HGX H200 host of bench/gpus.py: MIG on for every GPU with seven 1g.18gb
instances each (56, as tests/fakes/gpuhost.py lays them out), the environments holding
instances rather than whole GPUs (environment i the instances of GPU i mod GPUs), each instance
sampled through its MIG handle (memory, processes) and GPM (utilisation), the GPUs' processes
running in their instances.

Prints the CPU time of a tick (process time: median, p95, max) and split into sampling and
export, and RSS at the start, after 1,000 ticks and at the end (the cyclic GC on, as in the
monitor). Target: <= 20 ms of CPU per tick, RSS flat. Asserts nothing.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from array import array
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "src"))

from envctl.monitor.daemon import Monitor, Options  # noqa: E402
from envctl.monitor.nvml import NvmlSession  # noqa: E402
from envctl.runtime import jobs as jb  # noqa: E402
from tests.fakes import gpuhost  # noqa: E402
from tests.unit.test_monitor import BOOT, fake_host, import_fake_pynvml  # noqa: E402


def rss_kib() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 1024


def with_mig(fh: object) -> int:
    """Turn the fake host's GPUs to MIG (gpuhost's layout of seven 1g.18gb instances) and
    give each environment the instances of the GPUs it held; the number of instances."""
    doc = json.loads(fh.nvml_json.read_text())  # type: ignore[attr-defined]
    count = 0
    for g, gpu in enumerate(doc["gpus"]):
        gis = gpuhost.layout("H200", ["1g.18gb"] * 7)
        for n, gi in enumerate(gis):
            gi["cis"] = [{**ci, "uuid": gpuhost.mig_uuid(g, gi["id"], ci["id"])}
                         for ci in gi["cis"]]
            # The GPU's processes run in its instances (one each, from the first), which
            # say their memory and GPM activity.
            procs = gpu["processes"][n:n + 1]
            gi.update(used=sum(p[1] or 0 for p in procs), processes=procs,
                      gpm={"graphics": 10.0 * n, "sm": 5.0 * n})
        gpu.update(mig=True, mig_pending=True, mig_profiles=gpuhost.profiles("H200"),
                   gpu_instances=gis, gpm=True)
        count += len(gis)
    fh.nvml_json.write_text(json.dumps(doc))  # type: ignore[attr-defined]
    migs = {gpu["uuid"]: [ci["uuid"] for gi in gpu["gpu_instances"] for ci in gi["cis"]]
            for gpu in doc["gpus"]}
    for path in (fh.state / "journal").glob("*.json"):  # type: ignore[attr-defined]
        journal = json.loads(path.read_text())
        claims = journal["meta"]["claims"]
        claims["gpus"]["uuids"] = [m for u in claims["gpus"]["uuids"] for m in migs.get(u, [u])]
        path.write_text(json.dumps(journal))
    return count


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--envs", type=int, default=32)
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--ticks", type=int, default=10_000)
    ap.add_argument("--mig", action="store_true",
                    help="MIG on, 7 instances a GPU, held by the environments")
    ap.add_argument("--smoke", action="store_true", help="1 environment, 1 GPU, 1,000 ticks")
    args = ap.parse_args()
    if args.smoke:
        args.envs, args.gpus, args.ticks = 1, 1, 1000
    with tempfile.TemporaryDirectory(prefix="envctl-bench-monitor-") as tmp:
        root = Path(tmp)
        fh = fake_host(root, args.envs, gpus=args.gpus, procs_per_gpu=2)
        for i, env in enumerate(fh.envs):
            jb.write(fh.state, jb.Job(id=i + 1, env=env, argv=["x"], state=jb.State.COMPLETED,
                                      boot_id=BOOT))
        instances = with_mig(fh) if args.mig else 0
        os.environ["FAKE_NVML_JSON"] = str(fh.nvml_json)
        nvml = import_fake_pynvml()
        sampler = fh.sampler(nvml=NvmlSession(nvml))
        mon = Monitor(None, Options(csv_dir=root / "csv", textfile=root / "tf" / "m.prom"),
                      sampler=sampler, health=False, say=lambda line: None)
        gc.enable()
        for _ in range(20):  # warm: journals read, paths computed, records cached
            mon.tick()
        # The timings' own storage is allocated before the first RSS reading.
        totals = array("d", bytes(8 * args.ticks))
        samples = array("d", bytes(8 * args.ticks))
        rss0 = rss_kib()
        rss_1000 = None
        for n in range(args.ticks):
            c0 = time.process_time()
            sampler.tick()  # sampling alone, to split the tick's cost
            c1 = time.process_time()
            mon.tick()
            c2 = time.process_time()
            samples[n] = c1 - c0
            totals[n] = c2 - c1
            if n == 999:
                rss_1000 = rss_kib()
        rss_end = rss_kib()
        migs = len(sampler.tick().migs)
        mon.close()
        ms = sorted(x * 1000 for x in totals)
        sm = statistics.median(samples) * 1000
        print(f"monitor tick: {args.envs} environments, {args.gpus} GPUs "
              f"({2 * args.gpus} GPU processes), {args.ticks} ticks"
              + (f", MIG: {instances} instances held" if args.mig else ""))
        print("  CPU per tick (sample + CSV + textfile + snapshot): median "
              f"{statistics.median(ms):.2f} ms, p95 {ms[int(len(ms) * 0.95)]:.2f} ms, "
              f"max {ms[-1]:.2f} ms (target <= 20 ms)")
        print(f"  of which sampling alone: median {sm:.2f} ms; export: "
              f"{statistics.median(ms) - sm:.2f} ms")
        print(f"  NVML initialised {nvml.calls['init']} time(s)"
              + (f"; MIG instances sampled: {migs}" if args.mig else ""))
        print(f"  RSS: {rss0} KiB after warm-up, {rss_1000} KiB after 1,000 ticks, {rss_end} "
              f"KiB after {args.ticks} (growth {rss_end - (rss_1000 or rss0)} KiB after the "
              f"first 1,000)")
        csv_size = sum(p.stat().st_size for p in (root / "csv").iterdir())
        print(f"  CSV written: {csv_size // 1024} KiB in {len(os.listdir(root / 'csv'))} files "
              "(rotated at 10 MiB)")


if __name__ == "__main__":
    main()
