"""`envctl submit-job`: the command itself (what the typer command and the fast path both run)
and its fast path, which never builds the typer CLI.

`submit-job` to RUNNING is a latency the issue sets a target for (≤ 100 ms); the typer CLI's
import and parse (~25 ms here) and the host facts behind the cgroup adapter (~12 ms) were a
third of it. The fast parser takes the plain forms of every option `submit-job` has and leaves
anything else (--help, a global option, an unknown or malformed option) to typer, which
answers with its own messages; both end in `submit`, so they cannot differ in what they do.
"""

from __future__ import annotations

import os
import sys

from envctl.errors import NeedsRootError

# submit-job's options: those that take a value (-> its keyword), and the flags.
VALUE_OPTIONS = {"--name": "name", "-J": "name", "--time-limit": "time_limit",
                 "-t": "time_limit", "--cpus": "cpus", "--gpus": "gpus", "--mem": "mem",
                 "--env": "env",
                 "--workdir": "workdir", "-D": "workdir", "--output": "output", "-o": "output",
                 "--error": "error", "-e": "error", "--user": "user", "-u": "user"}
FLAGS = {"--wait": "wait", "-W": "wait", "--json": "json"}


def submit(env: str, exe: str, args: list[str], *, name: str | None = None,
           time_limit: str | None = None, cpus: str | None = None, gpus: str | None = None,
           env_vars: list[str] | None = None, workdir: str = "/", output: str | None = None,
           error: str | None = None, user: str | None = None, wait: bool = False,
           json_: bool = False, mem: str | None = None) -> int:
    """Submit the job, print its id (or its record with `json_`) and return the exit code:
    0, 1 when it did not start, the job's own code with `wait`. Raises EnvctlError for bad
    input (nothing changed) and a host that refuses."""
    from envctl.server import client as cl

    daemon = cl.route()
    if daemon is not None:
        raw = cl.submit_record(daemon, env, exe, list(args), name=name, time_limit=time_limit,
                               cpus=cpus, gpus=gpus, env_vars=env_vars, workdir=workdir,
                               output=output, error=error, user=user, mem=mem,
                               early=not (wait or json_))
        if not (wait or json_) and (raw.get("state") != "FAILED"
                                    or raw.get("start_time") is not None):
            # The common answer, the id: from the daemon's JSON, without importing the job
            # records' module to build a Job (the ≤ 50 ms client target, docs/benchmarks.md).
            print(raw["id"], flush=True)
            return 0
        job = cl.job_of(raw)
    else:
        job = _submit_here(env, exe, args, name=name, time_limit=time_limit, cpus=cpus,
                           gpus=gpus, env_vars=env_vars, workdir=workdir, output=output,
                           error=error, user=user, mem=mem)
    from envctl.runtime.jobs import State, format_exit

    if job.state is State.FAILED and job.start_time is None:
        _show(job, json_)
        print(f"error: job {job.id} did not start: {job.error}", file=sys.stderr)
        return 1
    if not wait:
        _show(job, json_)
        return 0
    if not json_:
        print(job.id, flush=True)
    if daemon is not None:
        job = cl.wait(daemon, [job.id])[0]
    else:
        from envctl.host.context import Host
        from envctl.runtime import supervisor as sv

        job = sv.wait(Host.from_env(), [job.id])[0]
    if json_:
        _show(job, json_)
    else:
        print(f"job {job.id} {job.state} (exit {format_exit(job)})", file=sys.stderr)
    return job.exit_status()


def _submit_here(env: str, exe: str, args: list[str], **options: object) -> object:
    """The job submitted by this process itself (root, no daemon)."""
    from envctl.host.context import Host
    from envctl.runtime import supervisor as sv
    from envctl.runtime.context import EnvContext

    host = Host.from_env()
    ctx = EnvContext.load(host, env)
    req = sv.make_request(host, ctx, exe, list(args), name=options["name"],
                          user=options["user"], cpus=options["cpus"], gpus=options["gpus"],
                          env=options["env_vars"], workdir=options["workdir"],
                          output=options["output"], error=options["error"],
                          time_limit=options["time_limit"], mem=options["mem"])
    if os.geteuid() != 0:
        raise NeedsRootError("envctl submit-job enters the environment's namespaces and "
                             "cgroup and needs root: run it with sudo")
    return sv.submit(host, ctx, req)


def _show(job: object, json_: bool) -> None:
    if json_:
        import json

        sys.stdout.write(json.dumps(job.to_json(), indent=2, default=str) + "\n")
    else:
        print(job.id, flush=True)


def parse_args(args: list[str]) -> dict | None:
    """`submit`'s keywords from `submit-job [OPTIONS] ENV [OPTIONS] EXE [ARGS…]` as the typer
    command reads it (everything after the program is the job's, options included; a `--`
    before it ends the options), or None for anything the fast path leaves to typer."""
    if not args or args[0] != "submit-job":
        return None
    kw: dict = {}
    words: list[str] = []
    i = 1
    while i < len(args) and len(words) < 2:
        word = args[i]
        if word == "--":
            words += args[i + 1:]
            i = len(args)
            break
        if word.startswith("-") and word != "-":
            opt, eq, value = word.partition("=")
            if opt in FLAGS and not eq:
                kw[FLAGS[opt]] = True
                i += 1
                continue
            if opt not in VALUE_OPTIONS or (eq and not opt.startswith("--")):
                return None  # --help, a global option, -tVALUE …: typer's
            if not eq:
                if i + 1 >= len(args):
                    return None
                value = args[i + 1]
            key = VALUE_OPTIONS[opt]
            if key == "env":
                kw.setdefault("env_vars", []).append(value)
            else:
                kw[key] = value
            i += 1 if eq else 2
            continue
        words.append(word)
        i += 1
    rest = args[i:]
    if len(words) == 2 and rest[:1] == ["--"]:
        rest = rest[1:]  # `EXE -- ARGS`: the `--` ends envctl's options, as typer reads it
    words += rest
    if len(words) < 2:
        return None
    kw["json_"] = kw.pop("json", False)
    return {"env": words[0], "exe": words[1], "args": words[2:], **kw}


def fast_entry(argv: list[str] | None = None) -> None:
    """`envctl submit-job …` without the typer CLI: run and leave with its exit code.
    Returns, doing nothing, when the arguments are not plain ones."""
    parsed = parse_args(list(sys.argv[1:] if argv is None else argv))
    if parsed is None:
        return
    from envctl.runtime.fastpath import run_fast

    run_fast(lambda: submit(**parsed))
