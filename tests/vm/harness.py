"""A qemu VM with a real cgroup v2 kernel (Debian's 6.1) that runs a command on this host's
own root filesystem (9p, read-only) and hands back its output and exit status.

The recipe is DESIGN.md's: `apt-get download` the generic linux-image-6.1.0-*-amd64 package,
`dpkg -x` it, build a busybox initramfs whose /init loads the virtio + 9p modules, mounts the
host root read-only, proc/sys/dev, tmpfs on /tmp and /run, cgroup2 on /sys/fs/cgroup, a
writable 9p share for results, and switch_roots into the host root to run the command.
Downloads and builds are cached in $ENVCTL_VM_CACHE (default /var/cache/envctl-vm).
"""

from __future__ import annotations

import gzip
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

CACHE = Path(os.environ.get("ENVCTL_VM_CACHE", "/var/cache/envctl-vm"))
MODULES = ("virtio_ring", "virtio", "virtio_pci_modern_dev", "virtio_pci_legacy_dev",
           "virtio_pci", "netfs", "fscache", "9pnet", "9pnet_virtio", "9p")
QEMU = "qemu-system-x86_64"
# The mount options of the read-only 9p shares (the host root, the checkout). cache=loose:
# the guest keeps what it has read (pages, attributes, directory entries) instead of asking
# the host again on every open, stat and read; every Python start in the guest reads hundreds
# of files, and under TCG each round trip is slow. Safe because nothing the guest reads there
# changes while it runs (its results go to the uncached `out` share).
RO_9P = "trans=virtio,version=9p2000.L,ro,cache=loose,msize=262144"

INIT = """#!/bin/busybox sh
/bin/busybox --install -s /bin
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev
# No modules.dep in the package: load in order, retrying until every one is in.
for try in 1 2 3 4 5; do
  for m in {modules}; do insmod /lib/modules/$m.ko 2>/dev/null; done
done
mkdir -p /host
mount -t 9p -o {ro_9p} hostroot /host || echo "envctl-vm: no 9p root"
mount -t proc proc /host/proc
mount -t sysfs sys /host/sys
mount -t devtmpfs dev /host/dev
mkdir -p /host/dev/pts /host/dev/shm
mount -t devpts devpts /host/dev/pts
mount -t tmpfs tmp /host/tmp
mount -t tmpfs run /host/run
mount -t tmpfs shm /host/dev/shm
mount -t cgroup2 cgroup2 /host/sys/fs/cgroup
mkdir -p /host/tmp/out
mount -t 9p -o trans=virtio,version=9p2000.L out /host/tmp/out
# The checkout under test, at its own path: it may live under /tmp (a CI clone), which the
# tmpfs above hides.
repo=$(cat /host/tmp/out/repo_path)
mkdir -p "/host$repo"
mount -t 9p -o {ro_9p} repo "/host$repo"
echo "envctl-vm: running"
# switch_root, not chroot: the host root must be the mount namespace's root, or nsenter -m
# (the test sandboxes) would land back in this initramfs.
cat > /host/tmp/envctl-vm-init <<'END'
/bin/sh /tmp/out/run.sh > /tmp/out/log 2>&1
echo $? > /tmp/out/rc
sync
umount /tmp/out
echo 1 > /proc/sys/kernel/sysrq
echo o > /proc/sysrq-trigger
END
umount /proc /sys 2>/dev/null
exec switch_root /host /bin/sh /tmp/envctl-vm-init
"""


@dataclass
class Result:
    rc: int | None  # None: the command never finished (boot failure, timeout)
    log: str
    console: str


def _run(argv: list[str], **kw) -> subprocess.CompletedProcess:
    return subprocess.run(argv, check=True, capture_output=True, text=True, **kw)


def missing_tools() -> list[str]:
    return [t for t in (QEMU, "apt-get", "dpkg", "cpio", "depmod") if shutil.which(t) is None] + \
        ([] if _busybox() else ["busybox (busybox-static)"])


def _busybox() -> str | None:
    for p in ("/bin/busybox", "/usr/bin/busybox"):
        if Path(p).exists():
            return p
    return shutil.which("busybox")


def kernel() -> tuple[Path, Path]:
    """(vmlinuz, modules dir) of the newest Debian 6.1 generic kernel, downloaded once."""
    CACHE.mkdir(parents=True, exist_ok=True)
    done = CACHE / "kernel.done"
    if not done.exists():
        out = _run(["apt-cache", "search", "--names-only", r"^linux-image-6\.1\.0-[0-9]+-amd64$"])
        names = sorted((line.split()[0] for line in out.stdout.splitlines()),
                       key=lambda n: int(n.split("-")[3]))
        if not names:
            raise RuntimeError("apt-cache knows no linux-image-6.1.0-*-amd64 (apt-get update?)")
        for deb in CACHE.glob("*.deb"):
            deb.unlink()
        _run(["apt-get", "download", "-q", names[-1]], cwd=CACHE)
        deb = next(CACHE.glob("linux-image-*.deb"))
        shutil.rmtree(CACHE / "kernel", ignore_errors=True)
        _run(["dpkg", "-x", str(deb), str(CACHE / "kernel")])
        deb.unlink()
        done.write_text(names[-1] + "\n")
    vmlinuz = next((CACHE / "kernel/boot").glob("vmlinuz-*"))
    modules = next((CACHE / "kernel/lib/modules").iterdir())
    return vmlinuz, modules


def initramfs() -> Path:
    """The busybox initramfs (cached; rebuilt when this file's /init changes), with virtio_blk
    for `run`'s disk."""
    return _initramfs("initrd", INIT, (*MODULES, "virtio_blk"), dirs=("host",))


def _initramfs(name: str, template: str, wanted: tuple[str, ...], *,
               dirs: tuple[str, ...] = ()) -> Path:
    """CACHE/<name>.gz: busybox, `template` as /init (its {modules}: `wanted`, {ro_9p}:
    RO_9P), and the plain .ko of each of `wanted` (busybox insmod reads no compressed
    module); rebuilt only when /init changes."""
    init = template.format(modules=" ".join(wanted), ro_9p=RO_9P)
    _, modules = kernel()
    target, stamp = CACHE / f"{name}.gz", CACHE / f"{name}.init"
    if target.exists() and stamp.exists() and stamp.read_text() == init:
        return target
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for d in ("bin", "proc", "sys", "dev", "lib/modules", *dirs):
            (root / d).mkdir(parents=True)
        shutil.copy(_busybox(), root / "bin/busybox")
        for m in wanted:
            found = [p for p in modules.rglob(f"{m}.ko*") if p.is_file()]
            if not found:
                raise RuntimeError(f"module {m} not in the kernel package")
            if found[0].name.endswith((".xz", ".zst", ".gz")):
                raise RuntimeError(f"{found[0]} is compressed; busybox insmod needs plain .ko")
            shutil.copy(found[0], root / "lib/modules" / f"{m}.ko")
        _pack(root, init, target)
    stamp.write_text(init)
    return target


def run(script: str, *, timeout: float = 900, memory_mb: int = 1024, cpus: int = 2,
        disk_mb: int = 0) -> Result:
    """Boot the VM, run `script` (sh) as root in the host's root filesystem, power off. With
    `disk_mb`, the guest has a blank virtio disk of that size, /dev/vda: a block device for IO
    that io.stat counts (every filesystem of the guest is 9p or tmpfs, which it does not)."""
    vmlinuz, _ = kernel()
    initrd = initramfs()
    with tempfile.TemporaryDirectory(prefix="envctl-vm-") as tmp:
        out = Path(tmp) / "out"
        out.mkdir()
        out.chmod(0o777)
        drives = []
        if disk_mb:
            disk = Path(tmp) / "disk.img"
            with open(disk, "wb") as f:
                f.truncate(disk_mb << 20)
            drives = ["-drive", f"file={disk},format=raw,if=virtio"]
        return _boot(vmlinuz, initrd, "console=ttyS0 quiet panic=-1", out, script,
                     guest_out="/tmp/out", memory_mb=memory_mb, cpus=cpus, timeout=timeout,
                     extra=drives)


# ---------------------------------------------------------------- systemd as PID 1

# DESIGN.md's "systemd + cgroup v2" recipe: the host root (9p, read-only) is the lower layer
# of an overlayfs with a tmpfs upper layer, so systemd can write /etc and /var; a second 9p
# share (/out) holds the command and its results. /init switch_roots into systemd, which boots
# envctl-vm.target (basic.target + dbus + the unit that runs the command) on cgroup v2.
SYSTEMD_MODULES = (*MODULES, "overlay")
SYSTEMD_INIT = """#!/bin/busybox sh
/bin/busybox --install -s /bin
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev
for try in 1 2 3 4 5; do
  for m in {modules}; do insmod /lib/modules/$m.ko 2>/dev/null; done
done
mkdir -p /lower /upper /newroot
mount -t 9p -o {ro_9p} hostroot /lower || echo "envctl-vm: no 9p root"
mount -t tmpfs -o mode=755 upper /upper
mkdir -p /upper/data /upper/work
mount -t overlay overlay -o lowerdir=/lower,upperdir=/upper/data,workdir=/upper/work /newroot
mkdir -p /newroot/out
mount -t 9p -o trans=virtio,version=9p2000.L out /newroot/out
# The checkout under test at its own path, read-only: a CI clone may live under /tmp, whose
# contents systemd-tmpfiles empties at boot.
repo=$(cat /newroot/out/repo_path)
mkdir -p "/newroot$repo"
mount -t 9p -o {ro_9p} repo "/newroot$repo"
# Nothing of the host's own configuration: no fstab entries, no units it enables.
: > /newroot/etc/fstab
cp /newroot/out/envctl-vm.target /newroot/out/envctl-vm.service /newroot/etc/systemd/system/
ln -sf envctl-vm.target /newroot/etc/systemd/system/default.target
echo "envctl-vm: starting systemd"
umount /proc /sys /dev 2>/dev/null
exec switch_root /newroot /lib/systemd/systemd systemd.firstboot=off \
  systemd.unit=envctl-vm.target
"""
SYSTEMD_CMDLINE = ("console=ttyS0 quiet panic=-1 systemd.firstboot=off systemd.show_status=0 "
                   "systemd.unit=envctl-vm.target systemd.unified_cgroup_hierarchy=1")
SYSTEMD_TARGET = """[Unit]
Description=envctl VM test
Requires=basic.target
Wants=envctl-vm.service dbus.service
After=basic.target
AllowIsolate=yes
"""
SYSTEMD_SERVICE = """[Unit]
Description=envctl VM test command
After=basic.target dbus.service
[Service]
Type=oneshot
TimeoutStartSec=infinity
ExecStart=/bin/sh -c '/bin/sh /out/run.sh > /out/log 2>&1; echo $? > /out/rc; sync; \
systemctl poweroff -f'
"""


def systemd_initramfs() -> Path:
    """The initramfs that boots systemd (cached like `initramfs()`)."""
    return _initramfs("initrd-systemd", SYSTEMD_INIT, SYSTEMD_MODULES)


def run_systemd(script: str, *, timeout: float = 900, memory_mb: int = 2048,
                cpus: int = 2) -> Result:
    """Boot the VM with systemd as PID 1 on cgroup v2, run `script` (sh) as root from a
    oneshot unit once basic.target is reached, power off."""
    vmlinuz, _ = kernel()
    initrd = systemd_initramfs()
    with tempfile.TemporaryDirectory(prefix="envctl-vm-") as tmp:
        out = Path(tmp)
        out.chmod(0o777)
        (out / "envctl-vm.target").write_text(SYSTEMD_TARGET)
        (out / "envctl-vm.service").write_text(SYSTEMD_SERVICE)
        return _boot(vmlinuz, initrd, SYSTEMD_CMDLINE, out, script, memory_mb=memory_mb,
                     cpus=cpus, timeout=timeout)


# What a guest whose command runs too long is doing: every process (state, CPU, where it
# sleeps in the kernel), the kernel stack of each one in uninterruptible sleep and of each
# Python one, and systemd's jobs where systemd runs, then an end line (a dump without it was cut
# short). Written to OUT/stall.txt by `_watched`; a process's cmdline need not be UTF-8.
STALL_DUMP = r"""date; cat /proc/uptime /proc/loadavg
ps -eo pid,ppid,stat,pcpu,etimes,wchan:30,args
for p in /proc/[0-9]*; do
  st=$(sed 's/.*) //' "$p/stat" 2>/dev/null | cut -c1)
  case "$st $(tr '\0' ' ' < "$p/cmdline" 2>/dev/null)" in
    "D "*|*python*) echo "--- ${p#/proc/} $st $(tr '\0' ' ' < "$p/cmdline")"; cat "$p/stack";;
  esac
done
[ -d /run/systemd/system ] && systemctl list-jobs --no-pager
echo "--- end of dump"
"""


def _watched(script: str, guest_out: str, after: float) -> str:
    """`script` with a watchdog beside it: if it still runs `after` seconds in, STALL_DUMP goes
    to GUEST_OUT/stall.txt, which `_boot` adds to the result's log, so that a VM killed at
    its time-out says what it was stuck in. The watchdog goes when the script ends; the
    script's exit status is kept."""
    # The watchdog ends its own sleep when told to (its TERM trap): a `pkill -P` of the sleep
    # from outside missed it whenever the script ended before the subshell had forked it, and
    # the sleep outlived the script. A TERM before the trap is set ends the subshell before
    # any sleep; `$!` in the trap is the sleep once it is forked. (The subshell's stderr is
    # dropped: it would say "Terminated".)
    return ("(trap 'kill $! 2>/dev/null; exit 0' TERM; "
            f"sleep {int(after)} & wait $! && {{\n{STALL_DUMP}}} > {guest_out}/stall.txt 2>&1) "
            "2>/dev/null &\n"
            "envctl_vm_watchdog=$!\n"
            f"(\n{script}\n)\n"
            "envctl_vm_rc=$?\n"
            'kill "$envctl_vm_watchdog" 2>/dev/null\n'
            'exit "$envctl_vm_rc"\n')


def _boot(vmlinuz: Path, initrd: Path, cmdline: str, out: Path, script: str, *,
          guest_out: str = "/out", memory_mb: int, cpus: int, timeout: float,
          extra: list[str] | None = None) -> Result:
    """Boot qemu (TCG) with the host root and the checkout read-only on 9p and `out` writable
    (the guest's `guest_out`), run `script` there from out/run.sh (watched: `_watched`, at
    three quarters of `timeout`), `extra` qemu arguments (a disk); collect the results."""
    after = timeout * 0.75
    (out / "run.sh").write_text(_watched(script, guest_out, after))
    (out / "repo_path").write_text(str(REPO))
    argv = [QEMU, "-accel", "tcg", "-m", str(memory_mb), "-smp", str(cpus), "-nographic",
            "-kernel", str(vmlinuz), "-initrd", str(initrd), "-append", cmdline, "-no-reboot",
            "-virtfs", "local,path=/,mount_tag=hostroot,security_model=none,readonly=on,"
            "multidevs=remap",
            "-virtfs", f"local,path={out},mount_tag=out,security_model=none",
            "-virtfs", f"local,path={REPO},mount_tag=repo,security_model=none,readonly=on,"
            "multidevs=remap", *(extra or [])]
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout,
                              stdin=subprocess.DEVNULL)
        console = proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as exc:
        console = (exc.stdout or b"").decode(errors="replace") if isinstance(
            exc.stdout, bytes) else (exc.stdout or "")
        console += "\nenvctl-vm: timed out"
    rc_file, log_file = out / "rc", out / "log"
    rc = int(rc_file.read_text().strip()) if rc_file.exists() else None
    log = log_file.read_text(errors="replace") if log_file.exists() else ""
    stall = out / "stall.txt"
    if stall.exists():
        log += f"\n--- the guest's command was still running at {after:.0f} s:\n"
        log += stall.read_text(errors="replace")
    return Result(rc, log, console)


def guest_pytest(test_file: str, *, timeout: int) -> str:
    """The script that runs one guest test file with the host's Python inside the VM: each
    test's name before it runs (-v), so a VM that is killed says which test it was in; at
    `timeout` seconds a test fails with its traceback (pytest-timeout), and at half of that
    every thread's traceback is dumped (faulthandler) while it goes on. Keep `timeout` well
    under the VM's own, so that a stuck test is reported as one and the rest still run."""
    return (f"cd {shlex.quote(str(REPO))} && PYTHONDONTWRITEBYTECODE=1 "
            f"{shlex.quote(sys.executable)} -m pytest -p no:cacheprovider -o addopts= -rA "
            f"-v --durations=0 --durations-min=5 --timeout {timeout} "
            f"-o faulthandler_timeout={timeout // 2} {shlex.quote(test_file)}\n")


def assert_guest_passed(result: Result) -> None:
    tail = f"--- guest log\n{result.log[-6000:]}\n--- console\n{result.console[-3000:]}"
    assert result.rc == 0, tail
    assert " passed" in result.log and "skipped" not in result.log, tail


def _pack(root: Path, init: str, target: Path) -> None:
    """Write `init` into `root` and pack the tree as a gzipped newc initramfs at `target`."""
    (root / "init").write_text(init)
    (root / "init").chmod(0o755)
    files = subprocess.run(["find", "."], cwd=root, check=True, capture_output=True).stdout
    archive = subprocess.run(["cpio", "-o", "-H", "newc", "--quiet"], cwd=root, input=files,
                             check=True, capture_output=True).stdout
    tmp_target = target.with_suffix(".tmp")
    tmp_target.write_bytes(gzip.compress(archive, compresslevel=1))
    tmp_target.replace(target)


# ---------------------------------------------------------------- booting envctl's own units

# `run_systemd`'s VM, booted to multi-user.target as a host boots (through envctl-vm.target),
# for envctl's boot units (tests/vm/test_vm_boot.py). Before systemd starts, /init runs
# /out/preboot.sh chrooted into the new root (as an image build would: install the units,
# place state), with none of this host's own enabled units (postgresql, timers, gettys) and
# with the VM kernel's modules at /lib/modules/<release> (modprobe and the kernel's module
# autoloading: bridge, veth, nf_tables). The command runs from envctl-vm.service once
# envctl.service has started.
BOOT_INIT = SYSTEMD_INIT.replace(
    ': > /newroot/etc/fstab\n',
    ': > /newroot/etc/fstab\n'
    'rm -rf /newroot/etc/systemd/system/*.wants\n'
    'mkdir -p /newroot/usr/lib/modules\n'
    'ln -sfn "$(cat /newroot/out/modules_path)" "/newroot/usr/lib/modules/$(uname -r)"\n'
    'mount -t proc proc /newroot/proc\n'
    'mount -t devtmpfs dev /newroot/dev\n'
    'chroot /newroot /bin/sh /out/preboot.sh > /newroot/out/preboot.log 2>&1\n'
    'echo $? > /newroot/out/preboot.rc\n'
    'umount /newroot/proc /newroot/dev\n',
)
assert BOOT_INIT != SYSTEMD_INIT and "preboot" in BOOT_INIT
# The boot target pulls multi-user.target in, as a host boots (and with it the units
# `install-units` enabled), and the runner.
BOOT_TARGET = SYSTEMD_TARGET.replace("Wants=envctl-vm.service dbus.service",
                                     "Wants=multi-user.target envctl-vm.service dbus.service")
assert BOOT_TARGET != SYSTEMD_TARGET
# (Not After= the monitor: the guest test waits for it to serve, with a deadline.)
BOOT_SERVICE = SYSTEMD_SERVICE.replace(
    "After=basic.target dbus.service", "After=basic.target dbus.service envctl.service")


def kernel_modules() -> Path:
    """The VM kernel's module directory, with the modules.dep that modprobe needs (the
    package has none): depmod run once over the cached tree."""
    _, modules = kernel()
    if modules.is_relative_to("/tmp"):
        # BOOT_INIT links them in by this path, which systemd's tmpfs on /tmp hides: no
        # module would load (a bridge fails "Operation not supported").
        raise RuntimeError(f"ENVCTL_VM_CACHE is under /tmp ({CACHE}): the boot VM cannot "
                           "reach its kernel modules there; use another directory")
    if not (modules / "modules.dep").exists():
        _run(["depmod", "-b", str(CACHE / "kernel"), modules.name])
    return modules


def boot_initramfs() -> Path:
    """The initramfs of `run_systemd_boot` (cached like `initramfs()`)."""
    kernel_modules()
    return _initramfs("initrd-boot", BOOT_INIT, SYSTEMD_MODULES)


def run_systemd_boot(script: str, *, preboot: str, out: Path, clean_poweroff: bool = False,
                     timeout: float = 900, memory_mb: int = 2048, cpus: int = 2) -> Result:
    """Boot the VM to multi-user.target with systemd as PID 1 on cgroup v2, after `preboot`
    (sh, chrooted into the root-to-be before systemd starts; its output in out/preboot.log);
    run `script` (sh) once envctl.service has started; power off: `systemctl poweroff -f`
    (no unit is stopped, as at a power loss), or with `clean_poweroff` a plain `systemctl
    poweroff` (every unit stopped, as an operator shuts a host down). `out` (the guest's /out)
    is the caller's, so what one boot leaves there can go into the next."""
    vmlinuz, _ = kernel()
    initrd = boot_initramfs()
    out.mkdir(parents=True, exist_ok=True)
    out.chmod(0o777)
    for name in ("rc", "log", "stall.txt", "preboot.rc", "preboot.log", "shutdown.json",
                 "left_up_at", "shutdown_job"):
        (out / name).unlink(missing_ok=True)
    (out / "preboot.sh").write_text(preboot)
    (out / "modules_path").write_text(str(kernel_modules()))
    (out / "envctl-vm.target").write_text(BOOT_TARGET)
    service = BOOT_SERVICE
    if clean_poweroff:
        service = BOOT_SERVICE.replace("systemctl poweroff -f'", "systemctl poweroff'")
        assert service != BOOT_SERVICE
    (out / "envctl-vm.service").write_text(service)
    return _boot(vmlinuz, initrd, SYSTEMD_CMDLINE, out, script, memory_mb=memory_mb,
                 cpus=cpus, timeout=timeout)
