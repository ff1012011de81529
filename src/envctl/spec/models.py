"""Pydantic models of one environment spec; pure data, no I/O."""

from __future__ import annotations

import ipaddress
import math
import re
import shlex
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    StringConstraints,
    Tag,
    ValidationInfo,
    field_validator,
    model_validator,
)

from envctl.spec.units import format_size, parse_cpu_list, parse_percent, parse_size

# ---------------------------------------------------------------- what the kernel takes
# Each bound is what the kernel (or systemd) accepts; past it a write fails half-way through
# `up` or, worse, wraps around to a small number.

PAGE = 4096
# CPU and memory-node numbers: above any kernel's NR_CPUS (8192) and MAX_NUMNODES (1024), and
# small enough that a range like 0-65535 expands cheaply.
CPU_MAX = 65_535
# Memory limits are parsed as unsigned 64-bit and wrap past it; 2^62 (4096P) leaves room for
# v1's memory+swap sum (memory.memsw.limit_in_bytes = max + swap_max).
BYTES_MAX = 1 << 62
# The kernel refuses a CFS quota below 1 ms per period.
QUOTA_MIN_US = 1000
# Percent of one CPU: 100 for each of CPU_MAX + 1 CPUs, well inside cpu.max (2^44 µs per
# period) and systemd's CPUQuota= (2^31 / 100 %).
QUOTA_MAX = 100 * (CPU_MAX + 1)
# PID_MAX_LIMIT on 64-bit: pids.max refuses anything larger.
PIDS_MAX = 4 * 1024 * 1024
# /dev/nvidiaN is char 195:N, and minors 254 and 255 are nvidia-modeset and nvidiactl.
GPU_INDEX_MAX = 253
# systemd takes far longer; a day between restarts is a service that is down, or a typo.
RESTART_SEC_MAX = 86_400
# sysctl integers are read as 64-bit (signed or not, per sysctl); longer is always EINVAL.
SYSCTL_INT = (-(1 << 63), (1 << 64) - 1)


class FieldFault(ValueError):
    """A validator's finding about entries below the value it checks (the second `8080` of a
    list of ports, the target of the second mount): `faults` holds (relative location, message)
    pairs, which the loader reports each at its own line instead of the section's."""

    def __init__(self, faults: list[tuple[tuple[str | int, ...], str]]):
        super().__init__("; ".join(message for _, message in faults))
        self.faults = tuple(faults)


def _repeats(items: list[Any] | tuple[Any, ...], what: Any, *, verb: str = "listed",
             at: tuple[str | int, ...] = ()) -> None:
    """Raise a FieldFault at each later occurrence of an item seen before (`at` is the part
    of the entry that holds the item, like ("target",) for a mount)."""
    first: dict[Any, int] = {}
    faults: list[tuple[tuple[str | int, ...], str]] = []
    for i, item in enumerate(items):
        if item in first:
            faults.append(((i, *at), f"{what(item) if callable(what) else what} is {verb} "
                                     f"twice: entry {i} repeats entry {first[item]}"))
        else:
            first[item] = i
    if faults:
        raise FieldFault(faults)


def _shown(v: Any) -> str:
    """A value as the spec's YAML spells it, short, for one-line errors."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if v is None:
        return "null"
    if isinstance(v, float) and not math.isfinite(v):
        return ".nan" if math.isnan(v) else ("-.inf" if v < 0 else ".inf")
    if isinstance(v, list | tuple):
        return "a list"
    if isinstance(v, dict):
        return "a mapping"
    text = repr(v) if isinstance(v, str) else str(v)  # repr: control characters stay visible
    return text if len(text) <= 40 else text[:37] + "..."


def _whole(lo: int, hi: int, unit: str = "") -> BeforeValidator:
    """An integer field from `lo` to `hi`, checked before pydantic's own coercion, which
    would take YAML's `true` as 1, `1.0` as 1 and a quoted '5' as 5."""

    def check(v: Any) -> Any:
        if v is not None and (isinstance(v, bool) or not isinstance(v, int)
                              or not lo <= v <= hi):
            raise ValueError(f"must be a whole number from {lo} to {hi}{unit}, not {_shown(v)}")
        return v

    return BeforeValidator(check)


def _flag(v: Any) -> Any:
    # YAML's own true/false (and yes/no, on/off): pydantic would also take 1, 0 and 'y'.
    if not isinstance(v, bool):
        raise ValueError(f"must be true or false, not {_shown(v)}")
    return v


def _pattern(regex: str, rule: str) -> AfterValidator:
    """A string matching `regex`; `rule` says in words what is allowed."""
    compiled = re.compile(regex)

    def check(v: str) -> str:
        if not compiled.fullmatch(v):
            raise ValueError(f"{rule}, not {_shown(v)}")
        return v

    return AfterValidator(check)


def _no_nul(v: str) -> str:
    # Paths and argv go to the kernel as C strings: a NUL would cut them short (Python refuses).
    if "\0" in v:
        raise ValueError(f"cannot hold a NUL byte, not {_shown(v)}")
    return v


def _no_control(v: str) -> str:
    if any(c < " " or c == "\x7f" for c in v):
        raise ValueError(f"must not contain control characters (newlines, NUL, escapes), "
                         f"not {_shown(v)}")
    return v


# Lowercase hostname label, at most 32 characters: valid as a netns name, a cgroup
# directory, a systemd unit name (after escaping '-') and a UTS hostname.
EnvName = Annotated[
    str,
    StringConstraints(pattern=r"^[a-z](?:[a-z0-9-]{0,30}[a-z0-9])?$"),
]
# IFNAMSIZ is 16 bytes including the NUL: 15 characters, no '/', no whitespace, not '.'/'..'.


def _ifname(v: str) -> str:
    if v in (".", ".."):
        raise ValueError("'.' and '..' are not interface names")
    return v


IfName = Annotated[
    str, StringConstraints(pattern=r"^[A-Za-z0-9_.-]{1,15}$"), AfterValidator(_ifname)
]
EnvVarName = Annotated[str, _pattern(r"[A-Za-z_][A-Za-z0-9_]*", "an environment variable name "
                                     "is letters, digits and '_', not starting with a digit")]
# Either of sysctl(8)'s spellings: dotted (a '/' inside a part stands for a dot in an interface
# name: net.ipv4.conf.eth0/100.rp_filter) or with slashes (net/ipv4/conf/eth0.100/rp_filter).
# No part is empty, '.' or '..': the name becomes a path under /proc/sys.
_SYSCTL_PART = r"[A-Za-z0-9_@:-]+"
SysctlName = Annotated[str, _pattern(
    rf"[a-z0-9_]+(?:\.{_SYSCTL_PART}(?:/{_SYSCTL_PART})*)+"
    rf"|[a-z0-9_]+(?:/{_SYSCTL_PART}(?:\.{_SYSCTL_PART})*)+",
    "a sysctl name is net.ipv4.ip_forward or net/ipv4/ip_forward: a-z, 0-9 and '_' first, "
    "then parts of letters, digits, '_', '-', '@' and ':' (a '/' in a dotted name, or a '.' in "
    "a slashed one, stands for the dot in an interface name like eth0.100)")]
# A leading '-' would make modprobe read the name as an option; MODULE_NAME_LEN is 56 with NUL.
ModuleName = Annotated[str, _pattern(
    r"[A-Za-z0-9][A-Za-z0-9_-]{0,54}", "a module name is 1-55 letters, digits, '_' and '-', "
    "starting with a letter or digit (not '-': modprobe would read an option)")]
ModuleOptionKey = Annotated[str, _pattern(
    r"[A-Za-z_][A-Za-z0-9_.]*", "a module option's name is letters, digits, '_' and '.', "
    "starting with a letter or '_'")]
Policy = Literal["required", "best-effort"]
Port = Annotated[int, _whole(1, 65535)]
Weight = Annotated[int | None, _whole(1, 10_000)]
Flag = Annotated[bool, BeforeValidator(_flag)]
# Something the kernel takes as a path or a name: one line, no NUL.
PathText = Annotated[str, AfterValidator(_no_control)]


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def _abs_path(value: str, what: str) -> str:
    _no_control(value)
    if not value.startswith("/"):
        raise ValueError(f"{what} must be an absolute path, got '{value}'")
    if any(part == ".." for part in value.split("/")):
        raise ValueError(f"{what} must not contain '..'")
    return value


# ---------------------------------------------------------------- network


class PortForward(Strict):
    """Traffic to `host` on the host is forwarded to `port` in the environment."""

    host: Port
    port: Port
    protocol: Literal["tcp", "udp"] = "tcp"

    @model_validator(mode="before")
    @classmethod
    def _shorthand(cls, data: Any) -> Any:
        # `8888` or "8888" means host 8888 -> env 8888/tcp; "8080:80/udp" the long form.
        if isinstance(data, int) and not isinstance(data, bool):
            return {"host": _port(data), "port": _port(data)}
        if isinstance(data, str):
            m = re.fullmatch(r"([0-9]+)(?::([0-9]+))?(?:/(tcp|udp))?", data.strip())
            if not m:
                raise ValueError("a port forward is HOST[:ENV][/tcp|udp], e.g. 8080:80/tcp")
            host, env, proto = m.groups()
            return {"host": _port(int(host)), "port": _port(int(env or host)),
                    "protocol": proto or "tcp"}
        if not isinstance(data, dict | PortForward):
            raise ValueError(f"a port forward is HOST[:ENV][/tcp|udp], e.g. 8080:80/tcp, or "
                             f"{{host: H, port: P, protocol: tcp}}, not {_shown(data)}")
        return data


def _port(n: int) -> int:
    # Checked here so that the shorthand `0` is one error, not one each for host and port.
    if not 1 <= n <= 65535:
        raise ValueError(f"ports run from 1 to 65535, not {_shown(n)}")
    return n


class Network(Strict):
    bridge: IfName = "compute-bridge"
    bridge_address: ipaddress.IPv4Interface = ipaddress.IPv4Interface("10.200.0.1/24")
    address: ipaddress.IPv4Address
    gateway: ipaddress.IPv4Address | None = None
    interface: IfName = "eth0"
    nat: Flag = True
    isolate: Flag = True
    ports: list[PortForward] = []
    firewall: Literal["auto", "nftables", "iptables"] = "auto"

    @field_validator("bridge_address")
    @classmethod
    def _usable_subnet(cls, v: ipaddress.IPv4Interface) -> ipaddress.IPv4Interface:
        if v.network.prefixlen > 30:
            raise ValueError("the bridge subnet must be /30 or larger to hold the environment")
        if v.ip in (v.network.network_address, v.network.broadcast_address):
            raise ValueError(f"{v.ip} is the network or broadcast address of {v.network}")
        return v

    # Field validators rather than one check of the whole section: each finding is reported at
    # its own line, and is still found when another field of the section is wrong (a field
    # that failed is absent from info.data, so nothing is compared with a value never read).
    @field_validator("address")
    @classmethod
    def _address_fits(cls, v: ipaddress.IPv4Address,
                      info: ValidationInfo) -> ipaddress.IPv4Address:
        bridge = info.data.get("bridge_address")
        if bridge is None:
            return v
        net = bridge.network
        if v not in net:
            raise ValueError(f"address {v} is outside the bridge subnet {net} "
                             f"(bridge_address {bridge})")
        if v in (net.network_address, net.broadcast_address):
            raise ValueError(f"address {v} is the network or broadcast address of {net}")
        if v == bridge.ip:
            raise ValueError(f"address {v} is the bridge's own address")
        return v

    @field_validator("gateway")
    @classmethod
    def _gateway_fits(cls, v: ipaddress.IPv4Address | None,
                      info: ValidationInfo) -> ipaddress.IPv4Address | None:
        bridge = info.data.get("bridge_address")
        if v is not None and bridge is not None and v not in bridge.network:
            raise ValueError(f"gateway {v} is outside the bridge subnet {bridge.network}")
        if v is not None and v == info.data.get("address"):
            raise ValueError("the gateway cannot be the environment's own address")
        return v

    @field_validator("ports")
    @classmethod
    def _ports_once(cls, v: list[PortForward]) -> list[PortForward]:
        # At the second occurrence: a host port/protocol is forwarded once.
        _repeats([(pf.host, pf.protocol) for pf in v],
                 lambda key: f"host port {key[0]}/{key[1]}", verb="forwarded")
        return v

    @property
    def gateway_ip(self) -> ipaddress.IPv4Address:
        return self.gateway or self.bridge_address.ip

    @property
    def subnet(self) -> ipaddress.IPv4Network:
        return self.bridge_address.network


# ---------------------------------------------------------------- rootfs


def _mode(v: Any) -> Any:
    # YAML 1.1 reads an unquoted 0644 as octal already; a quoted '0644' is octal too.
    if isinstance(v, str) and re.fullmatch(r"[0-7]{1,5}", v.strip()):
        v = int(v.strip(), 8)
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= 0o7777:
        raise ValueError(f"mode must be an octal file mode from 0 to 07777, like 0644, "
                         f"not {_shown(v)}")
    return v


class FileEntry(Strict):
    path: str
    content: str | None = None
    source: PathText | None = None
    mode: Annotated[int, BeforeValidator(_mode)] = 0o644

    @field_validator("path")
    @classmethod
    def _path(cls, v: str) -> str:
        return _abs_path(v, "a file's path inside the environment")

    @field_validator("source")
    @classmethod
    def _source(cls, v: str | None) -> str | None:
        return None if v is None else _abs_path(v, "a file's source on the host")

    @model_validator(mode="after")
    def _one_origin(self) -> FileEntry:
        if (self.content is None) == (self.source is None):
            raise ValueError("give exactly one of 'content' or 'source'")
        return self


def _env_value(v: Any) -> str:
    if isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, int) or isinstance(v, float) and math.isfinite(v):
        return str(v)
    if not isinstance(v, str):
        raise ValueError(f"an environment variable's value is text, a number or true/false, "
                         f"not {_shown(v)}")
    # One line: the values are written to the rootfs's /etc/environment (KEY=VALUE per line,
    # as pam_env reads it), which has no way to escape a newline.
    if any(c < " " and c != "\t" or c == "\x7f" for c in v):
        raise ValueError(f"an environment variable's value is one line without control "
                         f"characters (it is written to /etc/environment), not {_shown(v)}")
    return v


class Rootfs(Strict):
    path: str | None = None
    binaries: list[PathText] = []
    libraries: list[PathText] = []
    python: Flag = False
    files: list[FileEntry] = []
    env: dict[EnvVarName, Annotated[str, BeforeValidator(_env_value)]] = {}
    thread_env: list[EnvVarName] = []

    @field_validator("path")
    @classmethod
    def _path(cls, v: str | None) -> str | None:
        return None if v is None else _abs_path(v, "rootfs.path")


# ---------------------------------------------------------------- resources


class Quantity(Strict):
    """Bytes, or a percentage of the host's memory resolved at plan time."""

    bytes: Annotated[int | None, _whole(0, BYTES_MAX)] = None
    percent: float | None = None

    @model_validator(mode="before")
    @classmethod
    def _parse(cls, data: Any) -> Any:
        if isinstance(data, dict):
            return data  # the long form: each field holds the shorthand's range
        pct = parse_percent(data) if isinstance(data, str) else None
        if pct is not None:
            if not 0 < pct <= 100:
                raise ValueError(f"{_shown(data)} is not a share of host memory: use more than "
                                 "0% and at most 100%")
            return {"percent": pct}
        try:
            n = parse_size(data)
        except ValueError as exc:
            raise ValueError(f"{exc}, or a percentage of host memory like 70%") from None
        if n > BYTES_MAX:
            raise ValueError(f"{_shown(data)} is more than the kernel takes: a size is at most "
                             "4096P")
        return {"bytes": n}

    @field_validator("percent", mode="before")
    @classmethod
    def _percent(cls, v: Any) -> Any:
        if v is not None and (isinstance(v, bool) or not isinstance(v, int | float)
                              or not (math.isfinite(v) and 0 < v <= 100)):
            raise ValueError(f"percent must be a finite share of host memory above 0 and at "
                             f"most 100, like 70, not {_shown(v)}")
        return v

    @model_validator(mode="after")
    def _one(self) -> Quantity:
        if (self.bytes is None) == (self.percent is None):
            raise ValueError("give one of bytes or percent, like {bytes: 4096} or {percent: 70}")
        return self

    def resolve(self, total: int) -> int:
        if self.bytes is not None:
            return self.bytes
        assert self.percent is not None
        return int(total * self.percent / 100) // 4096 * 4096

    def __str__(self) -> str:
        return f"{self.percent:g}%" if self.percent is not None else str(self.bytes)


NEAR_GPUS = "near_gpus"  # memory.nodes: the NUMA nodes of the environment's GPUs


class ReservedCpus(Strict):
    """Dedicated CPUs as "all online CPUs but the first N and the last M"."""

    reserve_first: Annotated[int, _whole(0, CPU_MAX)] = 0
    reserve_last: Annotated[int, _whole(0, CPU_MAX)] = 0
    # What to do on a host too small to leave any CPU after the reservation:
    # `share` runs the environment on all online CPUs (a warning in plan), `error` refuses.
    small_host: Literal["share", "error"] = "error"


class NearGpuCpus(Strict):
    """Dedicated CPUs as "`count` CPUs local to this environment's GPUs" (their PCI NUMA node's
    CPUs, or NVML's CPU affinity), chosen among those no other environment dedicates."""

    near_gpus: bool
    count: Annotated[int, _whole(1, CPU_MAX + 1)]

    @field_validator("near_gpus")
    @classmethod
    def _near(cls, v: bool) -> bool:
        if v is not True:
            raise ValueError("near_gpus: true is the only value; to choose CPUs yourself list "
                             "them (dedicated: 0-7) or reserve some (reserve_first: 2)")
        return v


def _cpus_or_reserved(v: Any) -> str:
    # Picks the union's branch, so a bad mapping is one error rather than one per branch. The
    # tags are names the loader already leaves out of field paths.
    if isinstance(v, NearGpuCpus) or (isinstance(v, dict) and "near_gpus" in v):
        return "NearGpuCpus"
    return "ReservedCpus" if isinstance(v, dict | ReservedCpus) else "tuple[int, ...]"


def quota_us(percent: float, period_us: int) -> int:
    """A quota in percent of one CPU as µs per period (the planner's rounding too)."""
    return round(percent / 100 * period_us)


class Cpu(Strict):
    # period_us comes before quota and cpus: their checks need the period.
    period_us: Annotated[int, _whole(1_000, 1_000_000, " µs")] = 100_000
    # Percent of one CPU, as systemd's CPUQuota= (150 is one and a half CPUs) ...
    quota: float | None = None
    # ... or CPUs, as Docker's --cpus and compose's cpus: (1.5 is one and a half CPUs).
    cpus: float | None = None
    weight: Weight = None
    dedicated: Annotated[
        Annotated[tuple[int, ...], Tag("tuple[int, ...]")]
        | Annotated[ReservedCpus, Tag("ReservedCpus")]
        | Annotated[NearGpuCpus, Tag("NearGpuCpus")],
        Discriminator(_cpus_or_reserved),
    ] | None = None

    @field_validator("quota", mode="before")
    @classmethod
    def _quota(cls, v: Any, info: ValidationInfo) -> Any:
        if v is None:
            return v
        pct = parse_percent(v) if isinstance(v, str) else None
        value = pct if pct is not None else v
        if (isinstance(value, bool) or not isinstance(value, int | float)
                or not (math.isfinite(value) and 0 < value <= QUOTA_MAX)):
            raise ValueError(f"quota must be a finite percentage of one CPU above 0% and at most "
                             f"{QUOTA_MAX}% ({CPU_MAX + 1} CPUs), like 150%, not {_shown(v)}")
        period = info.data.get("period_us")
        # The same rounding as the planner: a spec valid here is valid on every host.
        if period is not None and quota_us(value, period) < QUOTA_MIN_US:
            raise ValueError(f"quota {value:g}% of a {period} µs period is "
                             f"{quota_us(value, period)} µs, below the kernel's "
                             f"{QUOTA_MIN_US} µs minimum; raise the quota or period_us")
        return float(value)

    @field_validator("cpus", mode="before")
    @classmethod
    def _cpus(cls, v: Any, info: ValidationInfo) -> Any:
        if v is None:
            return v
        if "quota" in info.data and info.data["quota"] is not None:
            raise ValueError("give the CPU limit once: quota (percent of one CPU, like 150%) "
                             "or cpus (CPUs, like 1.5), not both")
        value = v
        # Compose files often quote it (cpus: '0.50'); it is CPUs either way.
        if isinstance(v, str) and re.fullmatch(r"\s*[0-9]+(?:\.[0-9]*)?\s*|\s*\.[0-9]+\s*", v):
            value = float(v)
        if (isinstance(value, bool) or not isinstance(value, int | float)
                or not (math.isfinite(value) and 0 < value <= CPU_MAX + 1)):
            hint = (f"; a percentage of one CPU is quota: {v.strip()}"
                    if isinstance(v, str) and parse_percent(v) is not None else "")
            raise ValueError(f"cpus is a number of CPUs above 0 and at most {CPU_MAX + 1}, "
                             f"like 1.5 (as docker run --cpus), not {_shown(v)}{hint}")
        period = info.data.get("period_us")
        if period is not None and quota_us(value * 100, period) < QUOTA_MIN_US:
            raise ValueError(f"cpus {value:g} of a {period} µs period is "
                             f"{quota_us(value * 100, period)} µs, below the kernel's "
                             f"{QUOTA_MIN_US} µs minimum; raise cpus or period_us")
        return float(value)

    @property
    def percent(self) -> float | None:
        """The CPU limit in percent of one CPU, however the spec wrote it (quota or cpus)."""
        if self.quota is not None:
            return self.quota
        return None if self.cpus is None else self.cpus * 100

    @field_validator("dedicated", mode="before")
    @classmethod
    def _dedicated(cls, v: Any) -> Any:
        if v is None or isinstance(v, dict):
            return v
        cpus = parse_cpu_list(v, most=CPU_MAX)
        if not cpus:
            raise ValueError("an empty CPU list: leave 'dedicated' out to share all CPUs")
        return cpus


class Memory(Strict):
    max: Quantity | None = None
    high: Quantity | None = None
    swap_max: Quantity | None = None
    # Node numbers, or "near_gpus": the NUMA nodes of the environment's GPUs.
    nodes: tuple[int, ...] | Literal["near_gpus"] | None = None

    @field_validator("nodes", mode="before")
    @classmethod
    def _nodes(cls, v: Any) -> Any:
        if v is None or v == NEAR_GPUS:
            return v
        if isinstance(v, str) and not re.fullmatch(r"[0-9,\s-]*", v):
            raise ValueError(f"memory.nodes is a list of NUMA nodes like 0-1, or near_gpus (the "
                             f"nodes of the environment's GPUs), not {_shown(v)}")
        return parse_cpu_list(v, most=CPU_MAX, what="memory node")

    @field_validator("max", "high")
    @classmethod
    def _a_page_at_least(cls, v: Quantity | None, info: ValidationInfo) -> Quantity | None:
        # Limits are kept in pages: below one page is 0, and everything is OOM-killed at once.
        # (swap_max: 0 is fine: no swap.) A percentage is checked against the host's memory.
        if v is not None and v.bytes is not None and v.bytes < PAGE:
            raise ValueError(f"memory.{info.field_name} {v.bytes} is below one 4K page (the "
                             "kernel keeps limits in pages: it would be a limit of 0); use at "
                             "least 4K, like 512M, or leave it out for no limit")
        return v

    @model_validator(mode="after")
    def _high_below_max(self) -> Memory:
        mx, hi = self.max, self.high
        # Comparable only when both are in the same unit; mixed ones are checked at plan time.
        if mx and hi and (mx.percent is None) == (hi.percent is None):
            above = (hi.percent > mx.percent) if mx.percent is not None else hi.bytes > mx.bytes
            if above:
                def shown(q: Quantity) -> str:
                    return str(q) if q.bytes is None else format_size(q.bytes)

                raise FieldFault([(("high",), f"memory.high ({shown(hi)}) is above memory.max "
                                              f"({shown(mx)})")])
        return self


class Io(Strict):
    weight: Weight = None


class Pids(Strict):
    max: Annotated[int | None, _whole(1, PIDS_MAX)] = None


class Resources(Strict):
    driver: Literal["auto", "cgroupfs", "systemd"] = "auto"
    cpu: Cpu = Cpu()
    memory: Memory = Memory()
    io: Io = Io()
    pids: Pids = Pids()


# ---------------------------------------------------------------- gpus


# As nvidia-smi -L prints them: GPU-<uuid>, MIG-<uuid> or the older MIG-GPU-<uuid>/<gi>/<ci>.
# No ',': the list ends up in NVIDIA_VISIBLE_DEVICES, where a comma would name another device.
GpuUuid = Annotated[str, _pattern(r"(?:GPU|MIG)-[A-Za-z0-9/-]{1,100}",
                                  "a GPU UUID is GPU-… or MIG-… (letters, digits, '-' and '/'), "
                                  "as nvidia-smi -L prints it")]


def _unique(items: tuple[Any, ...], what: str) -> tuple[Any, ...]:
    _repeats(items, lambda item: f"{what} {_shown(item)}")
    return items


# A group name as useradd allows it, or a numeric gid.
GroupName = Annotated[str, _pattern(r"[a-z_][a-z0-9_-]{0,31}\$?|[0-9]{1,10}",
                                    "a group is a name like video (a-z, 0-9, '_', '-') or a "
                                    "numeric gid")]


class Gpus(Strict):
    """Which GPUs the environment gets (none, all, a count, indices or UUIDs) and how."""

    count: Annotated[int | None, _whole(0, GPU_INDEX_MAX + 1)] = None
    indices: tuple[Annotated[int, _whole(0, GPU_INDEX_MAX)], ...] = ()
    uuids: tuple[GpuUuid, ...] = ()
    all: Flag = False
    # The device nodes are mode 0660, owned by root and this group (never 0666).
    group: GroupName = "video"
    # /dev/nvidia-modeset (display drivers, Vulkan/OpenGL); compute does not need it.
    modeset: Flag = False
    # Removed: it granted nvidia-cap1, MIG's configuration capability, with which one
    # partition could destroy every other partition's instances. Only refused now.
    mig_caps: Any = None
    # The CUDA toolkit directory, bind-mounted read-only at the same path (never copied).
    toolkit: str | None = None

    @field_validator("toolkit")
    @classmethod
    def _toolkit(cls, v: str | None) -> str | None:
        return None if v is None else _abs_path(v, "gpus.toolkit").rstrip("/") or "/"

    @field_validator("mig_caps", mode="before")
    @classmethod
    def _no_mig_caps(cls, v: Any) -> Any:
        raise ValueError("mig_caps is no longer accepted: it granted nvidia-cap1, the MIG "
                         "configuration capability, with which one environment could destroy "
                         "every other's MIG instances. Remove it and name the MIG devices the "
                         "environment gets by UUID (gpus: [MIG-…], as `envctl gpus` lists "
                         "them): envctl then gives only their access nodes")

    @model_validator(mode="before")
    @classmethod
    def _shorthand(cls, data: Any) -> Any:
        if data is None or data == "none":
            return {"count": 0}
        if data == "all":
            return {"all": True}
        if isinstance(data, int) and not isinstance(data, bool):
            return {"count": data}
        if isinstance(data, list):
            if all(isinstance(x, int) and not isinstance(x, bool) for x in data):
                _repeats(data, lambda x: f"GPU index {x}")
                return {"indices": data}
            if all(isinstance(x, str) and x.startswith(("GPU-", "MIG-")) for x in data):
                _repeats(data, lambda x: f"GPU {x}")
                return {"uuids": data}
            raise ValueError("list either GPU indices (0, 1, …) or UUIDs (GPU-…), not a mix")
        if isinstance(data, dict):
            return data
        raise ValueError("gpus is none, all, a count, a list of indices or a list of UUIDs")

    @field_validator("indices")
    @classmethod
    def _unique_indices(cls, v: tuple[int, ...]) -> tuple[int, ...]:
        return _unique(v, "GPU index")

    @field_validator("uuids")
    @classmethod
    def _unique_uuids(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        return _unique(v, "GPU UUID")

    @model_validator(mode="after")
    def _one_way(self) -> Gpus:
        # The long form can say two things at once; the shorthand never does.
        given = [self.all, self.count is not None, bool(self.indices), bool(self.uuids)]
        if sum(given) > 1:
            raise ValueError("give one of all, count, indices or uuids")
        return self

    @property
    def wanted(self) -> bool:
        return self.all or bool(self.count) or bool(self.indices) or bool(self.uuids)


# ---------------------------------------------------------------- mounts


class Mount(Strict):
    source: PathText
    target: str
    read_only: Flag = False
    create: Flag = True

    @field_validator("target")
    @classmethod
    def _target(cls, v: str) -> str:
        v = _abs_path(v, "a mount target")
        if v.rstrip("/") == "":
            raise ValueError("a mount target cannot be the environment's root")
        return v.rstrip("/")

    @field_validator("source")
    @classmethod
    def _source(cls, v: str) -> str:
        if not v or any(part == ".." for part in v.split("/")):
            raise ValueError("a mount source is an absolute path or a name under the "
                             "environment's data directory, without '..'")
        return v


# ---------------------------------------------------------------- host tuning


def _scalar_text(v: Any, rule: str) -> str:
    """A YAML scalar as the kernel reads it: true/false as 1/0, numbers as written."""
    if isinstance(v, bool):
        return "1" if v else "0"
    if isinstance(v, int | str) or isinstance(v, float) and math.isfinite(v):
        return str(v)
    raise ValueError(f"{rule}, not {_shown(v)}")


SYSCTL_RULE = ("a sysctl value is one line of text, a finite number, true/false or a list of "
               "those, without control characters")


def _sysctl_value(v: Any) -> str:
    """The text written to /proc/sys: a list becomes tab-separated fields, as the kernel prints
    them. One write is one value: a newline would be cut or read as a second field."""
    items = v if isinstance(v, list) else [v]
    if not items:
        raise ValueError("a sysctl value cannot be an empty list")
    for x in items:
        if isinstance(x, int) and not isinstance(x, bool) and not (
                SYSCTL_INT[0] <= x <= SYSCTL_INT[1]):
            raise ValueError(f"a sysctl number must fit in 64 bits, not {_shown(x)}")
    text = "\t".join(_scalar_text(x, SYSCTL_RULE) for x in items)
    if any((c < " " and c != "\t") or c == "\x7f" for c in text):
        raise ValueError(f"{SYSCTL_RULE}, not {_shown(text)}")
    if not text.strip():
        raise ValueError("a sysctl value cannot be empty: writing nothing changes nothing")
    return text


class SysctlItem(Strict):
    value: Annotated[str, BeforeValidator(_sysctl_value)]
    policy: Policy = "required"

    @model_validator(mode="before")
    @classmethod
    def _scalar(cls, data: Any) -> Any:
        # The shorthand is checked here, so that its errors point at the sysctl itself.
        return data if isinstance(data, dict) else {"value": _sysctl_value(data)}


def _option_value(v: Any) -> str:
    """A module option's value: a list is an array parameter (`a=1,2`). modprobe hands all
    options to the kernel as one string, which the kernel splits at whitespace (by its own
    isspace(), which also takes byte 0xa0, inside many UTF-8 characters), with quotes grouping
    words: so printable ASCII only, without spaces or quotes."""
    rule = "a module option's value is text, a number, true/false or a list of those"
    text = ",".join(_scalar_text(x, rule) for x in v) if isinstance(v, list) and v else \
        _scalar_text(v, rule)
    if not all("!" <= c <= "~" and c not in "\"'" for c in text):
        raise ValueError("a module option's value is printable ASCII without spaces or quotes "
                         f"(modprobe would split it into more options), not {_shown(text)}")
    return text


class Module(Strict):
    name: ModuleName
    options: dict[ModuleOptionKey, Annotated[str, BeforeValidator(_option_value)]] = {}
    policy: Policy = "required"

    @model_validator(mode="before")
    @classmethod
    def _scalar(cls, data: Any) -> Any:
        return {"name": data} if isinstance(data, str) else data


class Governor(Strict):
    # CPUFREQ_NAME_LEN is 16 with the NUL.
    name: Annotated[str, _pattern(r"[a-z0-9_]{1,15}", "a governor name is 1-15 characters of "
                                  "a-z, 0-9 and '_', like performance")]
    cpus: Literal["all", "dedicated"] = "all"
    policy: Policy = "best-effort"

    @model_validator(mode="before")
    @classmethod
    def _scalar(cls, data: Any) -> Any:
        return {"name": data} if isinstance(data, str) else data


class HostTuning(Strict):
    sysctls: dict[SysctlName, SysctlItem] = {}
    modules: list[Module] = []
    governor: Governor | None = None

    @field_validator("modules")
    @classmethod
    def _unique(cls, v: list[Module]) -> list[Module]:
        _repeats([m.name.replace("-", "_") for m in v], lambda name: f"module {name}")
        return v


# ---------------------------------------------------------------- service


def _restart_sec(v: Any) -> Any:
    if (isinstance(v, bool) or not isinstance(v, int | float)
            or not (math.isfinite(v) and 0 <= v <= RESTART_SEC_MAX)):
        raise ValueError(f"restart_sec must be a finite number of seconds from 0 to "
                         f"{RESTART_SEC_MAX}, like 1.5, not {_shown(v)}")
    return v


class Service(Strict):
    command: tuple[Annotated[str, AfterValidator(_no_nul)], ...]
    restart: Literal["no", "on-failure", "always"] = "on-failure"
    restart_sec: Annotated[float, BeforeValidator(_restart_sec)] = 1.0

    @field_validator("restart", mode="before")
    @classmethod
    def _yaml_no(cls, v: Any) -> Any:
        # YAML 1.1 reads an unquoted `restart: no` as false.
        return "no" if v is False else v

    @field_validator("command", mode="before")
    @classmethod
    def _argv(cls, v: Any) -> Any:
        # A string is split like a shell would, but never run through one.
        if isinstance(v, str):
            v = shlex.split(v)
        if not v:
            raise ValueError("the service command is empty")
        return v


# ---------------------------------------------------------------- runtime


def _capability(v: Any) -> Any:
    from envctl.caps import NUMBERS

    name = v.upper().removeprefix("CAP_") if isinstance(v, str) else v
    if name not in NUMBERS:
        raise ValueError(f"{_shown(v)} is not a Linux capability (CHOWN, NET_BIND_SERVICE, "
                         "SYS_NICE, … with or without CAP_)")
    return name


class Gvisor(Strict):
    """How gVisor runs the environment's programs (`isolation: gvisor`)."""

    # runsc's platform: how the sandbox's kernel (the Sentry) intercepts system calls. ptrace
    # runs anywhere; kvm needs /dev/kvm (hardware virtualisation); systrap is newer runsc's
    # default. Checked at plan time against the platforms the host's runsc offers.
    platform: Literal["ptrace", "kvm", "systrap"] = "ptrace"


def _seccomp_setting(v: str) -> str:
    """runtime.seccomp: a named setting, or a profile read (and its syscall names resolved)
    now, so that its mistakes are the spec's, with the profile's own file:line."""
    if v in ("default", "unconfined"):
        return v
    if not v.startswith("/"):
        raise ValueError(f"seccomp is default, unconfined or an absolute path to a JSON "
                         f"profile, not {_shown(v)}")
    _abs_path(v, "a seccomp profile")
    from envctl.errors import InputError
    from envctl.runtime.seccomp import load_profile  # imports nothing heavy until called

    try:
        load_profile(v)
    except InputError as exc:
        raise ValueError(f"seccomp profile {exc}") from None
    return v


class Runtime(Strict):
    """How programs run inside the environment (exec, jobs, the service)."""

    # The capabilities root jobs keep in their bounding set; unset: Docker's default set
    # (envctl.caps.DEFAULT); [] none at all. Other users' jobs keep none whatever this says.
    capabilities: tuple[Annotated[str, BeforeValidator(_capability)], ...] | None = None
    # native: namespaces + pivot_root on the host's kernel (envctl.runtime.launch); gvisor:
    # the same environment, entered through gVisor's runsc (envctl.runtime.gvisor).
    isolation: Literal["native", "gvisor"] = "native"
    gvisor: Gvisor = Gvisor()
    # The seccomp filter of every program launched inside (envctl.runtime.seccomp): default
    # (Docker's default profile, its capability groups chosen by the capabilities kept),
    # unconfined (no filter), or an absolute path to an OCI/Docker-format JSON profile, read
    # and checked when the spec loads.
    seccomp: str = "default"
    # Allow creating user namespaces inside (rootless podman, buildah): unshare and clone with
    # any flags, for every user; by default the seccomp filter refuses unshare/clone with
    # CLONE_NEWUSER (clone3: ENOSYS) whatever the capabilities. No effect with seccomp:
    # unconfined, which refuses nothing.
    nested_userns: Flag = False
    # Run every native launch in a user namespace of the environment: root inside is an
    # unprivileged host uid of its own (a block allocated per environment, recorded in the
    # journal); a job's own user keeps its host ids (docs/security.md). false: root inside is
    # the host's root (limited by capabilities and seccomp only); `plan` warns about it.
    userns: Flag = True

    @field_validator("capabilities")
    @classmethod
    def _once(cls, v: tuple[str, ...] | None) -> tuple[str, ...] | None:
        return None if v is None else _unique(v, "capability")

    @field_validator("seccomp")
    @classmethod
    def _seccomp(cls, v: str) -> str:
        return _seccomp_setting(v)

    @model_validator(mode="after")
    def _gvisor_used(self) -> Runtime:
        # A gvisor section that nothing reads is a mistake the operator should hear of.
        if "gvisor" in self.model_fields_set and self.isolation != "gvisor":
            raise FieldFault([(("gvisor",), "runtime.gvisor is set but runtime.isolation is "
                               f"'{self.isolation}'; add isolation: gvisor or drop the section")])
        return self


# ---------------------------------------------------------------- access


def _account_name(what: str) -> BeforeValidator:
    """A login or group name as the host's databases spell it: POSIX's portable characters
    (letters, digits, '.', '_', '-', not starting with '-' or a digit; a trailing '$' for
    Samba's machine accounts), 1-32 of them. Numeric ids are refused: an id outlives the
    account it was given to (a uid reused after userdel would inherit the grant), and a
    reviewer of the spec reads names."""
    pattern = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]{0,31}\$?")

    def check(v: Any) -> Any:
        numbered = (isinstance(v, int) and not isinstance(v, bool)) or (
            isinstance(v, str) and v.isdigit())
        if numbered:
            raise ValueError(f"a {what} is named, not numbered: give the {what} name the "
                             f"host's {'passwd' if what == 'user' else 'group'} database has "
                             f"for {_shown(v)}")
        if not isinstance(v, str) or not pattern.fullmatch(v):
            raise ValueError(f"a {what} name is 1-32 letters, digits, '.', '_' and '-' (not "
                             f"starting with a digit, '-' or '.'), not {_shown(v)}")
        return v

    return BeforeValidator(check)


UserName = Annotated[str, _account_name("user")]
AccountGroup = Annotated[str, _account_name("group")]


class Grant(Strict):
    """Who one entry of `access:` names: host users (login names) and host groups."""

    users: tuple[UserName, ...] = ()
    groups: tuple[AccountGroup, ...] = ()

    @field_validator("users")
    @classmethod
    def _users_once(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        return _unique(v, "user")

    @field_validator("groups")
    @classmethod
    def _groups_once(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        return _unique(v, "group")


class Access(Strict):
    """Who may use the environment besides envctl's admins (root, the `envctl` group):
    `submit` may submit jobs, exec and list jobs (and read, cancel and wait for their own);
    `operate` may also bring it up and down, see its status and handle all its jobs
    (envctl.runtime.access). Without an `access:` section only admins may use it."""

    submit: Grant = Grant()
    operate: Grant = Grant()


# ---------------------------------------------------------------- jobs

# A job's stdout and stderr are each cut past this many bytes unless the spec says otherwise.
DEFAULT_MAX_OUTPUT = 1 << 30
# One user's jobs in an environment, pending and running (Slurm's MaxSubmitJobs), and the
# bytes their queued jobs' staged programs may hold, unless the spec says otherwise: the
# queue is root's state disk, and one user must not fill it nor block everyone behind them.
DEFAULT_MAX_QUEUED_PER_USER = 1000
DEFAULT_MAX_STAGED_PER_USER = 10 << 30


def _max_output(v: Any) -> Any:
    # `0`, `none` (or YAML's null, false): no bound; else a size (512M, 1G).
    if v is None or v is False or (isinstance(v, str) and v.strip().lower() in ("none", "0")):
        return 0
    return parse_size(v)


class Jobs(Strict):
    """Bounds on the environment's jobs (`jobs:`): the queue's limits (envctl.runtime.queue:
    how many of its jobs may run at once, in all and per user, Slurm's MaxJobs and
    MaxJobsPerUser; unset: unlimited; a job over a limit waits PENDING, reason MaxRunning /
    MaxRunningPerUser), how many jobs and staged bytes one user may have in it (a submit past
    them is refused) and each job's output bound."""

    max_running: Annotated[int | None, _whole(1, 1_000_000)] = None
    max_running_per_user: Annotated[int | None, _whole(1, 1_000_000)] = None
    # The most jobs one user may have in the environment, pending and running (Slurm's
    # MaxSubmitJobs), and the most bytes the staged programs of one user's queued jobs may
    # hold (0 or `none`: unbounded): past either, submit-job is refused (exit 1), nothing
    # staged (docs/runtime.md, "Queue").
    max_queued_per_user: Annotated[int, _whole(1, 1_000_000)] = DEFAULT_MAX_QUEUED_PER_USER
    max_staged_per_user: Annotated[int, BeforeValidator(_max_output)] = (
        DEFAULT_MAX_STAGED_PER_USER)

    # The most bytes of a job's stdout and of its stderr (each; one file given for both: of
    # it) kept in their files; past it one line says so and the job's next write gets EPIPE
    # (docs/runtime.md, "Output bound"). 0 or `none`: unbounded (the job writes the file).
    max_output: Annotated[int, BeforeValidator(_max_output)] = DEFAULT_MAX_OUTPUT


# ---------------------------------------------------------------- the environment


class EnvSpec(Strict):
    name: EnvName
    kind: Literal["gpu", "cpu"]
    description: str = ""
    network: Network | None = None
    rootfs: Rootfs = Rootfs()
    resources: Resources = Resources()
    gpus: Gpus = Gpus()
    mounts: list[Mount] = []
    host: HostTuning = HostTuning()
    service: Service | None = None
    runtime: Runtime = Runtime()
    access: Access | None = None
    jobs: Jobs = Jobs()

    # Cross-field rules as field validators (fields validate in the order above, and
    # info.data holds those before that passed): each is reported at the field it is about,
    # and found in the same run as the errors of unrelated fields.
    @field_validator("gpus")
    @classmethod
    def _gpus_of_kind(cls, v: Gpus, info: ValidationInfo) -> Gpus:
        if info.data.get("kind") == "cpu" and v.wanted:
            raise ValueError("a kind: cpu environment cannot claim GPUs; use kind: gpu")
        return v

    @model_validator(mode="after")
    def _near_gpus_has_gpus(self) -> EnvSpec:
        # Placement near the GPUs needs GPUs to be near to.
        res, faults = self.resources, []
        if isinstance(res.cpu.dedicated, NearGpuCpus) and not self.gpus.wanted:
            faults.append((("resources", "cpu", "dedicated", "near_gpus"),
                           "dedicated CPUs near_gpus need GPUs, and this environment claims "
                           "none (set gpus:, or list the CPUs)"))
        if res.memory.nodes == NEAR_GPUS and not self.gpus.wanted:
            faults.append((("resources", "memory", "nodes"),
                           "memory nodes near_gpus need GPUs, and this environment claims none "
                           "(set gpus:, or list the nodes)"))
        if faults:
            raise FieldFault(faults)
        return self

    @field_validator("mounts")
    @classmethod
    def _targets_once(cls, v: list[Mount]) -> list[Mount]:
        _repeats([m.target for m in v], lambda t: f"mount target {t}", verb="used",
                 at=("target",))
        return v

    @field_validator("host")
    @classmethod
    def _governor_cpus(cls, v: HostTuning, info: ValidationInfo) -> HostTuning:
        res = info.data.get("resources")
        if (res is not None and v.governor and v.governor.cpus == "dedicated"
                and res.cpu.dedicated is None):
            raise FieldFault([(("governor", "cpus"), "host.governor.cpus is 'dedicated' but "
                               "resources.cpu.dedicated is unset")])
        return v
