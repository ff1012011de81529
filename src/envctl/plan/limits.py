"""What both cgroup drivers plan alike: the default device allow-list, the CPU quota in
microseconds, page rounding and the check that the host offers a controller."""

from __future__ import annotations

from typing import TYPE_CHECKING

from envctl.spec.models import quota_us

if TYPE_CHECKING:
    from envctl.facts import CgroupFacts
    from envctl.plan.builder import Plan
    from envctl.spec.models import Cpu

PAGE = 4096
# What every environment may open (as runc's default): null, zero, full, random, urandom,
# tty, ptmx and the Unix98 pty slaves (major 136).
DEFAULT_DEVICES = ("c 1:3 rwm", "c 1:5 rwm", "c 1:7 rwm", "c 1:8 rwm", "c 1:9 rwm",
                   "c 5:0 rwm", "c 5:2 rwm", "c 136:* rwm")
# Where another section (the GPU one) leaves extra device nodes for the allow-list:
# plan.resolved[GPU_DEVICES_KEY] = ("c 195:0 rwm", "c 195:255 rwm", ...).
GPU_DEVICES_KEY = "cgroup.devices"
# io.weight on a kernel with no proportional IO weight at all (no blk-iocost, no bfq: neither
# io.weight nor *.bfq.weight exists): nothing to write, so the spec is kept valid and says so,
# as a bfq weight with no bfq device does, and as dedicated CPUs on a host too small to give
# them do. It takes effect at the next `up` on a kernel that has one.
NO_IO_WEIGHT = ("io.weight {weight} is not applied: this kernel offers no proportional IO weight "
                "(neither blk-iocost nor the bfq scheduler), so nothing weighs this "
                "environment's IO against others'")


def quota_micros(cpu: Cpu, plan: Plan) -> int | None:
    """The quota in µs per period; None (with a plan error) below the kernel's 1000 µs minimum,
    or when there is no quota."""
    percent = cpu.percent  # `quota: 150%` and `cpus: 1.5` are the same limit
    if percent is None:
        return None
    micros = quota_us(percent, cpu.period_us)
    if micros < 1000:
        field = "quota" if cpu.quota is not None else "cpus"
        plan.error(("resources", "cpu", field), f"{percent:g}% of a {cpu.period_us} µs "
                   f"period is {micros} µs, below the kernel's 1000 µs minimum; raise the "
                   f"{field} or the period")
        return None
    return micros


def need(cg: CgroupFacts, controller: str, loc: tuple, why: str, plan: Plan) -> bool:
    if controller in cg.controllers:
        return True
    plan.error(loc, f"{why} needs the '{controller}' cgroup controller, which this host "
               f"(cgroup {cg.layout}: {', '.join(cg.controllers) or 'none'}) does not offer")
    return False


def page(n: int) -> int:
    # The kernel keeps limits in pages; planning the rounded value keeps check() exact.
    return n // PAGE * PAGE
