#!/usr/bin/python
# Copyright: envctl contributors
# Apache License 2.0 (see https://www.apache.org/licenses/LICENSE-2.0)
"""One envctl environment on a managed host: its spec file in the config directory and its
state (up or down), changed through envctl's own plan, up and down."""

from __future__ import annotations

DOCUMENTATION = r"""
module: envctl_environment
short_description: Apply or remove one envctl environment (a GPU or CPU partition)
description:
  - Writes the environment's spec into envctl's config directory and brings the environment
    up with C(envctl up), or takes it down with C(envctl down) and removes the spec.
  - The spec is checked first against this host and the other specs of the config directory
    (what C(envctl validate --host) and C(envctl plan) check), in a copy of the directory,
    so a bad spec fails the task and changes nothing on the host.
  - C(changed) is true exactly when envctl's plan has changes (or the spec file's text
    differs). With C(--check) the plan is returned and nothing is written or applied; with
    C(--diff) the plan's create, change and remove lines are shown.
  - When C(envctl up) fails, envctl rolls back what that run applied and the previous spec
    file is put back, so the host is left as it was.
version_added: "0.1.0"
author:
  - envctl contributors
options:
  name:
    description:
      - The environment's name (the spec's C(name), and the spec file C(NAME.yaml)).
    type: str
    required: true
  spec:
    description:
      - The spec, as a dictionary (written as YAML), or the path of a YAML spec file on the
        managed host.
      - A C(name) in the spec must equal O(name); when absent, O(name) is used.
      - Required when O(state=present).
    type: raw
  state:
    description:
      - V(present) brings the environment up (repairing drift); V(absent) takes it down and
        removes its spec file.
    type: str
    choices: [present, absent]
    default: present
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
  purge:
    description:
      - With O(state=absent), also delete the environment's data directories
        (C(envctl down --purge)).
    type: bool
    default: false
  force:
    description:
      - With O(state=absent), cancel the environment's running jobs first
        (C(envctl down --force)); without it a running job makes the task fail.
    type: bool
    default: false
attributes:
  check_mode:
    support: full
  diff_mode:
    support: full
notes:
  - Needs root on the managed host (C(become)), as C(envctl up) and C(envctl down) do.
seealso:
  - module: envctl.fleet.envctl_facts
"""

EXAMPLES = r"""
- name: A CPU partition, from a dictionary
  envctl.fleet.envctl_environment:
    name: cpu-batch
    spec:
      kind: cpu
      resources:
        memory: {max: 40%}

- name: A GPU partition, from a spec file already on the host
  envctl.fleet.envctl_environment:
    name: gpu-train
    spec: /srv/specs/gpu-train.yaml
    envctl_bin: /opt/envctl/bin/envctl

- name: Gone, data directories included
  envctl.fleet.envctl_environment:
    name: cpu-batch
    state: absent
    purge: true
"""

RETURN = r"""
spec_path:
  description: The spec file in the config directory.
  returned: always
  type: str
  sample: /etc/envctl/environments/cpu-batch.yaml
plan:
  description:
    - envctl's plan (C(envctl plan --json) steps; C(envctl plan --down) for O(state=absent))
      before anything was applied.
  returned: always
  type: list
  elements: dict
  sample: [{"op": "+", "kind": "cgroup", "describe": "cgroup cpu-batch (cgroupfs, v1)"}]
steps:
  description: What C(envctl up) or C(envctl down) did (its C(--json) steps); empty when
    nothing had to change or in check mode.
  returned: always
  type: list
  elements: dict
resolved:
  description: Values envctl resolved against this host (CPUs, memory, cgroup driver ...).
  returned: when O(state=present)
  type: dict
  sample: {"cpus": "2-14", "dedicated": true, "cgroup.driver": "systemd"}
rc:
  description: The exit code of the last envctl command.
  returned: always
  type: int
"""

import os
import shutil
import tempfile

from ansible.module_utils.basic import AnsibleModule

from ansible_collections.envctl.fleet.plugins.module_utils.envctl import (
    Envctl,
    EnvctlFailed,
    default_config_dir,
    plan_text,
)

HEADER = "# Managed by Ansible (envctl.fleet.envctl_environment): local edits are replaced.\n"
SPEC_SUFFIXES = (".yaml", ".yml")


def render_spec(module, name, spec):
    """The spec file's text: a dictionary as YAML (JSON when PyYAML is missing, which YAML
    also reads), or the text of the named file on this host."""
    if isinstance(spec, str):
        try:
            with open(spec) as f:
                return f.read()
        except OSError as exc:
            module.fail_json(msg=f"spec file {spec}: {exc.strerror}")
    if not isinstance(spec, dict):
        module.fail_json(msg=f"spec: a dictionary or a file path, not {type(spec).__name__}")
    if spec.get("name", name) != name:
        module.fail_json(msg=f"spec.name {spec['name']!r} is not the environment's name "
                             f"{name!r}")
    body = {"name": name, **{k: v for k, v in spec.items() if k != "name"}}
    try:
        import yaml
    except ImportError:
        import json

        return HEADER + json.dumps(body, indent=2) + "\n"
    return HEADER + yaml.safe_dump(body, sort_keys=False, default_flow_style=False)


def read_text(path):
    """The file's text, or None when there is none."""
    try:
        with open(path) as f:
            return f.read()
    except FileNotFoundError:
        return None


def write_atomic(path, text):
    """Replace `path` with `text` at once: envctl (or the boot unit) never reads half a spec."""
    d = os.path.dirname(path)
    fd, tmp = tempfile.mkstemp(dir=d, prefix=".envctl-", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def staged_config_dir(config_dir, name, text):
    """A private copy of the config directory's specs with `text` as NAME.yaml: what the
    directory will hold, checked before the real one is touched."""
    staged = tempfile.mkdtemp(prefix="envctl-check-")  # 0700, root's: envctl's secure check
    if os.path.isdir(config_dir):
        for entry in sorted(os.listdir(config_dir)):
            stem, suffix = os.path.splitext(entry)
            src = os.path.join(config_dir, entry)
            if suffix in SPEC_SUFFIXES and stem != name and os.path.isfile(src):
                shutil.copyfile(src, os.path.join(staged, entry))
    with open(os.path.join(staged, name + ".yaml"), "w") as f:
        f.write(text)
    return staged


def changes_in(steps):
    return [s for s in steps if s["op"] != "="]


def ensure_present(module, envctl, name, path, result):
    want = render_spec(module, name, module.params["spec"])
    have = read_text(path)
    staged = staged_config_dir(envctl.config_dir, name, want)
    try:
        # `plan` loads the whole directory, checks conflicts and this host's facts and the
        # environments that are up: everything `validate --host` checks, plus the steps.
        plans = envctl.json("plan", name, config_dir=staged,
                            replace={staged: envctl.config_dir})
    finally:
        shutil.rmtree(staged, ignore_errors=True)
    plan = next(p for p in plans if p["env"] == name)
    for warning in plan["warnings"]:
        module.warn(f"{name}: {warning}")
    result.update(plan=plan["steps"], resolved=plan["resolved"])
    changes = changes_in(plan["steps"])
    result["changed"] = bool(changes) or want != have
    if module._diff:
        result["diff"] = [
            {"before_header": path, "after_header": path, "before": have or "", "after": want},
            {"prepared": plan_text(name, plan["steps"])},
        ]
    if module.check_mode or not result["changed"]:
        return  # check mode: the plan only; or the host already matches (nothing to run)
    os.makedirs(envctl.config_dir, mode=0o755, exist_ok=True)
    write_atomic(path, want)
    if not changes:
        return  # only the file's text changed (a comment, a description): nothing to apply
    try:
        outcomes = envctl.json("up", name)
    except EnvctlFailed:
        # Put the previous spec back: envctl rolled back this run, and the boot unit's
        # `up --all` must not meet a spec that could not come up.
        if have is None:
            os.unlink(path)
        else:
            write_atomic(path, have)
        raise
    result["steps"] = next((o.get("steps", []) for o in outcomes if o.get("env") == name), [])


def ensure_absent(module, envctl, name, path, result):
    have = read_text(path)
    # Environments in the config directory or with a journal here (status works from the
    # journals even when a spec is broken).
    known = {row["env"] for row in envctl.json("status")}
    steps = envctl.json("plan", "--down", name)[0]["steps"] if name in known else []
    result["plan"] = steps
    # `.` (already gone) steps still leave a journal that `down` clears.
    result["changed"] = have is not None or any(s["op"] != "=" for s in steps)
    if module._diff:
        result["diff"] = [
            {"before_header": path, "after_header": path, "before": have or "", "after": ""},
            {"prepared": plan_text(name, steps, down=True)},
        ]
    if module.check_mode or not result["changed"]:
        return
    if steps:
        flags = [f for f, on in (("--purge", module.params["purge"]),
                                 ("--force", module.params["force"])) if on]
        outcomes = envctl.json("down", name, *flags)
        result["steps"] = next((o["steps"] for o in outcomes if o.get("env") == name), [])
    if have is not None:
        os.unlink(path)  # after `down`: a failed `down` keeps the spec it may need again


ARGUMENT_SPEC = dict(
    name=dict(type="str", required=True),
    spec=dict(type="raw"),
    state=dict(type="str", choices=["present", "absent"], default="present"),
    config_dir=dict(type="path"),
    envctl_bin=dict(type="str", default="envctl"),
    purge=dict(type="bool", default=False),
    force=dict(type="bool", default=False),
)


def main():
    module = AnsibleModule(argument_spec=ARGUMENT_SPEC,
                           required_if=[("state", "present", ["spec"])],
                           supports_check_mode=True)
    name = module.params["name"]
    if not name or "/" in name or name.startswith("."):
        module.fail_json(msg=f"name {name!r}: an environment name, not a path")
    config_dir = module.params["config_dir"] or default_config_dir()
    envctl = Envctl(module, module.params["envctl_bin"], config_dir)
    path = os.path.join(config_dir, name + ".yaml")
    if os.path.exists(os.path.join(config_dir, name + ".yml")):
        # envctl would read both files as two specs of one name.
        module.fail_json(msg=f"{config_dir}/{name}.yml exists: this module manages "
                             f"{name}.yaml; remove or rename the .yml file first")
    result = dict(changed=False, spec_path=path, plan=[], steps=[], rc=0)
    try:
        if module.params["state"] == "present":
            ensure_present(module, envctl, name, path, result)
        else:
            ensure_absent(module, envctl, name, path, result)
    except EnvctlFailed as exc:
        result.update(rc=exc.rc, stderr_lines=exc.lines)
        module.fail_json(msg=str(exc), **result)
    module.exit_json(**result)


if __name__ == "__main__":
    main()
