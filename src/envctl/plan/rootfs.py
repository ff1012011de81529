"""Planning an environment's root filesystem and its mounts. Pure.

The tree (the spec's binaries with their shared-library closures, /etc, mount points) is one
`rootfs` step on disk. Every mount lives in the environment's own persistent mount namespace
(see docs/rootfs.md): the rootfs bound onto itself read-only, /dev with only the safe nodes and
the environment's GPUs, /tmp, /sys read-only, the host's Python standard library, the NVIDIA
driver libraries and the CUDA toolkit read-only, and the data mounts. The host's mount table
gets only the namespace's holder."""

from __future__ import annotations

from typing import TYPE_CHECKING

from envctl.facts import RootfsFacts
from envctl.plan.gpus import ENV_KEY, NODES_KEY
from envctl.resources.dirs import Directory, SharedDirectory

if TYPE_CHECKING:
    from envctl.facts import HostFacts
    from envctl.plan.builder import Plan
    from envctl.spec.models import EnvSpec

# Mounted over in every environment: nothing placed in the tree below them would be seen.
HIDDEN = ("/dev/", "/proc/", "/sys/", "/tmp/")
PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
RO = ("ro", "nosuid", "nodev")
NSSWITCH = ("passwd: files\ngroup: files\nshadow: files\nhosts: files dns\nnetworks: files\n"
            "protocols: files\nservices: files\nethers: files\nrpc: files\n")


def wants_rootfs(spec: EnvSpec) -> bool:
    """An environment has a root filesystem when its spec describes one, mounts data into it
    or gives it GPUs (whose nodes and libraries live there)."""
    return spec.rootfs != type(spec.rootfs)() or bool(spec.mounts) or spec.gpus.wanted


def rootfs_path(spec: EnvSpec, facts: HostFacts) -> str:
    return spec.rootfs.path or f"{facts.state_dir}/rootfs/{spec.name}"


def data_dir(spec: EnvSpec, facts: HostFacts) -> str:
    """The environment's data directory, which `down` keeps (unless --purge)."""
    return f"{facts.state_dir}/data/{spec.name}"


def data_path(spec: EnvSpec, facts: HostFacts, source: str) -> str:
    """A mount's source on the host: absolute as given, else under the data directory."""
    return source if source.startswith("/") else f"{data_dir(spec, facts)}/{source}"


def _missing_at(spec: EnvSpec, item: str) -> tuple:
    """Where the spec asks for what the host lacks (`binary nvidia-smi` -> the entry of
    rootfs.binaries naming it); the section for what no entry names (a library's closure)."""
    kind, _, name = item.partition(" ")
    if kind == "binary" and name in spec.rootfs.binaries:
        return ("rootfs", "binaries", spec.rootfs.binaries.index(name))
    if kind == "library" and name in spec.rootfs.libraries:
        return ("rootfs", "libraries", spec.rootfs.libraries.index(name))
    if item == "python":
        return ("rootfs", "python")
    return ("rootfs",)


def plan_rootfs(spec: EnvSpec, facts: HostFacts, plan: Plan) -> None:
    if not wants_rootfs(spec):
        return
    # Imported here: a command planning environments without a rootfs never pays for these
    # kinds (~7 ms of module execution).
    from envctl.resources.mounts import EnvDev, Mount, MountNamespace, MountNamespaceDir
    from envctl.resources.rootfs import RootfsTree
    found = facts.rootfs.get(spec.name, RootfsFacts())
    for loc, why in facts.unsafe_paths.get(spec.name, ()):
        plan.error(loc, why)
    for item, why in found.missing:
        plan.error(_missing_at(spec, item), f"{item}: {why}")
    root = rootfs_path(spec, facts)
    files = {f.path: (f.path, f.source, f.link) for f in found.files}
    for path in sorted(files):
        if path.startswith(HIDDEN):
            plan.error(("rootfs", "binaries"), f"{path} would be placed under "
                       f"{'/' + path.split('/')[1]}, which is mounted over in the environment; "
                       "install it elsewhere (/opt, /usr/local)")
    generated = {p: (p, text, mode) for p, text, mode in _etc(spec, facts, plan)}
    for i, entry in enumerate(spec.rootfs.files):
        if entry.content is not None:
            generated[entry.path] = (entry.path, entry.content, entry.mode)
            files.pop(entry.path, None)
        else:
            files[entry.path] = (entry.path, entry.source, "")
        if entry.path.startswith(HIDDEN):
            plan.error(("rootfs", "files", i, "path"), f"{entry.path} is under a directory "
                       "mounted over in the environment (/dev, /proc, /sys, /tmp)")
    dirs: dict[str, int] = {}
    placeholders: list[str] = []
    binds: list[Mount] = []
    for d in found.binds:
        dirs[d] = 0o755
        binds.append(Mount(spec.name, root, d, d, "bind", RO))
    if spec.gpus.wanted:
        for lib in facts.gpu.libraries:
            if lib.link:
                files[lib.path] = (lib.path, lib.source, lib.link)
            else:
                placeholders.append(lib.path)
                files.pop(lib.path, None)
                binds.append(Mount(spec.name, root, lib.path, lib.source, "bind", RO, file=True))
        if spec.gpus.toolkit:
            dirs[spec.gpus.toolkit] = 0o755
            binds.append(Mount(spec.name, root, spec.gpus.toolkit, spec.gpus.toolkit, "bind",
                               RO))
    data: list[Mount] = []
    for i, m in enumerate(spec.mounts):
        if m.target in ("/dev", "/proc", "/sys", "/tmp") or m.target.startswith(HIDDEN):
            plan.error(("mounts", i, "target"), f"{m.target} is managed by envctl (/dev, /proc, "
                       "/sys and /tmp are mounted in every environment, over anything below "
                       "them)")
            continue
        source = data_path(spec, facts, m.source)
        if m.create:
            if m.source.startswith("/"):
                # Other specs may mount the same host directory: shared through the ledger.
                plan.add(SharedDirectory("host", source.lstrip("/"), 0o755, keep=True),
                         ("mounts", i, "source"))
            else:
                # Root inside owns it (its user namespace's host id), when it has one.
                owner = facts.userns_assigned.get(spec.name, -1)
                plan.add(Directory("state", f"data/{spec.name}/{m.source}", 0o755, keep=True,
                                   owner=owner), ("mounts", i, "source"))
        dirs[m.target] = 0o755
        options = (("ro",) if m.read_only else ()) + ("nosuid", "nodev")
        beneath = "" if m.source.startswith("/") else data_dir(spec, facts)
        data.append(Mount(spec.name, root, m.target, source, "bind", options, beneath=beneath))

    plan.add(RootfsTree(spec.name, root, links=found.links, files=tuple(sorted(files.values())),
                        generated=tuple(sorted(generated.values())),
                        dirs=tuple(sorted(dirs.items())), placeholders=tuple(placeholders)),
             ("rootfs",))
    plan.add(MountNamespaceDir())
    plan.add(MountNamespace(spec.name))
    # The tree read-only first: every other mount goes on top of it.
    plan.add(Mount(spec.name, root, "/", root, "bind", RO))
    plan.add(EnvDev(spec.name, root, tuple(plan.resolved.get(NODES_KEY, ()))))
    plan.add(Mount(spec.name, root, "/tmp", "tmpfs", "tmpfs", ("nosuid", "nodev"),
                   data="mode=1777"))
    plan.add(Mount(spec.name, root, "/sys", "sysfs", "sysfs", ("ro", "nosuid", "nodev", "noexec"),
                   netns=spec.name if spec.network is not None else ""))
    for res in binds + data:
        plan.add(res, ("mounts",))
    plan.resolved["rootfs"] = root


def _etc(spec: EnvSpec, facts: HostFacts, plan: Plan) -> list[tuple[str, str, int]]:
    """/etc files every rootfs gets: environment, hostname, hosts, resolv.conf, passwd, group
    and nsswitch.conf."""
    env = {"PATH": PATH, **spec.rootfs.env}
    threads = plan.resolved.get("threads")
    for name in spec.rootfs.thread_env:
        if threads is not None:
            env[name] = str(threads)
    env.update(plan.resolved.get(ENV_KEY, {}))
    environment = "".join(f"{k}={v}\n" for k, v in env.items())
    hosts = "127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n"
    if spec.network is not None:
        hosts += f"{spec.network.address}\t{spec.name}\n"
    else:
        hosts += f"127.0.1.1\t{spec.name}\n"
    resolv = facts.resolv_conf
    if spec.network is not None and _loopback_only(resolv):
        plan.warn("the host's /etc/resolv.conf names only loopback nameservers, which the "
                  "environment's network namespace cannot reach: name lookups fail inside "
                  "(give rootfs.files an /etc/resolv.conf)")
    groups = {"root": 0, "tty": 5, "nogroup": 65534}
    if spec.gpus.wanted and not spec.gpus.group.isdigit() and spec.gpus.group in facts.groups:
        groups[spec.gpus.group] = facts.groups[spec.gpus.group]
    group = "".join(f"{name}:x:{gid}:\n" for name, gid in sorted(groups.items(),
                                                                    key=lambda kv: kv[1]))
    passwd = ("root:x:0:0:root:/root:/bin/sh\n"
              "nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n")
    return [("/etc/environment", environment, 0o644), ("/etc/hostname", f"{spec.name}\n", 0o644),
            ("/etc/hosts", hosts, 0o644), ("/etc/resolv.conf", resolv, 0o644),
            ("/etc/passwd", passwd, 0o644), ("/etc/group", group, 0o644),
            ("/etc/nsswitch.conf", NSSWITCH, 0o644)]


def _loopback_only(resolv: str) -> bool:
    servers = [line.split()[1] for line in resolv.splitlines()
               if line.startswith("nameserver") and len(line.split()) > 1]
    return bool(servers) and all(s.startswith("127.") or s == "::1" for s in servers)
