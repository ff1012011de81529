"""A small CPU benchmark job for a cpu-compute environment (the README's main job):

    envctl submit-job cpu-compute --wait examples/bench.py [SECONDS]

It reports what the environment gives it (hostname, CPUs it may run on, the thread variables
envctl set) and how many SHA-256 rounds per second each of its threads manages, with the
standard library only."""

import hashlib
import os
import socket
import sys
import threading
import time


def work(seconds: float, out: list[int]) -> None:
    h, n, end = hashlib.sha256(), 0, time.perf_counter() + seconds
    while time.perf_counter() < end:
        for _ in range(1000):
            h.update(b"envctl")
        n += 1000
    out.append(n)


def main() -> None:
    seconds = float(sys.argv[1]) if len(sys.argv) > 1 else 2.0
    cpus = sorted(os.sched_getaffinity(0))
    threads = int(os.environ.get("OMP_NUM_THREADS", len(cpus)))
    print(f"host {socket.gethostname()}: CPUs {cpus}, OMP_NUM_THREADS={threads}, "
          f"uid {os.getuid()}")
    counts: list[int] = []
    workers = [threading.Thread(target=work, args=(seconds, counts)) for _ in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    print(f"{threads} thread(s), {seconds:g} s: {sum(counts) / seconds:,.0f} SHA-256 "
          f"updates/s in total")


if __name__ == "__main__":
    main()
