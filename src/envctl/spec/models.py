"""Pydantic models of one environment spec; pure data, no I/O."""

from __future__ import annotations

import ipaddress
import re
import shlex
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    field_validator,
    model_validator,
)

from envctl.spec.units import parse_cpu_list, parse_percent, parse_size

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
EnvVarName = Annotated[str, StringConstraints(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")]
SysctlName = Annotated[str, StringConstraints(pattern=r"^[a-z0-9_]+(?:\.[A-Za-z0-9_-]+)+$")]
# A leading '-' would make modprobe read the name as an option.
ModuleName = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9][A-Za-z0-9_-]{0,54}$")]
# Module parameters: modprobe parses `key=value` after the name as options too, so keys are
# plain identifiers and values carry no whitespace control characters.
ModuleOptionKey = Annotated[str, StringConstraints(pattern=r"^[A-Za-z_][A-Za-z0-9_.]*$")]
ModuleOptionValue = Annotated[str, StringConstraints(pattern=r"^[^\x00-\x1f]*$")]
Policy = Literal["required", "best-effort"]
Port = Annotated[int, Field(ge=1, le=65535)]


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def _abs_path(value: str, what: str) -> str:
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
            return {"host": data, "port": data}
        if isinstance(data, str):
            m = re.fullmatch(r"(\d+)(?::(\d+))?(?:/(tcp|udp))?", data.strip())
            if not m:
                raise ValueError("a port forward is HOST[:ENV][/tcp|udp], e.g. 8080:80/tcp")
            host, env, proto = m.groups()
            return {"host": int(host), "port": int(env or host), "protocol": proto or "tcp"}
        return data


class Network(Strict):
    bridge: IfName = "compute-bridge"
    bridge_address: ipaddress.IPv4Interface = ipaddress.IPv4Interface("10.200.0.1/24")
    address: ipaddress.IPv4Address
    gateway: ipaddress.IPv4Address | None = None
    interface: IfName = "eth0"
    nat: bool = True
    isolate: bool = True
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

    @model_validator(mode="after")
    def _addresses_fit(self) -> Network:
        net = self.bridge_address.network
        if self.address not in net:
            raise ValueError(f"address {self.address} is outside the bridge subnet {net}")
        if self.address in (net.network_address, net.broadcast_address):
            raise ValueError(f"address {self.address} is the network or broadcast address of {net}")
        if self.address == self.bridge_address.ip:
            raise ValueError(f"address {self.address} is the bridge's own address")
        if self.gateway is not None and self.gateway not in net:
            raise ValueError(f"gateway {self.gateway} is outside the bridge subnet {net}")
        if self.gateway == self.address:
            raise ValueError("the gateway cannot be the environment's own address")
        seen: set[tuple[int, str]] = set()
        for pf in self.ports:
            if (pf.host, pf.protocol) in seen:
                raise ValueError(f"host port {pf.host}/{pf.protocol} is forwarded twice")
            seen.add((pf.host, pf.protocol))
        return self

    @property
    def gateway_ip(self) -> ipaddress.IPv4Address:
        return self.gateway or self.bridge_address.ip

    @property
    def subnet(self) -> ipaddress.IPv4Network:
        return self.bridge_address.network


# ---------------------------------------------------------------- rootfs


class FileEntry(Strict):
    path: str
    content: str | None = None
    source: str | None = None
    mode: int = 0o644

    @field_validator("path")
    @classmethod
    def _path(cls, v: str) -> str:
        return _abs_path(v, "a file's path inside the environment")

    @model_validator(mode="after")
    def _one_origin(self) -> FileEntry:
        if (self.content is None) == (self.source is None):
            raise ValueError("give exactly one of 'content' or 'source'")
        return self


class Rootfs(Strict):
    path: str | None = None
    binaries: list[str] = []
    libraries: list[str] = []
    python: bool = False
    files: list[FileEntry] = []
    env: dict[EnvVarName, str] = {}
    thread_env: list[EnvVarName] = []

    @field_validator("path")
    @classmethod
    def _path(cls, v: str | None) -> str | None:
        return None if v is None else _abs_path(v, "rootfs.path")

    @field_validator("env", mode="before")
    @classmethod
    def _stringify(cls, v: Any) -> Any:
        if isinstance(v, dict):
            return {k: (str(x).lower() if isinstance(x, bool) else str(x)) for k, x in v.items()}
        return v


# ---------------------------------------------------------------- resources


class Quantity(Strict):
    """Bytes, or a percentage of the host's memory resolved at plan time."""

    bytes: int | None = None
    percent: float | None = None

    @model_validator(mode="before")
    @classmethod
    def _parse(cls, data: Any) -> Any:
        if isinstance(data, dict):
            return data
        pct = parse_percent(data) if isinstance(data, str) else None
        if pct is not None:
            if not 0 < pct <= 100:
                raise ValueError(f"{data} is not a share of host memory: use more than 0% and at "
                                 "most 100%")
            return {"percent": pct}
        try:
            return {"bytes": parse_size(data)}
        except ValueError as exc:
            raise ValueError(f"{exc}, or a percentage of host memory like 70%") from None

    def resolve(self, total: int) -> int:
        if self.bytes is not None:
            return self.bytes
        assert self.percent is not None
        return int(total * self.percent / 100) // 4096 * 4096

    def __str__(self) -> str:
        return f"{self.percent:g}%" if self.percent is not None else str(self.bytes)


class ReservedCpus(Strict):
    """Dedicated CPUs as "all online CPUs but the first N and the last M"."""

    reserve_first: int = Field(0, ge=0)
    reserve_last: int = Field(0, ge=0)
    # What to do on a host too small to leave any CPU after the reservation:
    # `share` runs the environment on all online CPUs (a warning in plan), `error` refuses.
    small_host: Literal["share", "error"] = "error"


class Cpu(Strict):
    quota: float | None = None
    period_us: int = Field(100_000, ge=1_000, le=1_000_000)
    weight: int | None = Field(None, ge=1, le=10_000)
    dedicated: tuple[int, ...] | ReservedCpus | None = None

    @field_validator("quota", mode="before")
    @classmethod
    def _quota(cls, v: Any) -> Any:
        if v is None:
            return v
        pct = parse_percent(v) if isinstance(v, str) else None
        value = pct if pct is not None else v
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError("quota is a percentage of one CPU, like 150% (as systemd's CPUQuota)")
        if value <= 0:
            raise ValueError("quota must be above 0%")
        return float(value)

    @field_validator("dedicated", mode="before")
    @classmethod
    def _dedicated(cls, v: Any) -> Any:
        if v is None or isinstance(v, dict):
            return v
        cpus = parse_cpu_list(v)
        if not cpus:
            raise ValueError("an empty CPU list: leave 'dedicated' out to share all CPUs")
        return cpus


class Memory(Strict):
    max: Quantity | None = None
    high: Quantity | None = None
    swap_max: Quantity | None = None
    nodes: tuple[int, ...] | None = None

    @field_validator("nodes", mode="before")
    @classmethod
    def _nodes(cls, v: Any) -> Any:
        return None if v is None else parse_cpu_list(v)

    @model_validator(mode="after")
    def _high_below_max(self) -> Memory:
        mx, hi = self.max, self.high
        # Comparable only when both are in the same unit; mixed ones are checked at plan time.
        if mx and hi and (mx.percent is None) == (hi.percent is None):
            above = (hi.percent > mx.percent) if mx.percent is not None else hi.bytes > mx.bytes
            if above:
                raise ValueError("memory.high is above memory.max")
        return self


class Io(Strict):
    weight: int | None = Field(None, ge=1, le=10_000)


class Pids(Strict):
    max: int | None = Field(None, ge=1)


class Resources(Strict):
    driver: Literal["auto", "cgroupfs", "systemd"] = "auto"
    cpu: Cpu = Cpu()
    memory: Memory = Memory()
    io: Io = Io()
    pids: Pids = Pids()


# ---------------------------------------------------------------- gpus


class Gpus(Strict):
    """Which GPUs the environment gets: none, all, a count, indices or UUIDs."""

    count: int | None = Field(None, ge=0)
    indices: tuple[int, ...] = ()
    uuids: tuple[str, ...] = ()
    all: bool = False

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
                if len(set(data)) != len(data):
                    raise ValueError("a GPU index is listed twice")
                return {"indices": data}
            if all(isinstance(x, str) and x.startswith(("GPU-", "MIG-")) for x in data):
                if len(set(data)) != len(data):
                    raise ValueError("a GPU UUID is listed twice")
                return {"uuids": data}
            raise ValueError("list either GPU indices (0, 1, …) or UUIDs (GPU-…), not a mix")
        if isinstance(data, dict):
            return data
        raise ValueError("gpus is none, all, a count, a list of indices or a list of UUIDs")

    @property
    def wanted(self) -> bool:
        return self.all or bool(self.count) or bool(self.indices) or bool(self.uuids)


# ---------------------------------------------------------------- mounts


class Mount(Strict):
    source: str
    target: str
    read_only: bool = False
    create: bool = True

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


class SysctlItem(Strict):
    value: str
    policy: Policy = "required"

    @model_validator(mode="before")
    @classmethod
    def _scalar(cls, data: Any) -> Any:
        if isinstance(data, dict):
            return {**data, "value": _sysctl_value(data.get("value"))}
        return {"value": _sysctl_value(data)}


def _sysctl_value(v: Any) -> Any:
    if isinstance(v, bool):
        return "1" if v else "0"
    if isinstance(v, int | float):
        return str(v)
    if isinstance(v, list):
        return "\t".join(str(x) for x in v)
    return v


class Module(Strict):
    name: ModuleName
    options: dict[ModuleOptionKey, ModuleOptionValue] = {}
    policy: Policy = "required"

    @model_validator(mode="before")
    @classmethod
    def _scalar(cls, data: Any) -> Any:
        if isinstance(data, str):
            return {"name": data}
        if isinstance(data, dict) and isinstance(data.get("options"), dict):
            return {**data, "options": {k: str(v) for k, v in data["options"].items()}}
        return data


class Governor(Strict):
    name: Annotated[str, StringConstraints(pattern=r"^[a-z0-9_]+$")]
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
        names = [m.name.replace("-", "_") for m in v]
        if len(set(names)) != len(names):
            raise ValueError("a module is listed twice")
        return v


# ---------------------------------------------------------------- service


class Service(Strict):
    command: tuple[str, ...]
    restart: Literal["no", "on-failure", "always"] = "on-failure"
    restart_sec: float = Field(1.0, ge=0)

    @field_validator("command", mode="before")
    @classmethod
    def _argv(cls, v: Any) -> Any:
        # A string is split like a shell would, but never run through one.
        if isinstance(v, str):
            v = shlex.split(v)
        if not v:
            raise ValueError("the service command is empty")
        return v


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

    @model_validator(mode="after")
    def _consistent(self) -> EnvSpec:
        if self.kind == "cpu" and self.gpus.wanted:
            raise ValueError("a kind: cpu environment cannot claim GPUs; use kind: gpu")
        targets = [m.target for m in self.mounts]
        dup = {t for t in targets if targets.count(t) > 1}
        if dup:
            raise ValueError(f"mount target {sorted(dup)[0]} is used twice")
        if (self.host.governor and self.host.governor.cpus == "dedicated"
                and self.resources.cpu.dedicated is None):
            raise ValueError("host.governor.cpus is 'dedicated' but resources.cpu.dedicated "
                             "is unset")
        return self
