# Copyright: envctl contributors
# Apache License 2.0 (see https://www.apache.org/licenses/LICENSE-2.0)
"""Running the envctl command from a module: argv lists, --json output, one error shape."""

from __future__ import annotations

import json
import os

# Where envctl looks for specs when neither --config-dir nor ENVCTL_CONFIG_DIR says (the
# `envctl validate --help` default on an installed host).
SYSTEM_CONFIG_DIR = "/etc/envctl/environments"

# envctl's one-character plan operations (envctl/engine/engine.py): the words the diff uses.
OP_WORDS = {"+": "create", "~": "change", "=": "keep", "-": "remove", ".": "gone",
            "!": "refuse"}


class EnvctlFailed(Exception):
    """envctl exited non-zero (or printed no JSON): its exit code and its error lines."""

    def __init__(self, argv, rc, lines, stdout=""):
        self.argv, self.rc, self.lines, self.stdout = argv, rc, lines, stdout
        shown = "; ".join(lines) or "no error output"
        super().__init__(f"envctl {' '.join(argv)} failed (exit {rc}): {shown}")


def default_config_dir():
    """The directory envctl itself would read: $ENVCTL_CONFIG_DIR, else the system one."""
    return os.environ.get("ENVCTL_CONFIG_DIR") or SYSTEM_CONFIG_DIR


class Envctl:
    """One envctl installation on the managed host, run with an explicit config directory."""

    def __init__(self, module, binary, config_dir):
        self.module = module
        # A bare name is looked up on PATH (the module's PATH, plus the sbin directories).
        self.binary = binary if os.sep in binary else module.get_bin_path(binary, required=True)
        self.config_dir = config_dir

    def run(self, *args, config_dir=None):
        """Run envctl; returns (rc, stdout, stderr). Never through a shell."""
        argv = [self.binary, "--config-dir", config_dir or self.config_dir, *args]
        return self.module.run_command(argv, check_rc=False)

    def json(self, *args, config_dir=None, replace=None):
        """Run envctl with --json; its parsed output, or EnvctlFailed with its error lines.

        `replace` maps text in error lines to what the operator should read instead (the
        temporary config directory a check ran in -> the real one)."""
        rc, out, err = self.run(*args, "--json", config_dir=config_dir)
        lines = [line.strip() for line in err.splitlines() if line.strip()]
        for old, new in (replace or {}).items():
            lines = [line.replace(old, new) for line in lines]
        if rc != 0:
            raise EnvctlFailed(list(args), rc, lines, out)
        try:
            return json.loads(out)
        except ValueError:
            raise EnvctlFailed(list(args), rc, lines + ["output is not JSON"], out) from None


def step_line(step):
    """One plan step as envctl's `plan` prints it: `+ directory <run>/x  (field: a -> b)`."""
    notes = [f"{d['field']}: {d['have']} -> {d['want']}" for d in step.get("diffs") or []]
    notes += [x for x in (step.get("detail"), step.get("note")) if x]
    line = f"{step['op']} {step['describe']}"
    return line + (f"  ({'; '.join(notes)})" if notes else "")


def plan_text(env, steps, *, down=False):
    """A plan as lines for Ansible's --diff, with envctl's summary line."""
    counts = {op: sum(1 for s in steps if s["op"] == op) for op in OP_WORDS}
    if down:
        summary = f"{counts['-']} to remove, {counts['=']} kept for other environments"
    else:
        summary = (f"{counts['+']} to create, {counts['~']} to change, {counts['=']} unchanged"
                   + (f", {counts['-']} to remove" if counts["-"] else "")
                   + (f", {counts['!']} refused" if counts["!"] else ""))
    head = f"envctl plan {'--down ' if down else ''}{env}"
    return "\n".join([head, *("  " + step_line(s) for s in steps), "  " + summary]) + "\n"
