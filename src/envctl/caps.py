"""Linux capability names, by number, and the default set a root job keeps. Pure: the spec
(validating `runtime.capabilities`) and the runtime (dropping the rest) share this table
without either importing the other."""

# linux/capability.h, CAP_CHOWN (0) to CAP_CHECKPOINT_RESTORE (40).
NAMES = (
    "CHOWN", "DAC_OVERRIDE", "DAC_READ_SEARCH", "FOWNER", "FSETID", "KILL", "SETGID", "SETUID",
    "SETPCAP", "LINUX_IMMUTABLE", "NET_BIND_SERVICE", "NET_BROADCAST", "NET_ADMIN", "NET_RAW",
    "IPC_LOCK", "IPC_OWNER", "SYS_MODULE", "SYS_RAWIO", "SYS_CHROOT", "SYS_PTRACE",
    "SYS_PACCT", "SYS_ADMIN", "SYS_BOOT", "SYS_NICE", "SYS_RESOURCE", "SYS_TIME",
    "SYS_TTY_CONFIG", "MKNOD", "LEASE", "AUDIT_WRITE", "AUDIT_CONTROL", "SETFCAP",
    "MAC_OVERRIDE", "MAC_ADMIN", "SYSLOG", "WAKE_ALARM", "BLOCK_SUSPEND", "AUDIT_READ",
    "PERFMON", "BPF", "CHECKPOINT_RESTORE")
NUMBERS = {name: n for n, name in enumerate(NAMES)}
# The capabilities a root job keeps in its bounding, permitted and effective sets unless the
# spec says otherwise (`runtime.capabilities`): Docker's default set (moby oci/caps/defaults.go).
# No SYS_ADMIN (mount, setns, …), SYS_PTRACE, SYS_MODULE, NET_ADMIN, SYS_TIME, …: a root job owns
# its files and processes, not the host. Jobs of other users keep none.
DEFAULT = ("CHOWN", "DAC_OVERRIDE", "FSETID", "FOWNER", "MKNOD", "NET_RAW", "SETGID", "SETUID",
           "SETFCAP", "SETPCAP", "NET_BIND_SERVICE", "SYS_CHROOT", "KILL", "AUDIT_WRITE")
