#!/usr/bin/python
# Copyright: envctl contributors
# Apache License 2.0 (see https://www.apache.org/licenses/LICENSE-2.0)
"""What envctl knows about a managed host, as the Ansible fact `envctl`: read-only."""

from __future__ import annotations

DOCUMENTATION = r"""
module: envctl_facts
short_description: Gather what envctl knows about a host as facts
description:
  - Sets the fact C(envctl) from C(envctl status --json), C(envctl gpus --json) and
    C(envctl --version) - the environments and their state, the GPUs and which environment
    holds each, the cgroup driver and the firewall backend that C(auto) means here.
  - Read-only - nothing on the host changes.
version_added: "0.1.0"
author:
  - envctl contributors
options:
  config_dir:
    description:
      - envctl's config directory on the managed host. Default is E(ENVCTL_CONFIG_DIR) when
        set, else C(/etc/envctl/environments).
    type: path
  envctl_bin:
    description:
      - The envctl command on the managed host (a path, or a name looked up on E(PATH)).
    type: str
    default: envctl
attributes:
  check_mode:
    support: full
  diff_mode:
    support: none
  facts:
    support: full
seealso:
  - module: envctl.fleet.envctl_environment
"""

EXAMPLES = r"""
- name: What envctl knows
  envctl.fleet.envctl_facts:

- name: Hosts with a GPU nobody holds
  ansible.builtin.debug:
    msg: "{{ ansible_facts.envctl.gpus | selectattr('env', 'none') | map(attribute='uuid') }}"
"""

RETURN = r"""
ansible_facts:
  description: Facts to add to ansible_facts.
  returned: always
  type: dict
  contains:
    envctl:
      description: What envctl knows about this host.
      returned: always
      type: dict
      contains:
        version:
          description: The installed envctl's version.
          type: str
          sample: "0.1.0"
        environments:
          description:
            - Each environment in the config directory or with a journal here, by name -
              C(state) (V(up), V(degraded) or V(down)), C(up), C(steps), C(problems) (the
              steps that are not ok), C(warnings) and C(cgroup) (driver, version, usage).
          type: dict
          sample: {"cpu-batch": {"state": "up", "up": true, "steps": 6, "problems": []}}
        gpus:
          description: The GPUs found (C(envctl gpus --json)), each with C(env), the
            environment that holds it (null when free).
          type: list
          elements: dict
        gpu_driver:
          description: The NVIDIA driver's version, empty when none is loaded.
          type: str
        gpu_problems:
          description: What C(envctl gpus) found wrong (problems and warnings).
          type: list
          elements: str
        cgroup_driver:
          description: The cgroup driver C(resources.driver=auto) means on this host.
          type: str
          sample: systemd
        firewall_backend:
          description: The firewall backend C(network.firewall=auto) means on this host.
          type: str
          sample: nftables
"""

import os

from ansible.module_utils.basic import AnsibleModule

from ansible_collections.envctl.fleet.plugins.module_utils.envctl import (
    Envctl,
    EnvctlFailed,
    default_config_dir,
)

# The library directories where envctl looks for libnftables (envctl/host/firewall.py).
LIB_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib")


def cgroup_driver():
    """What `resources.driver: auto` means here, by envctl's documented rule (`envctl
    --help`): $ENVCTL_CGROUP_DRIVER, else systemd when it is PID 1, else cgroupfs."""
    forced = os.environ.get("ENVCTL_CGROUP_DRIVER", "").strip()
    if forced and forced != "auto":
        return forced
    try:
        with open("/proc/1/comm") as f:
            return "systemd" if f.read().strip() == "systemd" else "cgroupfs"
    except OSError:
        return "cgroupfs"


def firewall_backend(module):
    """What `network.firewall: auto` means here, by envctl's documented rule: $ENVCTL_FIREWALL,
    else nftables when nft (or libnftables) is installed, else iptables."""
    forced = os.environ.get("ENVCTL_FIREWALL", "")
    if forced in ("nftables", "iptables"):
        return forced
    if module.get_bin_path("nft") or any(os.path.exists(f"{d}/libnftables.so.1")
                                         for d in LIB_DIRS):
        return "nftables"
    return "iptables"


def environment_fact(row):
    steps = row.get("steps") or []
    problems = [f"{s['op']} {s['describe']}: {s['status']}" for s in steps
                if s["op"] != "=" and s["status"] != "not-applied"]
    return {"state": row["state"], "up": row["up"], "steps": len(steps), "problems": problems,
            "warnings": row.get("warnings") or [], "cgroup": row.get("cgroup")}


ARGUMENT_SPEC = dict(
    config_dir=dict(type="path"),
    envctl_bin=dict(type="str", default="envctl"),
)


def main():
    module = AnsibleModule(argument_spec=ARGUMENT_SPEC, supports_check_mode=True)
    envctl = Envctl(module, module.params["envctl_bin"],
                    module.params["config_dir"] or default_config_dir())
    try:
        status = envctl.json("status")
        gpus = envctl.json("gpus")
    except EnvctlFailed as exc:
        module.fail_json(msg=str(exc), rc=exc.rc, stderr_lines=exc.lines)
    rc, out, err = envctl.run("--version")
    version = out.split()[-1] if rc == 0 and out.split() else ""
    fact = {
        "version": version,
        "environments": {row["env"]: environment_fact(row) for row in status},
        "gpus": gpus.get("gpus") or [],
        "gpu_driver": gpus.get("driver") or "",
        "gpu_problems": (gpus.get("problems") or []) + (gpus.get("warnings") or []),
        "cgroup_driver": cgroup_driver(),
        "firewall_backend": firewall_backend(module),
    }
    module.exit_json(changed=False, ansible_facts={"envctl": fact})


if __name__ == "__main__":
    main()
