"""Benchmark: the price of `isolation: gvisor`. The same work as a native process, inside an
environment with `isolation: native` and inside one with `isolation: gvisor` (runsc, ptrace
platform here), side by side.

Run as root from the repository root: `python bench/sandbox_overhead.py [--runs 5]`
(`--smoke`: the suite's tiny run).
A fresh sandbox (the integration tests' throwaway net + mount namespace) holds three
environments on one bridge, on the same CPUs (none dedicated): `nat` (native), `gv` (gVisor)
and `srv` (native, the TCP server). Each run does the three variants of a case in a rotating
order (native, envctl native, envctl gvisor; then starting from the next), and medians are
compared:
- compute: examples/matmul.c built with -O2 -fopenmp, the seconds it reports for the multiply;
  and a NumPy 2000x2000 matmul where the environments' python3 has NumPy (its directory a
  read-only data mount, BLAS and LAPACK in the rootfs; bench/runtime_overhead.py does the same);
- syscalls: `dd bs=512 count=N if=/dev/zero of=/dev/null`, the seconds dd reports (gVisor's
  ptrace platform stops the Sentry on every system call: its N is `--dd-gvisor`, 30000 by
  default, and its time is scaled to N; said so in the output);
- small files: lstat+open+read+close of every file of /usr/share/doc (a read-only data mount
  at /data inside), the seconds the walker reports;
- file I/O on a data mount: `dd bs=1M count=64` to a file on a read-write data mount (with
  fsync) and back, the seconds dd reports for each;
- network: 2000 one-byte request-replies over TCP to a server in `srv`, through the bridge,
  the seconds the client reports;
- launch: `/bin/true` as a whole process: natively, `envctl exec nat -- /bin/true`,
  `envctl exec gv -- /bin/true`.
Prints times and ratios against the native process; asserts nothing.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from runtime_overhead import (  # noqa: E402
    MOUNT,
    NUMPY,
    WALK,
    dd_seconds,
    matmul_seconds,
    numpy_site,
    timed,
)

from bench.common import precompile  # noqa: E402
from tests.integration.sandbox import Sandbox  # noqa: E402

ENV = """name: {name}
kind: cpu
network: {{bridge: sbx-br, bridge_address: 10.232.0.1/24, address: {address}, isolate: false}}
rootfs:
  binaries: [sh, "true", dd, python3, {matmul}, {walk}]
  python: true
{libraries}mounts:
  - {{source: /usr/share/doc, target: /data, read_only: true}}
  - {{source: {rw}, target: /scratch, read_only: false, create: true}}
{numpy}{runtime}"""
ADDRESSES = {"nat": "10.232.0.2", "gv": "10.232.0.3", "srv": "10.232.0.4"}
SERVER = ("import socket\ns = socket.socket(); s.setsockopt(socket.SOL_SOCKET, "
          "socket.SO_REUSEADDR, 1)\ns.bind(('0.0.0.0', 7000)); s.listen(8)\nwhile True:\n"
          "    c, _ = s.accept()\n    c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)\n"
          "    while (b := c.recv(1)):\n        c.sendall(b)\n    c.close()\n")
CLIENT = ("import socket, sys, time\nc = socket.create_connection((sys.argv[1], 7000))\n"
          "c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)\nn = int(sys.argv[2])\n"
          "t = time.perf_counter()\nfor _ in range(n):\n    c.sendall(b'x'); c.recv(1)\n"
          "print(f'seconds={time.perf_counter() - t:.4f}')\n")


def rotate(runs: int, variants: list[list[str]], sb: Sandbox, read) -> list[float]:
    """Medians of `read(result)` per variant, each run starting from the next variant."""
    got: list[list[float]] = [[] for _ in variants]
    for i in range(runs):
        for k in range(len(variants)):
            j = (i + k) % len(variants)
            _, res = timed(sb, variants[j])
            got[j].append(read(res))
    return [statistics.median(g) for g in got]


def row(name: str, values: list[float], unit: str = "s", note: str = "") -> None:
    nat = values[0] or float("nan")  # a tiny (--smoke) case may report 0.000 s natively
    cells = "   ".join(f"{label} {v:.3f} {unit} ({v / nat:.2f}x)"
                       for label, v in zip(("native", "envctl-native", "envctl-gvisor"),
                                           values, strict=True))
    print(f"{name:<34} {cells}{'   ' + note if note else ''}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--n", type=int, default=1200, help="matrix size")
    ap.add_argument("--dd", type=int, default=300000)
    ap.add_argument("--dd-gvisor", type=int, default=30000)
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--launches", type=int, default=10)
    ap.add_argument("--smoke", action="store_true", help="every case once, tiny, without NumPy")
    args = ap.parse_args()
    if args.smoke:
        args.runs, args.n, args.dd, args.dd_gvisor = 1, 256, 1000, 100
        args.requests, args.launches = 10, 1
    precompile()
    with tempfile.TemporaryDirectory(prefix="envctl-sbx-", dir="/var/tmp") as tmp:
        t = Path(tmp)
        matmul, walk = t / "matmul", t / "walk"
        subprocess.run(["gcc", "-O2", "-fopenmp", "-o", str(matmul),
                        str(REPO / "examples" / "matmul.c")], check=True)
        (t / "walk.c").write_text(WALK)
        subprocess.run(["gcc", "-O2", "-o", str(walk), str(t / "walk.c")], check=True)
        (t / "client.py").write_text(CLIENT)
        numpy = None if args.smoke else numpy_site()
        sb = Sandbox(t / "sb")
        server = None
        try:
            for name, address in ADDRESSES.items():
                runtime = "runtime: {isolation: gvisor, gvisor: {platform: ptrace}}\n" \
                    if name == "gv" else ""
                sb.write_spec(name, ENV.format(
                    name=name, address=address, matmul=matmul, walk=walk, rw=t / f"rw-{name}",
                    runtime=runtime,
                    libraries="  libraries: [libblas.so.3, liblapack.so.3]\n" if numpy else "",
                    numpy=MOUNT.format(source=numpy[1], target=numpy[1]) if numpy else ""))
            up = sb.envctl("up", "--all")
            if up.returncode != 0:
                raise SystemExit(up.stderr)
            # The client script, where each variant sees it (its environment's /scratch).
            native_rw = t / "rw-native"
            native_rw.mkdir()
            for d in ("rw-nat", "rw-gv", "rw-native"):
                (t / d / "client.py").write_text(CLIENT)
                # Root inside an environment is an unprivileged host uid of its own (its user
                # namespace): the scratch directory (`up` made it 0755 root) is everybody's, as
                # /tmp is, so that it can write there.
                (t / d).chmod(0o1777)
            ex = [sys.executable, "-m", "envctl", "exec"]
            nat, gv = [*ex, "nat", "--user", "root", "--"], [*ex, "gv", "--user", "root", "--"]
            cpus = sb.run("nproc").stdout.strip()
            print(f"{cpus} CPUs; runsc {sb.run('runsc', '--version').stdout.split()[2]}, "
                  f"platform ptrace; medians of {args.runs} rotating runs")

            def three(argv: list[str], native: list[str] | None = None) -> list[list[str]]:
                return [native or argv, [*nat, *argv], [*gv, *argv]]

            row(f"compute: matmul n={args.n}", rotate(
                args.runs, three([str(matmul), str(args.n)]), sb, matmul_seconds))
            if numpy:
                py = [numpy[0], "-c", NUMPY]
                row("compute: NumPy 2000x2000 matmul", rotate(
                    args.runs, three(py), sb, matmul_seconds))
            else:
                print("NumPy: not installed for the environments' python3: case skipped")
            dd = ["dd", "bs=512", "if=/dev/zero", "of=/dev/null"]
            scale = args.dd / args.dd_gvisor
            vals = rotate(args.runs, [[*dd, f"count={args.dd}"], [*nat, *dd, f"count={args.dd}"],
                                      [*gv, *dd, f"count={args.dd_gvisor}"]], sb, dd_seconds)
            vals[2] *= scale
            row(f"syscalls: dd bs=512 x{args.dd}", vals,
                note=f"(gvisor ran x{args.dd_gvisor}, scaled x{scale:g})")
            row("small files: walk /usr/share/doc", rotate(args.runs, three(
                [str(walk), "/data", "1"], [str(walk), "/usr/share/doc", "1"]), sb,
                matmul_seconds))
            write = ["dd", "if=/dev/zero", "bs=1M", "count=64", "conv=fsync"]
            row("data mount: write 64 MiB + fsync", rotate(args.runs, [
                [*write, f"of={native_rw}/f"], [*nat, *write, "of=/scratch/f"],
                [*gv, *write, "of=/scratch/f"]], sb, dd_seconds))
            read = ["dd", "of=/dev/null", "bs=1M"]
            row("data mount: read 64 MiB", rotate(args.runs, [
                [*read, f"if={native_rw}/f"], [*nat, *read, "if=/scratch/f"],
                [*gv, *read, "if=/scratch/f"]], sb, dd_seconds))
            server = sb.popen(*ex, "srv", "--user", "root", "--", "python3", "-c", SERVER)
            deadline = time.monotonic() + 20
            while sb.run("python3", "-c", "import socket; socket.create_connection(("
                         f"'{ADDRESSES['srv']}', 7000), 1)").returncode != 0:
                if time.monotonic() > deadline:
                    raise SystemExit("the TCP server in srv did not start")
                time.sleep(0.2)
            srv, n = ADDRESSES["srv"], str(args.requests)
            row(f"network: {args.requests} TCP request-replies", rotate(args.runs, [
                ["python3", str(native_rw / "client.py"), srv, n],
                [*nat, "python3", "/scratch/client.py", srv, n],
                [*gv, "python3", "/scratch/client.py", srv, n]], sb, matmul_seconds))
            launches = []
            for argv in (["/bin/true"], [*nat, "/bin/true"], [*gv, "/bin/true"]):
                timed(sb, argv)  # warm
                launches.append(statistics.median(timed(sb, argv)[0]
                                                  for _ in range(args.launches)))
            row(f"launch: exec -- /bin/true (x{args.launches})", [v * 1000 for v in launches],
                unit="ms")
        finally:
            if server is not None:
                server.kill()
                server.wait()
            sb.envctl("down", "--all", "--force")
            sb.close()


if __name__ == "__main__":
    main()
