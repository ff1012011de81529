"""Resource kinds, one module per kernel object.

`MODULES` names the module of every kind a journal may hold, so that loading a journal imports
only the kinds it names (and their host adapters): `down` of a network-only environment never
loads the cgroup, systemd or module code. tests/unit/test_engine.py checks the table against
the classes each module defines.
"""

MODULES = {
    "antispoof": "firewall",
    "base-dir": "dirs",
    "bridge": "bridge",
    "cgroup-parent": "cgroup",
    "cgroup": "cgroup",
    "cgroup-devices": "cgroup",
    "cgroup-parent-slice": "cgroup_systemd",
    "cgroup-slice": "cgroup_systemd",
    "cgroup-char-link": "cgroup_systemd",
    "dir": "dirs",
    "firewall": "firewall",
    "firewall-base": "firewall",
    "governor": "governor",
    "kmod": "kmod",
    "mig-instance": "mig",
    "mig-mode": "mig",
    "mntns-dir": "mounts",
    "mntns": "mounts",
    "mount": "mounts",
    "env-dev": "mounts",
    "netns": "netns",
    "netns-dir": "netns",
    "rootfs": "rootfs",
    "service": "service",
    "shared-dir": "dirs",
    "sysctl": "sysctl",
    "veth": "veth",
    "ipconfig": "veth",
}
