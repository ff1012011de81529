"""The one exception hierarchy of envctl; the CLI maps each class to an exit code."""

from __future__ import annotations

from envctl.record import Record


class EnvctlError(Exception):
    """Base of every error envctl expects and reports without a traceback."""

    exit_code = 1


class InputError(EnvctlError):
    """Bad input: a spec, an argument or a value the host cannot honour. Nothing was changed."""

    exit_code = 2


class Problem(Record, frozen=True):
    """One finding about a spec: where it is and what is wrong."""

    file: str
    line: int | None
    column: int | None
    field: str
    message: str

    def __str__(self) -> str:
        where = self.file
        if self.line is not None:
            where += f":{self.line}"
            if self.column is not None:
                where += f":{self.column}"
        field = f" {self.field}:" if self.field else ""
        return f"{where}:{field} {self.message}"


class SpecError(InputError):
    """One or more specs are invalid or conflict with each other."""

    def __init__(self, problems: list[Problem], *, warnings: tuple[Problem, ...] = (),
                 partial: object = None):
        self.problems = sorted(problems, key=lambda p: (p.file, p.line or 0, p.column or 0))
        # Findings that are not errors (spec.surprises), and what is left of the spec without
        # the values in error (a spec.loader.LoadedSpec, checked for conflicts with others).
        self.warnings = tuple(warnings)
        self.partial = partial
        super().__init__("\n".join(str(p) for p in self.problems))


class UsageError(InputError):
    """The command line asks for something that does not make sense."""


class HostError(EnvctlError):
    """The host refused an operation: `<action> <kind> '<name>': <operation>: <cause>`."""


class Busy(HostError):
    """`down` of environments whose jobs still run or wait: exit 3, apart from every other
    refusal, so that envctl.service's ExecStop= (whose exit 1, a partial `up`, is a success
    there) ends the unit *failed* when a stop was refused (docs/boot.md)."""

    exit_code = 3


class ForeignObject(HostError):
    """Something envctl did not make is where envctl would make its own; it is left alone."""


class NamespaceGone(HostError):
    """The named network namespace does not exist (any more)."""


class StateCorrupt(EnvctlError):
    """A journal or the ledger cannot be read; nothing is written over it."""

    def __init__(self, path: object, why: str):
        self.path = path
        self.why = why
        name = getattr(path, "name", str(path)).split(".", 1)[0]
        if name == "shared":
            hint = ("take the environments down with `envctl down --force NAME…` (or --all): "
                    "the host settings it recorded cannot all be restored")
        elif name == "gpu-quarantine":
            hint = ("move it aside (the GPUs it held are then given out again unless a health "
                    "check finds them unfit; `envctl gpus` shows what it finds)")
        else:
            hint = (f"`envctl down --force {name}` removes what can still be found of it, by "
                    "its journal and by name")
        super().__init__(f"state file {path} is damaged: {why}. It is left as it is; {hint}")


class NeedsRootError(EnvctlError):
    """The command changes the host and was not run as root."""


class AccessDenied(EnvctlError):
    """The caller may not do this to this environment or job (the spec's `access:`); nothing
    was changed. One line naming who, what and who may (envctl.runtime.access)."""


class LockTimeout(EnvctlError):
    """Another envctl holds the global lock for longer than we were asked to wait."""


class StepFailed(EnvctlError):
    """A plan step failed; what this run applied was rolled back."""

    def __init__(self, step: str, cause: BaseException, *, rolled_back: list[str],
                 rollback_errors: list[str]):
        self.step = step
        self.cause = cause
        self.rolled_back = rolled_back
        self.rollback_errors = rollback_errors
        msg = f"step '{step}' {self._what(cause)}"
        if rolled_back:
            msg += f"; rolled back {len(rolled_back)} step(s) this run applied"
        if rollback_errors:
            msg += "; rollback left: " + "; ".join(rollback_errors)
        super().__init__(msg)

    def _what(self, cause: BaseException) -> str:
        return f"failed: {cause}"


class StepInterrupted(StepFailed):
    """envctl was asked to stop (Ctrl-C, SIGTERM) during a step; it rolled back as on failure.
    Exit status 128 + the signal, as a shell reports a process the signal ended."""

    def _what(self, cause: BaseException) -> str:
        import signal  # here, not above: `import signal` builds its enums (submit-job's path)

        signum = getattr(cause, "signum", 2)  # a plain KeyboardInterrupt is Ctrl-C
        self.exit_code = 128 + signum
        return f"interrupted ({signal.Signals(signum).name})"
