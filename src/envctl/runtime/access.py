"""Who may do what to an environment and its jobs: the spec's `access:` lists, the host-wide
admin group, and the one-line refusals (AccessDenied, exit 1).

The caller is who the kernel says asks (SO_PEERCRED and SO_PEERGROUPS on the daemon's socket,
or this process's own ids in-process), never what a client says of itself. Its groups are the
kernel's: a user added to a group is a member for envctl when its processes are (after a new
login), as for every file it opens.

The rules (docs/runtime.md, "Access"):
- root (uid 0) and members of the admin group (`envctl`, $ENVCTL_ADMIN_GROUP) may do anything;
- `access.submit` may submit jobs, exec, list jobs; `access.operate` may also bring the
  environment up and down, see its status, and read, cancel and wait for all its jobs;
- a job's owner (who submitted it) may read, cancel and wait for it, whatever the lists say
  now;
- an environment whose spec has no `access:` (or no spec here) is its admins' alone.

Names in the lists are matched by what the host's user and group databases (NSS) say they
are now: a user by uid (`getpwnam`), a group by gid (`getgrnam`) against the caller's gid and
supplementary groups. A name the host does not know matches nobody; `validate --host` says so.

Imports only the standard library's C modules at load (pwd, grp): the daemon and `envctl
jobs` start fast. The spec's loader (YAML, pydantic) is imported when a spec is read.
"""

from __future__ import annotations

import os
from pathlib import Path

from envctl.errors import AccessDenied
from envctl.record import Record

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (~5 ms): see record.py
if TYPE_CHECKING:
    from envctl.runtime.jobs import Job

ADMIN_GROUP = "envctl"


def admin_group() -> str:
    """The host group whose members are envctl admins: $ENVCTL_ADMIN_GROUP, else `envctl`.
    (Read in the process that decides: the daemon's environment is root's.)"""
    return os.environ.get("ENVCTL_ADMIN_GROUP") or ADMIN_GROUP


class Caller(Record, frozen=True):
    """Who asks, as the kernel says: uid, primary gid, supplementary gids, pid."""

    uid: int
    gid: int
    groups: tuple[int, ...] = ()
    pid: int = 0

    @property
    def name(self) -> str:
        """The login name of the uid (the host's passwd), else the uid as digits."""
        return user_name(self.uid)

    @property
    def gids(self) -> frozenset[int]:
        return frozenset((self.gid, *self.groups))

    @classmethod
    def of_process(cls) -> Caller:
        """This process (an in-process command: the caller is whoever runs envctl)."""
        return cls(os.getuid(), os.getgid(), tuple(sorted(set(os.getgroups()))), os.getpid())


class Grant(Record, frozen=True):
    """One list of `access:` (submit or operate): login names and group names."""

    users: tuple[str, ...] = ()
    groups: tuple[str, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.users or self.groups)

    def admits(self, c: Caller) -> bool:
        """Whether `c` is one of the users (by uid) or in one of the groups (by gid)."""
        return (any(user_id(u) == c.uid for u in self.users)
                or any(group_id(g) in c.gids for g in self.groups))

    def describe(self) -> str:
        """`users: alice, bob; groups: team-a`, or `nobody`."""
        parts = [f"{what}: {', '.join(names)}" for what, names in
                 (("users", self.users), ("groups", self.groups)) if names]
        return "; ".join(parts) or "nobody"


class Access(Record, frozen=True):
    """An environment's `access:`, as its spec file says (`file`). `refused`: why that file
    cannot be trusted or read (an invalid spec, one that others than root may write); then
    only admins may use the environment, and refusals say why."""

    submit: Grant = Grant()
    operate: Grant = Grant()
    file: str = ""
    refused: str = ""


# ---------------------------------------------------------------- names


def user_name(uid: int) -> str:
    import pwd

    try:
        return pwd.getpwuid(uid).pw_name
    except (KeyError, OverflowError):
        return str(uid)


def user_id(name: str) -> int | None:
    """The uid of login `name`, None when the host does not know it."""
    import pwd

    try:
        return pwd.getpwnam(name).pw_uid
    except KeyError:
        return None


def group_id(name: str) -> int | None:
    """The gid of group `name`, None when the host does not know it."""
    import grp

    try:
        return grp.getgrnam(name).gr_gid
    except KeyError:
        return None


# ---------------------------------------------------------------- reading a spec's access


def load_access(env: str, config_dir: Path | None = None) -> Access | None:
    """The `access:` of the spec named `env` in `config_dir` (default: the one rule,
    envctl.runtime.context.config_dir), None when that spec has none or there is no such
    spec (then only admins may use it). A spec that is invalid, or that anyone but root could
    change while envctl runs as root (it would let them grant themselves access), gives an
    Access that admits nobody, with `refused` saying why."""
    from envctl.runtime.context import config_dir as default_dir

    directory = default_dir() if config_dir is None else Path(config_dir)
    path = _spec_file(directory, env)
    if path is None:
        return None
    from envctl.errors import SpecError
    from envctl.spec.loader import load_spec, unsafe_spec_paths

    # Along the path as written and along the one its links lead to: a link in the config
    # directory to a file in a directory someone else owns lets them swap the file.
    unsafe = unsafe_spec_paths([directory, path, directory.resolve(), path.resolve()])
    if unsafe:
        return Access(file=str(path), refused=f"its spec is not root's alone ({unsafe[0]})")
    try:
        spec = load_spec(path).spec
    except SpecError as exc:
        first = exc.problems[0] if exc.problems else f"{path}: invalid"
        return Access(file=str(path), refused=f"its spec is invalid ({first})")
    if spec.name != env or spec.access is None:
        return None
    a = spec.access
    return Access(Grant(tuple(a.submit.users), tuple(a.submit.groups)),
                  Grant(tuple(a.operate.users), tuple(a.operate.groups)), str(path))


def _spec_file(directory: Path, env: str) -> Path | None:
    """The spec file whose top-level `name:` is `env` (read by that line, as a launch's error
    path does, so that only that file is parsed)."""
    from envctl.runtime.context import spec_name_of

    try:
        entries = sorted(directory.iterdir())
    except OSError:
        return None
    for p in entries:
        if p.suffix not in (".yaml", ".yml"):
            continue
        try:
            # Not by is_file() then a read by name: a FIFO swapped in between would block
            # the daemon's loop (handlers.warm) in open() for ever.
            if spec_name_of(p) == env:
                return p
        except OSError:
            continue
    return None


# ---------------------------------------------------------------- decisions


def is_admin(c: Caller) -> bool:
    """uid 0, or a member (primary or supplementary) of the admin group."""
    if c.uid == 0:
        return True
    gid = group_id(admin_group())
    return gid is not None and gid in c.gids


def _admins() -> str:
    return f"envctl admins (root, group {admin_group()})"


def _no_list(env: str, access: Access | None) -> str:
    if access is not None and access.refused:
        return f"{access.refused}, so only {_admins()} may use it"
    return f"its spec has no access list, so only {_admins()} may use it"


def check_submit(env: str, access: Access | None, c: Caller) -> None:
    """`c` may submit jobs to `env`, exec in it and list its jobs: an admin, or in
    access.submit or access.operate. AccessDenied otherwise."""
    if is_admin(c):
        return
    if access is None or access.refused:
        raise AccessDenied(f"{c.name} may not use {env}: {_no_list(env, access)}")
    if access.submit.admits(c) or access.operate.admits(c):
        return
    msg = f"{c.name} is not in access.submit of {env} ({access.submit.describe()})"
    if access.operate:
        msg += f" nor access.operate ({access.operate.describe()})"
    raise AccessDenied(msg)


def check_operate(env: str, access: Access | None, c: Caller) -> None:
    """`c` may bring `env` up or down and see its status: an admin, or in access.operate."""
    if is_admin(c):
        return
    if access is None or access.refused:
        raise AccessDenied(f"{c.name} may not operate {env}: {_no_list(env, access)}")
    if access.operate.admits(c):
        return
    raise AccessDenied(f"{c.name} is not in access.operate of {env} "
                       f"({access.operate.describe()})")


def job_owner(job: Job) -> int:
    """The uid who owns `job`: who submitted it (the user behind sudo, or the daemon's
    caller), else the user it runs as (a job root submitted for --user alice is alice's)."""
    if job.submitter:
        return int(job.submitter[0])
    return int(job.uid)


def may_see_job(job: Job, access: Access | None, c: Caller) -> bool:
    """Whether `c` may read the logs of, cancel and wait for `job`: its owner, an operator of
    its environment, an admin."""
    if is_admin(c) or job_owner(job) == c.uid:
        return True
    return operates(access, c)


def operates(access: Access | None, c: Caller) -> bool:
    """Whether `c` is in the `access.operate` of an environment whose access list this is."""
    return access is not None and not access.refused and access.operate.admits(c)


def check_job(job: Job, access: Access | None, c: Caller, what: str) -> None:
    """`c` may `what` (cancel, read the logs of, wait for …) `job`. AccessDenied otherwise.
    `access` is that of the job's environment."""
    if may_see_job(job, access, c):
        return
    if access is None:
        operators = f"operators of {job.env} (its spec has no access list)"
    elif access.refused:
        operators = f"operators of {job.env} ({access.refused})"
    else:
        operators = f"access.operate of {job.env} ({access.operate.describe()})"
    raise AccessDenied(f"{c.name} may not {what} job {job.id} of {user_name(job_owner(job))} "
                       f"(only its owner, {operators} and envctl admins)")


def check_user_option(c: Caller, user: str | None) -> None:
    """A non-admin's job runs as that user: `--user` may name only themselves (a login name or
    uid the host resolves to the caller's uid, with a group the caller is in, if any).
    AccessDenied otherwise. The user a launch then resolves (in the environment's passwd
    first) must still be the caller's uid: see check_run_as."""
    if user is None or is_admin(c):
        return
    from envctl.text import ascii_digits

    name, _, group = user.partition(":")
    uid = int(name) if ascii_digits(name) else user_id(name)
    if uid != c.uid:
        raise AccessDenied(f"{c.name} may not run a job as {name}: --user may name only "
                           "yourself unless you are one of the " + _admins())
    if group:
        gid = int(group) if ascii_digits(group) else group_id(group)
        if gid not in c.gids:
            raise AccessDenied(f"{c.name} may not run a job with group {group}: not one of "
                               "your groups (envctl admins may)")


def check_run_as(c: Caller, uid: int, gid: int) -> None:
    """The uid and gid a launch resolved for a non-admin caller are the caller's own (a
    rootfs's /etc/passwd may give a name another uid than the host does)."""
    if is_admin(c):
        return
    if uid != c.uid or gid not in c.gids:
        raise AccessDenied(f"{c.name} may not run a job as uid {uid} gid {gid}: only as "
                           f"yourself (uid {c.uid}, one of your groups)")
