"""The command line: parse, call one function in envctl.app, render (rich on a TTY, or JSON)."""

from __future__ import annotations

import gc
import os
import sys
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any

import typer

from envctl import __version__
from envctl.commands import GLOBAL_OPTIONS, hoist_global_options  # noqa: F401 - also theirs
from envctl.commands import emit_json as _emit_json
from envctl.commands import stderr as _stderr
from envctl.errors import EnvctlError, SpecError

app = typer.Typer(
    name="envctl",
    help="Carve one Linux host into static, isolated partitions for GPU and CPU work.\n\n"
         "Examples:\n\n"
         "  envctl validate                 check every spec in the config directory\n\n"
         "  envctl plan cpu-compute         show what `up` would change\n\n"
         "  sudo envctl up cpu-compute      bring the partition up (safe to re-run)\n\n"
         "  envctl status --json            what envctl made and whether it still matches\n\n"
         "  sudo envctl down --all          take every partition down, restore the host",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


class Firewall(StrEnum):
    nftables = "nftables"
    iptables = "iptables"


class CgroupDriver(StrEnum):
    cgroupfs = "cgroupfs"
    systemd = "systemd"


class Ctx:
    config_dir: str | None = None
    debug: bool = False
    lock_timeout: float = 120.0


CTX = Ctx()

def _complete_envs(ctx: typer.Context, incomplete: str) -> list[str]:
    """Tab: environment names (specs of the config directory, journals): envctl.completion."""
    from envctl import completion

    return completion.environments(incomplete,
                                   explicit_config=ctx.find_root().params.get("config_dir"))


def _complete_jobs(incomplete: str) -> list[tuple[str, str]]:
    from envctl import completion

    return completion.jobs(incomplete)


def _complete_active_jobs(incomplete: str) -> list[tuple[str, str]]:
    from envctl import completion

    return completion.jobs(incomplete, active_only=True)


EnvNames = Annotated[list[str] | None, typer.Argument(help="Environment names (or spec files).",
                                                       show_default=False,
                                                       autocompletion=_complete_envs)]
AllOpt = Annotated[bool, typer.Option("--all", "-a", help="Every environment.")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Machine-readable output on stdout.")]


def _version(value: bool) -> None:
    if value:
        print(f"envctl {__version__}")
        raise typer.Exit()


@app.callback()
def _main(
    config_dir: Annotated[str | None, typer.Option(
        "--config-dir", "-C", help="Directory of environment specs (default: $ENVCTL_CONFIG_DIR, "
        "/etc/envctl/environments, or ./configs in a checkout).", show_default=False)] = None,
    debug: Annotated[bool, typer.Option("--debug", help="Show tracebacks.")] = False,
    lock_timeout: Annotated[float, typer.Option(
        "--lock-timeout", help="Seconds to wait for another envctl to finish.")] = 120.0,
    firewall: Annotated[Firewall | None, typer.Option(
        "--firewall", help="The firewall backend `network.firewall: auto` uses (default: "
        "$ENVCTL_FIREWALL, else nftables when installed, else iptables).",
        show_default=False)] = None,
    cgroup_driver: Annotated[CgroupDriver | None, typer.Option(
        "--cgroup-driver", help="The cgroup driver `resources.driver: auto` uses (default: "
        "$ENVCTL_CGROUP_DRIVER, else systemd when it is PID 1, else cgroupfs).",
        show_default=False)] = None,
    version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True,
                                          help="Print the version and exit.")] = False,
) -> None:
    CTX.config_dir, CTX.debug, CTX.lock_timeout = config_dir, debug, lock_timeout
    # The flags are the environment variables' command-line form: the host facts read those.
    if firewall is not None:
        os.environ["ENVCTL_FIREWALL"] = firewall.value
    if cgroup_driver is not None:
        os.environ["ENVCTL_CGROUP_DRIVER"] = cgroup_driver.value


# ---------------------------------------------------------------- helpers


def _opts():
    from envctl.commands import Options

    return Options(CTX.config_dir, CTX.lock_timeout)


def _split(names: list[str] | None) -> tuple[list[str], list[Path]]:
    from envctl.commands import split

    return split(names)


def _workspace(names: list[str] | None, **kwargs: Any):
    from envctl.commands import workspace

    return workspace(names, _opts(), **kwargs)


def _require_known(names: list[str], host: Any, ws: Any = None) -> None:
    """envctl.known.require_known with this command's --config-dir (exit 2 for a typo)."""
    from envctl.commands import require_known

    require_known(names, host, _opts(), ws)


def _console():
    from envctl.commands import console

    return console()


def _exit(code: int) -> None:
    if code:
        raise typer.Exit(code)


@app.command()
def validate(
    path: Annotated[str | None, typer.Argument(help="A spec file or a directory of specs.",
                                                show_default=False)] = None,
    host: Annotated[bool, typer.Option("--host", help="Also check that this host can serve "
                                                      "them (modules, CPUs, memory, sysctls, "
                                                      "cgroup controllers).")] = False,
    json_: JsonOpt = False,
) -> None:
    """Check specs and every conflict between them: the same answer on any machine.

    A directory is checked whole; a file is checked together with the specs of the config
    directory. With --host, also plan each against this host (what `plan` and `up` check),
    and against the environments that are up here. Exit 2 lists every problem, each at its
    line. Warnings (values that rarely mean what they say, like `quota: 1.5`) go to stderr
    and leave the exit status alone.

    Example: envctl validate configs/ (in CI);  envctl validate --host (on the GPU host)
    """
    from envctl.workspace import config_dir

    target = Path(path) if path else config_dir(CTX.config_dir)
    # --host: the valid specs are planned even when others have problems (collect), so that
    # what this host refuses comes in the same run as the specs' own errors.
    if target.is_dir():
        from envctl.workspace import Workspace

        ws = Workspace.open(target, pure=not host, collect=host)
        selected = ws.specs
    else:
        ws, names = _workspace([str(target)], pure=not host, collect=host)
        selected = [ws.get(n) for n in names if n in ws.names() or not ws.problems]
    plans = []
    if host:
        plans, refused = ws.plan_each(selected)
        problems = ws.problems + [p for exc in refused.values() for p in exc.problems]
        if problems:
            raise SpecError(problems, warnings=tuple(ws.warnings))
    checked = [ls.spec.name for ls in selected]
    # Valid but surprising values (`quota: 1.5` is 1.5% of one CPU), each at its line.
    warnings = [w for ls in selected for w in ls.warnings]
    for w in warnings:
        _stderr(f"warning: {w}")
    # --host: what `plan` would warn about here, each warning once (JSON: per spec file).
    from envctl.errors import Problem

    said = {str(w) for w in warnings}
    of_host = {p.env: [w for w in p.warnings if w not in said] for p in plans}
    for w, envs in _warned(of_host).items():
        _stderr(f"warning: {', '.join(envs)}: {w}")
    warnings += [Problem(ws.get(env).path, None, None, "", w)
                 for env, found in of_host.items() for w in found]
    if json_:
        _emit_json({"ok": True, "environments": checked, "host": host,
                    "warnings": [vars(w) for w in warnings]})
    else:
        where = " and this host" if host else ""
        print(f"ok: {', '.join(checked)} ({len(ws.specs)} spec(s) in {ws.directory} "
              f"checked for conflicts{where})")


@app.command()
def plan(
    names: EnvNames = None,
    all_: AllOpt = False,
    down_: Annotated[bool, typer.Option("--down", help="Show what `down` would remove.")] = False,
    json_: JsonOpt = False,
) -> None:
    """Show what `up` (or `down`) would do against the live host: + create, ~ change, = keep.

    Example: envctl plan cpu-compute
    """
    from envctl import commands

    _exit(commands.plan(names, _opts(), all_=all_, down_=down_, json_=json_))


def _warned(warnings: dict[str, list[str]]) -> dict[str, list[str]]:
    """Each warning, once -> the environments that have it, in order."""
    from envctl.commands import warned

    return warned(warnings)


@app.command()
def up(names: EnvNames = None, all_: AllOpt = False, json_: JsonOpt = False,
       retry: Annotated[bool, typer.Option(
           "--retry", help="Try again, with backoff (1 s, 2 s, 4 s ... 60 s), the environments "
           "this boot's `up --all` could not bring up, until all are up or --window has "
           "passed (envctl-retry.service).")] = False,
       window: Annotated[float, typer.Option(
           "--window", min=0, help="With --retry: seconds to keep trying.")] = 600.0,
       ) -> None:
    """Bring environments up: apply their plan in order, repairing drift; safe to re-run.

    A failing step rolls back what this run applied to that environment; the others still
    come up, and the exit status is 1. With --all (the boot unit), an environment this host
    cannot serve (a required kernel module missing) is reported and skipped, and waits for
    `up --retry`. Bad specs and conflicts stop everything before the first change (exit 2).

    Example: sudo envctl up cpu-compute
    """
    from envctl import commands

    if retry:
        if names or all_ or json_:
            raise commands.BadArgs("up", "--retry takes no names, --all or --json")
        _exit(commands.retry(_opts(), window=window))
    else:
        _exit(commands.up(names, _opts(), all_=all_, json_=json_))


@app.command()
def down(
    names: EnvNames = None,
    all_: AllOpt = False,
    force: Annotated[bool, typer.Option(
        "--force", help="Cancel the environments' running jobs first (without it, `down` "
        "refuses while jobs run). For a damaged or lost journal: keep the damaged state files "
        "aside, then remove what can still be read of them and what the spec names and the "
        "host has (found by name).")] = False,
    purge: Annotated[bool, typer.Option(
        "--purge", help="Also delete the environments' data directories (the sources of "
        "their data mounts that envctl created), which `down` otherwise keeps, empty or not; "
        "of one that is already down, its <state>/data/ENV.")] = False,
    json_: JsonOpt = False,
) -> None:
    """Take environments down: remove what envctl made and restore what it changed.

    Works from the journal, newest step first, so a deleted or changed spec still tears
    down exactly what was made. Data directories (logs, models, datasets …) stay unless
    --purge.

    Example: sudo envctl down --all
    """
    from envctl import commands

    _exit(commands.down(names, _opts(), all_=all_, force=force, purge=purge, json_=json_))




@app.command()
def status(
    names: EnvNames = None,
    json_: JsonOpt = False,
    check: Annotated[bool, typer.Option("--check", help="Exit 1 unless every applied resource "
                                                        "is ok (for monitoring).")] = False,
    watch: Annotated[bool, typer.Option("--watch", "-w", help="Redraw it every --interval "
                                                              "seconds until q or Ctrl-C: "
                                                              "`list`'s table, then each "
                                                              "environment's detail while "
                                                              "they fit the terminal.")] = False,
    interval: Annotated[float, typer.Option("--interval", "-n", help="Seconds between redraws "
                                                                     "(--watch).")] = 2.0,
) -> None:
    """Each resource of each environment: ok, missing or drifted, against the live host, and
    the last events of the monitor (`envctl monitor`) for each.

    Example: envctl status cpu-compute --json
    """
    from envctl import commands

    if watch:
        if json_ or check:
            raise typer.BadParameter("--watch redraws for a person: not with --json or --check")
        return _watch_status(names, interval)
    _exit(commands.status(names, _opts(), json_=json_, check=check))


@app.command("list")
def list_(names: EnvNames = None, json_: JsonOpt = False) -> None:
    """One line per environment, as `docker ps` and `incus list` give it: state (up,
    not-applied, degraded, down), address, published ports, CPUs, memory used / limit, GPUs,
    jobs running/pending, description. Alias: ps.

    Environments come from the specs and from the journals (one whose spec was deleted but
    that is still up is listed). Fast and read-only: it reads the journals and each cgroup,
    never checks every resource as `status` does (see docs/lifecycle.md for what each state
    means).

    Example: envctl list;  envctl ps --json | jq -r '.[] | select(.state != "up") | .name'
    """
    from envctl import commands

    _exit(commands.list_(names, _opts(), json_=json_))


app.command("ps", hidden=True)(list_)


@app.command()
def gpus(
    json_: JsonOpt = False,
    cdi: Annotated[bool, typer.Option(
        "--cdi", help="Also write the CDI spec of the GPUs each environment holds, for "
        "container runtimes (--device envctl.io/gpu=ENV).")] = False,
    cdi_path: Annotated[Path | None, typer.Option(
        "--cdi-path", help="Where --cdi writes (default: $ENVCTL_CDI_DIR/envctl.yaml, else "
        "/etc/cdi/envctl.yaml).", show_default=False)] = None,
    clear: Annotated[str | None, typer.Option(
        "--clear", help="Release a quarantined GPU (its index or UUID) after you have reset "
        "it (nvidia-smi -r): environments may be given it again.", show_default=False,
        metavar="GPU")] = None,
) -> None:
    """This host's NVIDIA GPUs, the driver, which environment holds each GPU, and those in
    quarantine (a fatal XID, uncorrectable ECC errors, pending row remapping or retired pages,
    or lost: given to no one until `--clear`).

    Read-only: nothing on the host changes, except the CDI file that --cdi writes. GPUs come
    from NVML when the driver is loaded (ENVCTL_NVML=off: /proc/driver/nvidia only).

    Example: envctl gpus --json;  sudo envctl gpus --cdi
    """
    from envctl import gpus as ops_gpus
    from envctl.host.context import Host

    host = Host.from_env()
    root = host.gpu_root  # ENVCTL_GPU_ROOT, as every command reads it
    if clear is not None:
        from envctl import app as ops
        from envctl.monitor import events

        ops.require_root("gpus --clear")
        uuid, item = ops_gpus.clear_gpu(host, root, clear)
        detail = f"GPU {item.get('index', '?')} ({uuid}) released by the operator"
        events.append(host.state_dir, "host", "gpu-cleared", detail)
        if json_:
            _emit_json({"cleared": uuid, "was": item})
        else:
            print(f"cleared {detail.removesuffix(' released by the operator')}: it may be "
                  "assigned again")
        return
    found = ops_gpus.survey(host, root, libraries=cdi)  # the libraries: CDI's only
    report = ops_gpus.gpu_report(host, root, found=found)
    written = None
    if cdi:
        written = ops_gpus.write_cdi(host, root, cdi_path or ops_gpus.cdi_path(), found=found)
    if json_:
        _emit_json({**report, "cdi": str(written) if written else None})
        return
    _render_gpus(report)
    if written:
        print(f"wrote {written}")


def _render_gpus(report: dict[str, Any]) -> None:
    """The table, written without rich: `gpus` is run often, and rich's console is ~20 ms of
    its start. Colours (dim, red, yellow) only on a terminal, as rich decides (NO_COLOR,
    FORCE_COLOR, TERM=dumb); a value is printed as it is (no markup to escape)."""
    from envctl.spec.units import format_size

    colour = _colour(sys.stdout)

    def paint(text: str, code: str) -> str:
        return f"\x1b[{code}m{text}\x1b[0m" if colour else text

    out: list[str] = []
    driver = report["driver"]
    if not report["gpus"]:
        state = (f"driver {driver} is loaded but shows no GPU" if driver
                 else "no NVIDIA driver is loaded")
        out.append(f"no NVIDIA GPU found ({state})")
    else:
        out.append(f"driver {driver or 'unknown'}  " + paint(f"(GPUs from {report['source']})",
                                                             "2"))
        out.append(f"  {'GPU':<4} {'UUID':<41} {'NAME':<26} {'MEMORY':>7} {'MIG':<4} "
                   f"{'PCI':<13} ENVIRONMENT")
        for g in report["gpus"]:
            memory = format_size(g["memory"]) if g["memory"] else "-"
            out.append(f"  {g['index']:<4} {g['uuid'] or '?':<41} {g['name']:<26} {memory:>7} "
                       f"{'on' if g['mig'] else 'off':<4} {g['pci']:<13} {g['env'] or '-'}")
            if h := g.get("health"):
                state = "QUARANTINED" if h["quarantined"] else "unfit (recorded at the next up)"
                why = "; ".join(h["evidence"] + h["found_now"])
                out.append(f"  {'':<4} " + paint(f"{state}: {why}", "31"))
            if g["mig"] != g["mig_pending"]:
                out.append(f"  {'':<4} " + paint(f"MIG mode {'on' if g['mig_pending'] else 'off'}"
                                                 " after the next GPU reset", "33"))
            for m in g["instances"]:
                size = format_size(m["memory"]) if m["memory"] else "-"
                start, count = m["placement"]["start"], m["placement"]["size"]
                out.append(f"  {'':<4} └ {m['uuid']:<41} {m['profile'] or '?':<11} GI "
                           f"{m['gi']:<2} CI {m['ci']} slots {start}-{start + count - 1:<3} "
                           f"{size:>7} {m['env'] or '-'}")
    for line in report["problems"] + report["warnings"]:
        out.append("  " + paint(f"! {line}", "33"))
    sys.stdout.write("\n".join(out) + "\n")
    sys.stdout.flush()


def _colour(stream: Any) -> bool:
    """Whether rich would colour `stream`: FORCE_COLOR set (non-empty) forces it, NO_COLOR
    (non-empty) or TERM=dumb/unknown turn it off, else a terminal gets colours."""
    if os.environ.get("FORCE_COLOR"):
        return True
    if os.environ.get("NO_COLOR") or os.environ.get("TERM", "") in ("dumb", "unknown"):
        return False
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


@app.command("exec")
def exec_(
    env: Annotated[str, typer.Argument(help="The environment (it must be up).",
                                       show_default=False, autocompletion=_complete_envs)],
    command: Annotated[list[str], typer.Argument(
        help="The program and its arguments, after `--`; passed as they are, never through "
        "a shell.", show_default=False)],
    user: Annotated[str | None, typer.Option(
        "--user", "-u", help="Run as USER (a name or uid, USER:GROUP too). Default: the user "
        "behind sudo; root only when asked (--user root).", show_default=False)] = None,
    env_vars: Annotated[list[str] | None, typer.Option(
        "--env", "-e", help="KEY=VALUE added to the environment's variables (repeatable).",
        show_default=False)] = None,
    workdir: Annotated[str, typer.Option(
        "--workdir", "-w", help="Where it starts, inside the environment.")] = "/",
    interactive: Annotated[bool, typer.Option(
        "--interactive", "-i", help="Keep stdin attached when it is a terminal and stdout is "
        "not (as docker exec -i): envctl relays what is typed. Without it the command's stdin "
        "is then /dev/null.")] = False,
) -> None:
    """Run a command inside an environment, attached, and exit with its exit code.

    The command gets the environment's network, root filesystem, /dev, variables, CPUs and
    cgroup, new PID/mount/UTS/IPC namespaces and a reduced capability set (see
    docs/runtime.md). stdin, stdout and stderr pass through (a terminal of its own when both
    stdin and stdout are one; the caller's terminal is never handed over: relayed, or for
    stdin /dev/null unless -i); signals are forwarded; death by signal N exits 128+N; a
    command not found exits 127.

    A user in the spec's access.submit runs it without sudo, through the daemon (as that
    user; a terminal is relayed, without a terminal of its own inside).

    Example: sudo envctl exec cpu-compute -- python3 -c 'import os; print(os.cpu_count())'
    """
    if os.geteuid() != 0:
        from envctl.server import client

        raise typer.Exit(client.exec_(client.route(), env, command, user=user,
                                      env_vars=env_vars, workdir=workdir,
                                      keep_stdin=interactive))
    from envctl.runtime.exec import run

    raise typer.Exit(run(env, command, user=user, env_vars=env_vars, workdir=workdir,
                         keep_stdin=interactive))


# ---------------------------------------------------------------- jobs


@app.command("submit-job")
def submit_job(
    env: Annotated[str, typer.Argument(help="The environment (it must be up).",
                                       show_default=False, autocompletion=_complete_envs)],
    exe: Annotated[str, typer.Argument(
        help="The program: a path (or a file here) of this host, copied into the job's "
        "directory and run as /job/NAME (a .py with the environment's python3); or a bare "
        "name, found in the environment's PATH and run from its rootfs.",
        show_default=False)],
    args: Annotated[list[str] | None, typer.Argument(
        help="Its arguments: everything after the program, passed as they are (never through "
        "a shell, options included).", show_default=False)] = None,
    name: Annotated[str | None, typer.Option(
        "--name", "-J", help="A name for `envctl jobs` (default: the program's).",
        show_default=False)] = None,
    time_limit: Annotated[str | None, typer.Option(
        "--time-limit", "-t", help="Stop it after this long: minutes (90, as Slurm), 90s, 15m, "
        "1h30m, 2d or [D-]HH:MM:SS, at most 365 days (SIGTERM, SIGKILL 10 s later; state TIMEOUT).",
        show_default=False)] = None,
    cpus: Annotated[str | None, typer.Option(
        "--cpus", help="N (a count): N of the environment's CPUs, the job's alone, chosen by "
        "envctl; or a list such as 2-3,6 (0-0 for CPU 0), shared. Default: every CPU of the "
        "environment that no job holds alone.", show_default=False)] = None,
    gpus: Annotated[str | None, typer.Option(
        "--gpus", help="N (a count): N of the environment's GPUs, the job's alone; or a list "
        "of UUIDs or indices as `envctl gpus` numbers them (0, for GPU 0), shared. The job "
        "can open only its GPUs' nodes (CUDA_VISIBLE_DEVICES names them).",
        show_default=False)] = None,
    mem: Annotated[str | None, typer.Option(
        "--mem", help="Its own memory limit (512M, 16G): memory.max of its cgroup, taken "
        "from the environment's memory limit while it runs.", show_default=False)] = None,
    env_vars: Annotated[list[str] | None, typer.Option(
        "--env", help="KEY=VALUE for the job, over the environment's variables (repeatable).",
        show_default=False)] = None,
    workdir: Annotated[str, typer.Option(
        "--workdir", "-D", help="Its working directory inside the environment.")] = "/",
    output: Annotated[str | None, typer.Option(
        "--output", "-o", help="Host file for its stdout (default: <state>/jobs/ID/stdout; "
        "`envctl logs ID`).", show_default=False)] = None,
    error: Annotated[str | None, typer.Option(
        "--error", "-e", help="Host file for its stderr (default: <state>/jobs/ID/stderr; "
        "`envctl logs ID --stderr`).", show_default=False)] = None,
    user: Annotated[str | None, typer.Option(
        "--user", "-u", help="Run as USER (a name or uid, USER:GROUP too). Default: the user "
        "behind sudo; root only when asked (--user root).", show_default=False)] = None,
    wait: Annotated[bool, typer.Option(
        "--wait", "-W", help="Wait for the job to end and exit with its exit code.")] = False,
    json_: JsonOpt = False,
) -> None:
    """Submit a batch job: print its id at once; a supervisor runs it detached.

    The job runs inside the environment as `exec` runs a command (its own PID, mount, UTS,
    IPC and cgroup namespaces, its own cgroup below the environment's), with stdin from
    /dev/null and stdout/stderr to files. `envctl jobs` lists it, `envctl logs ID -f` follows
    it, `envctl cancel ID` stops it, `envctl wait ID` waits for it. Its record says how it
    ended: COMPLETED, FAILED, CANCELLED, TIMEOUT or OUT_OF_MEMORY (see docs/runtime.md).

    Example: sudo envctl submit-job cpu-compute -t 1h ./bench --size 4096
    """
    from envctl.runtime.submit import submit

    raise typer.Exit(submit(env, exe, list(args or []), name=name, time_limit=time_limit,
                            cpus=cpus, gpus=gpus, env_vars=env_vars, workdir=workdir,
                            output=output, error=error, user=user, wait=wait, json_=json_,
                            mem=mem))


# submit-job's options that take a value (envctl.runtime.submit.VALUE_OPTIONS, which its fast
# path parses the same way). Everything after the program belongs to the job, so
# `main` puts a `--` right after it (split_job_args): `envctl submit-job E ./x --name y` gives
# ./x the argument `--name`, as sbatch gives a script everything after it.


def split_job_args(argv: list[str]) -> list[str]:
    """`argv` with a `--` after submit-job's program (its second positional argument) unless
    a `--` comes first: what follows reaches the job as it is, leading `-` included."""
    i = 0
    while i < len(argv) and argv[i].startswith("-") and argv[i] != "--":
        name = argv[i].split("=", 1)[0]
        i += 2 if GLOBAL_OPTIONS.get(name) and "=" not in argv[i] else 1
    if i >= len(argv) or argv[i] != "submit-job":
        return argv
    from envctl.runtime.submit import VALUE_OPTIONS

    j, positionals = i + 1, 0
    while j < len(argv):
        word = argv[j]
        if word == "--":
            return argv
        if word.startswith("-") and word != "-":
            name = word.split("=", 1)[0]
            takes = (name in VALUE_OPTIONS or GLOBAL_OPTIONS.get(name, False)) \
                and "=" not in word and not (len(name) > 2 and name[1] != "-")
            j += 2 if takes else 1
            continue
        positionals += 1
        j += 1
        if positionals == 2:
            return argv if argv[j:j + 1] == ["--"] else argv[:j] + ["--"] + argv[j:]
    return argv


def _exit_text(job: Any) -> str:
    from envctl.runtime.jobs import format_exit

    return format_exit(job)


@app.command("jobs")
def jobs_(
    env: Annotated[str | None, typer.Argument(help="Only this environment's jobs.",
                                              show_default=False,
                                              autocompletion=_complete_envs)] = None,
    all_: Annotated[bool, typer.Option("--all", "-a", help="Finished jobs too (the newest "
                                       "1000 are kept).")] = False,
    format_: Annotated[str | None, typer.Option(
        "--format", "-o", help="The table's columns, comma-separated, as sacct --format: e.g. "
        "id,user,state,elapsed,cpu_user,cpu_sys,maxrss,gpu_seconds,energy_j (an unknown one "
        "lists them all).", show_default=False)] = None,
    json_: JsonOpt = False,
) -> None:
    """The jobs of this host, like squeue (sacct with --all): id, name, environment, user,
    state, elapsed time, exit code:signal, start; --format picks other columns (CPU time
    user/system, peak memory, GPU-seconds, GPU energy …). --json prints whole records, with
    the accounting of finished jobs (docs/runtime.md, "Accounting").

    A job whose supervisor is gone (killed, or the host rebooted) shows as LOST; `envctl
    cancel` of it cleans up what is left. Read-only: nothing changes.

    Example: envctl jobs cpu-compute --all
    """
    from envctl import jobtable
    from envctl.runtime import jobs as jb
    from envctl.server import client

    fields = jobtable.fields_of(format_)
    if format_ is not None and json_:
        from envctl.errors import UsageError

        raise UsageError("--format picks the table's columns; --json prints whole records: "
                         "give one of them")
    daemon = client.route()
    if daemon is not None and not json_:
        jobtable.show(daemon, env, all_, fields)
        return
    if daemon is not None:
        listed = client.jobs(daemon, env, all_)
    else:
        from envctl.host.context import Host
        from envctl.runtime import queue

        host = Host.from_env()
        listed = queue.listing(host.state_dir, host.boot_id, env=env, finished=all_)
        if env is not None and not listed and not jb.listing(host.state_dir, host.boot_id,
                                                             env=env, finished=True):
            # No job of it, ever: a name that is neither a spec nor up is a typo (exit 2).
            _require_known([env], host)
    if json_:
        _emit_json([j.to_json() for j in listed])
        return
    jobtable.print_rows(jb.table(listed, fields=fields))


@app.command()
def logs(
    job: Annotated[str, typer.Argument(help="The job id.", show_default=False,
                                       autocompletion=_complete_jobs)],
    follow: Annotated[bool, typer.Option("--follow", "-f", help="Keep printing what it "
                                         "writes until it ends.")] = False,
    stderr_: Annotated[bool, typer.Option("--stderr", help="Its stderr instead of its "
                                          "stdout.")] = False,
) -> None:
    """Print a job's stdout (or --stderr), from its output file.

    Example: envctl logs 7 -f
    """
    from envctl.errors import HostError
    from envctl.host.context import Host
    from envctl.runtime import jobs as jb
    from envctl.server import client

    out = sys.stdout.buffer

    def write(chunk: bytes) -> None:
        out.write(chunk)
        out.flush()

    daemon = client.route()
    if daemon is not None:  # the daemon opens it as the job's user may, and passes it
        fd, record = client.logs(daemon, job, stderr_, follow=follow)
        try:
            if follow:
                client.follow(daemon, fd, record, write)
            else:
                import shutil

                with open(fd, "rb") as f:
                    shutil.copyfileobj(f, out)
        except OSError as exc:
            raise HostError(f"logs of job {record.id}: {exc.strerror}") from exc
        return
    host = Host.from_env()
    record = jb.get(host.state_dir, job)
    from envctl.runtime import queue

    pending = queue.no_output_yet(host.state_dir, record)
    if pending is not None and not follow:
        raise HostError(pending)
    path = Path(record.stderr if stderr_ else record.stdout)
    try:
        if follow:
            # A queued job: waited for until a pass of the queue starts it (or it ends unstarted).
            opened = queue.open_when_started(host.state_dir, record, path,
                                             boot_id=host.boot_id)
            fd, record = opened if opened is not None else (-1, record)  # None: with `gone`
            jb.follow(host.state_dir, record, path, write, boot_id=host.boot_id, fd=fd)
        else:
            import shutil

            # Never by name as root: the job's user owns its directory (see jobs.open_output).
            with open(jb.open_output(host.state_dir, record, path), "rb") as f:
                shutil.copyfileobj(f, out)
    except OSError as exc:
        raise HostError(f"logs of job {record.id}: {path}: {exc.strerror}") from exc


@app.command()
def cancel(
    job_ids: Annotated[list[str], typer.Argument(help="Job ids.", show_default=False,
                                                 autocompletion=_complete_active_jobs)],
    grace: Annotated[float, typer.Option(
        "--grace", help="Seconds between SIGTERM and SIGKILL (0 to 365 days).")] = 10.0,
    json_: JsonOpt = False,
) -> None:
    """Stop jobs: SIGTERM, then SIGKILL after --grace seconds; each ends CANCELLED.

    Waits until each has ended. A job that already ended is left as it is; a LOST one (its
    supervisor is gone) has what is left of its cgroup killed and removed.

    Example: sudo envctl cancel 7 8
    """
    from envctl.errors import NeedsRootError
    from envctl.runtime.jobs import check_grace
    from envctl.server import client

    check_grace(grace)  # a bad one is exit 2 before anything is asked
    daemon = client.route()
    if daemon is not None:
        before, after = client.cancel(daemon, job_ids, grace)
    else:
        from envctl.host.context import Host
        from envctl.runtime import jobs as jb
        from envctl.runtime import supervisor as sv

        host = Host.from_env()
        before = [jb.get(host.state_dir, j) for j in job_ids]  # every id known, or nothing
        if os.geteuid() != 0 and any(j.active for j in before):
            raise NeedsRootError("envctl cancel signals the job's supervisor and needs root: "
                                 "run it with sudo")
        after = sv.cancel_jobs(host, before, grace=grace)
    if json_:
        _emit_json([j.to_json() for j in after])
        return
    for old, new in zip(before, after, strict=True):
        what = "was" if not old.active else "is now"
        print(f"job {new.id} {what} {new.state}")


@app.command("wait")
def wait_(
    job_ids: Annotated[list[str], typer.Argument(help="Job ids.", show_default=False,
                                                 autocompletion=_complete_jobs)],
    json_: JsonOpt = False,
) -> None:
    """Wait until the jobs have ended; exit with the first non-zero job exit code (0 when all
    COMPLETED; 128+N for a signal N; 1 for a job cancelled, lost or never started that gave
    no code).

    Example: envctl wait 7 8 && echo all done
    """
    from envctl.runtime import jobs as jb
    from envctl.server import client

    daemon = client.route()
    if daemon is not None:
        done = client.wait(daemon, job_ids)
    else:
        from envctl.host.context import Host
        from envctl.runtime import supervisor as sv

        host = Host.from_env()
        ids = [jb.get(host.state_dir, j).id for j in job_ids]
        done = sv.wait(host, ids)
    if json_:
        _emit_json([j.to_json() for j in done])
    else:
        for j in done:
            print(f"{j.id} {j.state} {jb.format_exit(j)}")
    raise typer.Exit(next((j.exit_status() for j in done if j.exit_status()), 0))


@app.command()
def daemon() -> None:
    """Run the envctl daemon in the foreground (as root; logs to stderr): plain users submit,
    list, cancel, wait for and read their jobs through its socket.

    The socket is $ENVCTL_SOCKET, else /run/envctl/envctl.sock (or the one systemd passes:
    envctl-daemon.socket, which `envctl install-units` installs). Each request is decided by
    who the kernel says the caller is and the spec's `access:`; jobs outlive the daemon.

    Example: sudo envctl daemon
    """
    from envctl.server.server import main as serve

    raise typer.Exit(serve())


# ---------------------------------------------------------------- entry point



# ---------------------------------------------------------------- boot units (envctl.units)

UnitDirOpt = Annotated[str | None, typer.Option(
    "--unit-dir", help="Where the unit files go (default: $ENVCTL_BOOT_UNIT_DIR, else "
    "/etc/systemd/system).", show_default=False)]


def _render_unit_changes(changes: list, json_: bool, nothing: str) -> None:
    if json_:
        _emit_json([c.to_json() for c in changes])
    else:
        for c in changes or [nothing]:
            print(c)


def _boot_mounts(specs_dir: Path, state_dir: Path) -> list[str]:
    """envctl.units.mount_paths of the specs in `specs_dir` as they are now (none, with a
    warning, when they cannot be read: the unit is still worth installing)."""
    from envctl.errors import EnvctlError
    from envctl.units import mount_paths
    from envctl.workspace import Workspace

    specs = []
    try:
        if specs_dir.is_dir():
            specs = [ls.spec for ls in Workspace.open(specs_dir, pure=True).specs]
    except EnvctlError as exc:
        print(f"warning: specs not read ({str(exc).splitlines()[0]}): envctl.service "
              "requires no data source's mount; run install-units again once they are fixed",
              file=sys.stderr)
    return mount_paths(specs, str(state_dir.absolute()), str(specs_dir))


@app.command("install-units")
def install_units(
    now: Annotated[bool, typer.Option("--now", help="Also start them now (envctl.service "
                                                    "runs `envctl up --all`).")] = False,
    unit_dir: UnitDirOpt = None,
    json_: JsonOpt = False,
) -> None:
    """Install envctl.service (every environment up at boot, down at shutdown) and
    envctl-monitor.service (metrics, self-healing), enabled, pointing at this envctl.

    The units run the envctl that runs this command, with the same --config-dir and
    ENVCTL_STATE_DIR/RUN_DIR/CGROUP_DRIVER/CGROUP_PARENT/FIREWALL/CONFIG_DIR as set now.
    Safe to re-run; a unit file envctl did not write is refused, never overwritten. Customise
    the units with drop-ins (systemctl edit envctl.service). See docs/boot.md.

    Example: sudo envctl -C /etc/envctl/environments install-units --now
    """
    from envctl.host.context import Host
    from envctl.units import Units, carried_environment, envctl_command, render_all
    from envctl.units import refuse_writable_code as refuse_code
    from envctl.workspace import config_dir

    command = envctl_command()
    refuse_code(command)  # root code at every boot: only root may change it
    # The directory this command reads (./configs in a checkout included), made absolute: the
    # units run from / and must see the specs the operator's `envctl up` sees.
    specs_dir = config_dir(CTX.config_dir).resolve()
    host = Host.from_env()
    texts = render_all(command, carried_environment(os.environ, str(specs_dir)),
                       mounts=_boot_mounts(specs_dir, host.state_dir))
    units = Units.from_env(host.state_dir, unit_dir)
    _render_unit_changes(units.install(texts, now=now), json_, "nothing to do")


@app.command("uninstall-units")
def uninstall_units(
    now: Annotated[bool, typer.Option("--now", help="Also stop them now (envctl.service runs "
                                                    "`envctl down --all`, which refuses while "
                                                    "jobs run: then nothing is removed).")
                   ] = False,
    unit_dir: UnitDirOpt = None,
    json_: JsonOpt = False,
) -> None:
    """Disable and remove the units `install-units` wrote (only those; a no-op when none).

    Without --now the environments stay up: the running units keep their state until they
    are stopped. A unit file edited since envctl wrote it is refused (exit 1), nothing removed.

    Example: sudo envctl uninstall-units --now
    """
    from envctl.host.context import Host
    from envctl.units import Units

    units = Units.from_env(Host.from_env().state_dir, unit_dir)
    _render_unit_changes(units.uninstall(now=now), json_, "nothing installed")


# ---------------------------------------------------------------- monitor, top


DEFAULT_CSV_DIR = "/var/log/envctl"  # where the monitor's CSV files go by default


@app.command()
def monitor(
    interval: Annotated[float, typer.Option(
        "--interval", "-n", help="Seconds between samples (the setup envctl replaces polled "
        "every 30 s).")] = 30.0,
    interval_i: Annotated[float | None, typer.Option(
        "-i", hidden=True, help="The old spelling of -n.")] = None,
    once: Annotated[bool, typer.Option(
        "--once", help="Take one sample (over a 1 s window, for CPU percentages), print the "
        "Prometheus exposition on stdout and exit: a probe that changes nothing (no CSV, no "
        "heal) unless --csv-dir, --textfile or --heal asks.")] = False,
    listen: Annotated[str, typer.Option(
        "--listen", help="ADDR:PORT to serve /metrics on ([::1]:9464 for IPv6), or none. "
        "Loopback by default: put a reverse proxy or node_exporter's textfile collector in "
        "front to publish it.")] = "127.0.0.1:9464",
    web_config_file: Annotated[Path | None, typer.Option(
        "--web-config-file", help="TLS and basic auth for /metrics, in the Prometheus "
        "exporter-toolkit format (tls_server_config: cert_file, key_file, client_auth_type, "
        "client_ca_file; basic_auth_users: bcrypt hashes); see docs/monitoring.md.",
        show_default=False)] = None,
    textfile: Annotated[Path | None, typer.Option(
        "--textfile", help="Also write the exposition to this file each tick (a temporary "
        "file renamed over it), for node_exporter's textfile collector (name it *.prom).",
        show_default=False)] = None,
    csv_dir: Annotated[str | None, typer.Option(
        "--csv-dir", help="Where gpu-metrics.csv and cpu-metrics.csv are appended (rotated "
        f"at 10 MiB, 5 kept), or none. Default: {DEFAULT_CSV_DIR}; none with --once.",
        show_default=False)] = None,
    heal: Annotated[bool | None, typer.Option(
        "--heal/--no-heal", help="Re-converge environments that drifted, or only report "
        "drift. Default: heal; with --once, only report.", show_default=False)] = None,
    compat: Annotated[str | None, typer.Option(
        "--compat", help="Also export dcgm-exporter's DCGM_FI_DEV_* and/or cAdvisor's "
        "container_* names (dcgm,cadvisor) for dashboards built on them. Off by default: on "
        "a host that runs those exporters the series would be doubled.",
        show_default=False)] = None,
) -> None:
    """Watch the host: GPUs (NVML), each environment's cgroup, service and jobs, host CPU and
    memory; export CSV and Prometheus metrics; re-converge environments that drift.

    Runs in the foreground (the envctl-monitor unit runs it). Each tick checks every
    environment that is up as `status` does; one that drifted or whose service died is
    brought up again as `envctl up NAME` would, under the global lock (never while a user's
    up/down holds it), with exponential backoff per environment; what it found and did goes
    to the events log that `status` shows. Metrics are envctl_* with labels that join
    dcgm-exporter's and cAdvisor's (see docs/monitoring.md).

    Example: sudo envctl monitor --textfile /var/lib/node_exporter/textfile/envctl.prom
    """
    from envctl import app as ops
    from envctl.host.context import Host
    from envctl.monitor import daemon
    from envctl.monitor.http import parse_listen
    from envctl.monitor.prom import parse_compat

    interval = interval if interval_i is None else interval_i
    if not interval > 0:
        raise typer.BadParameter(f"--interval {interval}: give a number of seconds above 0")
    addr = None if once else parse_listen(listen)
    if web_config_file is not None and addr is None:
        raise typer.BadParameter("--web-config-file: nothing is served (--once or --listen "
                                 "none)")
    compat_names = parse_compat(compat)
    heal = not once if heal is None else heal
    if csv_dir is None:
        csv_dir = "none" if once else DEFAULT_CSV_DIR
    if heal:
        ops.require_root("monitor (which heals environments; --no-heal only reports)")
    opts = daemon.Options(interval=interval, once=once, listen=addr, textfile=textfile,
                          csv_dir=None if csv_dir.strip().lower() == "none" else Path(csv_dir),
                          heal=heal, compat=compat_names)
    server = None
    if addr is not None:
        from envctl.monitor.http import Auth, MetricsServer

        web = None
        if web_config_file is not None:
            from envctl.monitor import webconfig

            web = webconfig.load(web_config_file)
        server = MetricsServer(addr, tls=web.tls if web else None,
                               auth=Auth(web.users) if web and web.users else None)
    mon = daemon.Monitor(Host.from_env(), opts)
    if once:
        try:
            sys.stdout.buffer.write(mon.once())
        finally:
            mon.close()
        return
    if server is not None:
        mon.serve(server)
    mon.run()


@app.command()
def maintenance(
    env: Annotated[str, typer.Argument(help="The environment (with --gpus: on or off).",
                                       show_default=False, autocompletion=_complete_envs)],
    mode: Annotated[str | None, typer.Argument(help="on: the monitor stops healing it; off: "
                                               "heals again.", show_default=False)] = None,
    gpus: Annotated[bool, typer.Option("--gpus", help="Pause (on) or resume (off) the "
                                       "monitor's GPU sampling instead: it shuts NVML down and "
                                       "holds no GPU node, for nvidia-smi -r, a MIG mode "
                                       "change or a driver reload. `on` waits until the "
                                       "running monitor has let go.")] = False,
    json_: JsonOpt = False,
) -> None:
    """Pause (on) or resume (off) the monitor's healing of one environment, while you work on
    it: the monitor still checks it, reports its drift and exports its metrics. Shown in
    `envctl status`; independent of up and down; lasts until turned off or the next boot.

    Example: sudo envctl maintenance gpu-compute on

    Example: sudo envctl maintenance --gpus on && sudo nvidia-smi -r
    """
    from envctl import commands

    if gpus:
        if mode is not None:
            raise commands.BadArgs("maintenance", "with --gpus give only on or off (no "
                                   "environment)")
        _exit(commands.maintenance_gpus(env.strip().lower(), _opts(), json_=json_))
        return
    if mode is None:
        raise commands.BadArgs("maintenance", "give an environment and on or off (or --gpus "
                               "on|off)")
    _exit(commands.maintenance(env, mode.strip().lower(), _opts(), json_=json_))


@app.command()
def top(
    interval: Annotated[float, typer.Option(
        "--interval", "-n", help="Seconds between redraws.")] = 2.0,
) -> None:
    """A live view of the environments (CPU, memory, OOM kills, tasks, jobs, service, GPU
    memory, last monitor event), the GPUs (utilisation, memory, temperature, power, holder)
    and the active jobs, redrawn in place until q or Ctrl-C, fitted to the terminal: a row
    per environment, then as many GPUs and jobs as the height leaves room for. Read-only.

    Example: envctl top -n 5
    """
    from envctl import listing
    from envctl.host.context import Host
    from envctl.monitor.top import run_top

    if not interval > 0:
        raise typer.BadParameter(f"--interval {interval}: give a number of seconds above 0")
    host = Host.from_env()
    try:
        ws = _workspace(None, pure=True)[0]
    except EnvctlError:
        ws = None  # states from the journals alone (a spec's change is not seen)

    def states(names: list[str]) -> dict[str, str]:  # as `envctl list` says them
        return {r.name: r.state for r in listing.rows(ws, host, names)}

    run_top(host, interval=interval, console=_console(), states=states)


def _recent_events(host: Any, envs: list[str]) -> dict[str, list[dict[str, Any]]]:
    from envctl.commands import recent_events

    return recent_events(host, envs)


def _render_events(console: Any, recent: dict[str, list[dict[str, Any]]]) -> None:
    from envctl.commands import render_events

    render_events(console, recent)


def _watch_status(names: list[str] | None, interval: float) -> None:
    """`status --watch`: `list`'s table (with `status`'s states), then each environment's
    `status` for as many as fit the terminal, redrawn every `interval` seconds until q or
    Ctrl-C."""
    from envctl import app as ops
    from envctl import listing
    from envctl.host.context import Host
    from envctl.monitor.top import captured, fit, watch
    from envctl.render import render_list, render_status

    if not interval > 0:
        raise typer.BadParameter(f"--interval {interval}: give a number of seconds above 0")
    host = Host.from_env()

    def render(console: Any) -> None:
        try:
            ws, env_names = _workspace(names)
        except EnvctlError as exc:  # as `status`: the journals still say what is up
            ws, env_names = None, [n for n in names or [] if not n.endswith((".yaml", ".yml"))]
            console.print(f"[yellow]! specs not read: {exc}[/]")
        targets = env_names or ops.known_environments(ws, host)
        rows = ops.status_rows(ws, host, targets)
        states = listing.status_states(ws, host, rows)
        table = listing.rows(ws, host, list(rows))
        for r in table:
            r.state = states.get(r.name, r.state)
        kw = {"cgroups": ops.cgroup_usage(host, rows), "states": states,
              "limits": listing.limit_summaries(ws, host, list(rows), states)}
        warnings, recent = ops.status_warnings(ws, host, targets), _recent_events(host, targets)
        blocks = [(env, captured(console, lambda c, env=env: (
            render_status(c, {env: rows[env]}, warnings, **kw),
            _render_events(c, {env: recent[env]} if env in recent else {}))))
            for env in rows]
        head = captured(console, lambda c: render_list(c, table)) + [""]
        lines = head + [x for _, b in blocks for x in b] if not console.fit_height else fit(
            head, blocks, console.fit_height, more="… {n} more not shown ({names}): "
                                                   "`envctl status NAME` shows one")
        console.file.write("".join(line + "\n" for line in lines))  # already rendered

    watch(render, interval=interval, console=_console())


def _one_line_summaries() -> None:
    """Each command's line in `envctl --help`: its docstring's first paragraph as one line,
    which rich wraps to the terminal (the docstring's own line breaks would cut it
    mid-sentence)."""
    for cmd in app.registered_commands:
        doc = (cmd.callback.__doc__ or "") if cmd.callback else ""
        first = doc.strip().split("\n\n", 1)[0]
        if first and cmd.short_help is None:
            cmd.short_help = " ".join(first.split())


def _help(argv: list[str]) -> bool:
    return any(a in ("--help", "-h") for a in argv)


def _operate_through_daemon(argv: list[str]) -> None:
    """envctl.commands.through_daemon: exits with the command's code when the daemon ran it."""
    from envctl.commands import through_daemon

    code = through_daemon(argv)
    if code is not None:
        sys.exit(code)


def main(argv: list[str] | None = None) -> None:
    """Run the CLI; every expected error becomes one line on stderr and its exit code."""
    _one_line_summaries()
    # Newer typer vendors click; find its exception base without importing click directly.
    click_error = next(c for c in typer.BadParameter.__mro__ if c.__name__ == "ClickException")
    argv = hoist_global_options(split_job_args(list(sys.argv[1:] if argv is None else argv)))
    debug = "--debug" in argv
    try:
        if os.geteuid() != 0 and not _help(argv):
            _operate_through_daemon(argv)
        # prog_name: `python -m envctl` too reads _ENVCTL_COMPLETE (shell completion).
        rc = app(args=argv, standalone_mode=False, prog_name="envctl")
    except typer.Exit as exc:
        rc = exc.exit_code
    except typer.Abort:
        _stderr("aborted")
        rc = 130
    except click_error as exc:
        # Every usage error reads the same: one line, exit 2 (click's own format is a usage
        # block plus "Error:", different per command).
        command = getattr(getattr(exc, "ctx", None), "command_path", "envctl")
        _stderr(f"error: {exc.format_message()} (see `{command} --help`)")
        rc = 2
    except (EnvctlError, KeyboardInterrupt) as exc:
        from envctl.commands import report

        rc = report(exc, json_="--json" in argv, debug=debug)
    sys.exit(rc or 0)


def entry() -> None:
    """The `envctl` command (console script and `python -m envctl`): `main` as a short-lived
    process, which is what every command is. Two things an interpreter does for long-lived
    programs are skipped: the cyclic garbage collector (a command allocates a few MB and
    exits; the collector ran during pydantic's model building for ~10 ms) and the teardown
    that frees every module at exit (~13 ms with ~330 modules), once output is flushed. An
    error that escapes `main` (a bug) still ends the normal way, with its traceback."""
    gc.disable()
    try:
        main()
    except SystemExit as exc:
        code = exc.code
    else:  # pragma: no cover - main always exits
        code = 0
    if not isinstance(code, int):
        if code is not None:
            print(code, file=sys.stderr)
        code = 0 if code is None else 1
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except BrokenPipeError:  # e.g. `envctl status | head`
        code = code or 1
    os._exit(code)
