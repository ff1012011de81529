"""`envctl monitor --web-config-file`: TLS and basic auth for /metrics, in the format of the
Prometheus exporter-toolkit (node_exporter's `--web.config.file`), so one file serves both:

    tls_server_config:
      cert_file: /etc/envctl/metrics.crt
      key_file: /etc/envctl/metrics.key
      client_auth_type: RequireAndVerifyClientCert   # optional; NoClientCert by default
      client_ca_file: /etc/envctl/prometheus-ca.crt  # needed to verify client certificates
      min_version: TLS12                             # optional: TLS10..TLS13
    basic_auth_users:
      prometheus: $2y$10$...                         # bcrypt (htpasswd -nBC 10 "" | tr -d ':')

What envctl cannot honour is refused, with the file, the line and the field, before the
monitor starts: an unknown key, a hash that is not bcrypt, and `RequestClientCert` /
`RequireAnyClientCert` (a client certificate asked for but not verified: Python's ssl cannot
ask without verifying, and an unverified certificate proves nothing).

The file and the key it names hold secrets that decide who reads the metrics: like sshd's
StrictModes, a file another user could write is refused when the monitor runs as root.
"""

from __future__ import annotations

import os
import ssl
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from envctl.errors import InputError

CLIENT_AUTH = {
    "NoClientCert": ssl.CERT_NONE,
    "VerifyClientCertIfGiven": ssl.CERT_OPTIONAL,
    "RequireAndVerifyClientCert": ssl.CERT_REQUIRED,
}
UNVERIFIED = ("RequestClientCert", "RequireAnyClientCert")
VERSIONS = {"TLS10": ssl.TLSVersion.TLSv1, "TLS11": ssl.TLSVersion.TLSv1_1,
            "TLS12": ssl.TLSVersion.TLSv1_2, "TLS13": ssl.TLSVersion.TLSv1_3}
TLS_KEYS = ("cert_file", "key_file", "client_auth_type", "client_ca_file", "min_version",
            "max_version")
TOP_KEYS = ("tls_server_config", "basic_auth_users")
BCRYPT_PREFIXES = ("$2a$", "$2b$", "$2y$")


@dataclass
class WebConfig:
    """What the file asks for: a server TLS context and/or basic-auth users (name -> hash)."""

    tls: ssl.SSLContext | None = None
    users: dict[str, bytes] | None = None


class _Where:
    """Line-aware error messages for one file."""

    def __init__(self, path: Path):
        self.path = path

    def fail(self, node: Any, field: str, message: str) -> InputError:
        line = node.start_mark.line + 1 if node is not None else 1
        return InputError(f"{self.path}:{line}: {field}: {message}")


def load(path: Path) -> WebConfig:
    """Read and check the web config file at `path` (named by root on the command line)."""
    import yaml

    where = _Where(path)
    text = _read_guarded(path, "web config file")
    try:
        root = yaml.compose(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = mark.line + 1 if mark else 1
        raise InputError(f"{path}:{line}: YAML syntax error: "
                         f"{getattr(exc, 'problem', None) or exc}") from None
    if root is None:
        return WebConfig()  # an empty file: plain HTTP, no auth, as the exporter-toolkit
    top = _mapping(where, root, "(top level)", TOP_KEYS)
    cfg = WebConfig()
    if "tls_server_config" in top:
        cfg.tls = _tls(where, path.parent, *top["tls_server_config"])
    if "basic_auth_users" in top:
        cfg.users = _users(where, *top["basic_auth_users"])
    return cfg


def _mapping(where: _Where, node: Any, field: str, allowed: tuple[str, ...]) -> dict[str, Any]:
    """key -> (key node, value node) of a YAML mapping whose keys must be in `allowed`."""
    import yaml

    if not isinstance(node, yaml.MappingNode):
        raise where.fail(node, field, "must be a mapping")
    out: dict[str, Any] = {}
    for k, v in node.value:
        key = str(k.value)
        if allowed and key not in allowed:
            raise where.fail(k, f"{field}.{key}" if field != "(top level)" else key,
                             f"unknown key; allowed: {', '.join(allowed)}")
        if key in out:
            raise where.fail(k, key, "given twice")
        out[key] = (k, v)
    return out


def _scalar(where: _Where, node: Any, field: str) -> str:
    import yaml

    if not isinstance(node, yaml.ScalarNode) or not str(node.value).strip():
        raise where.fail(node, field, "must be a non-empty string")
    return str(node.value)


def _tls(where: _Where, base: Path, key_node: Any, node: Any) -> ssl.SSLContext:
    f = "tls_server_config"
    items = _mapping(where, node, f, TLS_KEYS)
    values = {k: (_scalar(where, v, f"{f}.{k}"), v) for k, (_, v) in items.items()}
    for need in ("cert_file", "key_file"):
        if need not in values:
            raise where.fail(key_node, f"{f}.{need}", "missing: TLS needs a certificate and "
                             "its key")
    auth_type, auth_node = values.get("client_auth_type", ("NoClientCert", node))
    if auth_type in UNVERIFIED:
        raise where.fail(auth_node, f"{f}.client_auth_type", f"{auth_type} is not supported "
                         "(a certificate asked for but not verified proves nothing); use "
                         "VerifyClientCertIfGiven or RequireAndVerifyClientCert")
    if auth_type not in CLIENT_AUTH:
        raise where.fail(auth_node, f"{f}.client_auth_type", f"{auth_type!r}; allowed: "
                         f"{', '.join(CLIENT_AUTH)}")
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    for k, attr in (("min_version", "minimum_version"), ("max_version", "maximum_version")):
        if k in values:
            want, vnode = values[k]
            if want not in VERSIONS:
                raise where.fail(vnode, f"{f}.{k}", f"{want!r}; allowed: {', '.join(VERSIONS)}")
            setattr(ctx, attr, VERSIONS[want])
    cert, cert_node = values["cert_file"]
    key, key_file_node = values["key_file"]
    cert_path, key_path = base / cert, base / key  # relative to the file, as the toolkit
    # Each file checked (root's alone to change, the key not world-readable), then loaded
    # from the descriptor that was checked (/proc/self/fd: the same inode, not the name
    # again, which could have been swapped meanwhile).
    key_fd = _open_guarded(key_path, "TLS key file", private=True,
                           where=(where, key_file_node, f"{f}.key_file"))
    try:
        cert_fd = _open_guarded(cert_path, "TLS certificate file",
                                where=(where, cert_node, f"{f}.cert_file"))
        try:
            ctx.load_cert_chain(f"/proc/self/fd/{cert_fd}", f"/proc/self/fd/{key_fd}")
        except (OSError, ssl.SSLError) as exc:
            raise where.fail(cert_node, f"{f}.cert_file", f"cannot load {cert_path} with "
                             f"{key_path}: {getattr(exc, 'strerror', None) or exc}") from None
        finally:
            os.close(cert_fd)
    finally:
        os.close(key_fd)
    ctx.verify_mode = CLIENT_AUTH[auth_type]
    if "client_ca_file" in values:
        ca, ca_node = values["client_ca_file"]
        # Who can write the CA file can make a client certificate that passes.
        pem = _read_guarded(base / ca, "client CA file",
                            where=(where, ca_node, f"{f}.client_ca_file"))
        try:
            ctx.load_verify_locations(cadata=pem)
        except (OSError, ssl.SSLError) as exc:
            raise where.fail(ca_node, f"{f}.client_ca_file", f"cannot load {base / ca}: "
                             f"{getattr(exc, 'strerror', None) or exc}") from None
    elif ctx.verify_mode != ssl.CERT_NONE:
        raise where.fail(auth_node, f"{f}.client_ca_file", f"missing: {auth_type} verifies "
                         "client certificates against it")
    return ctx


def _users(where: _Where, key_node: Any, node: Any) -> dict[str, bytes]:
    users = {}
    for name, (_, v) in _mapping(where, node, "basic_auth_users", ()).items():
        field = f"basic_auth_users.{name}"
        hashed = _scalar(where, v, field)
        if not hashed.startswith(BCRYPT_PREFIXES) or len(hashed) != 60:
            raise where.fail(v, field, "must be a bcrypt hash ($2y$10$..., 60 characters: "
                             "htpasswd -nBC 10 \"\" | tr -d ':')")
        users[name] = hashed.encode()
    if not users:
        raise where.fail(key_node, "basic_auth_users", "names no user (leave it out for none)")
    try:
        import bcrypt  # noqa: F401 - refused now rather than at the first scrape
    except ImportError:
        raise where.fail(key_node, "basic_auth_users", "needs the bcrypt module (pip install "
                         "bcrypt; scripts/install-deps does)") from None
    return users


def _read_guarded(path: Path, what: str, *, where: tuple[_Where, Any, str] | None = None) -> str:
    """The text of `path`, refused when, as root, another user could have written it."""
    fd = _open_guarded(path, what, where=where)
    with os.fdopen(fd, "rb") as f:
        return f.read().decode("utf-8", "replace")


def _open_guarded(path: Path, what: str, *, private: bool = False,
                  where: tuple[_Where, Any, str] | None = None) -> int:
    """A descriptor of `path` (a regular file), refused when, as root, someone other than
    root could have changed it or a directory or symlink on the way to it
    (spec.loader.changeable_by_others, the rule specs follow), or, `private` (a key), when
    every user may read it."""
    from envctl.spec.loader import changeable_by_others

    def refuse(msg: str) -> InputError:
        if where is not None:
            return where[0].fail(where[1], where[2], msg)
        return InputError(msg)

    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOCTTY | os.O_NONBLOCK)
    except OSError as exc:
        raise refuse(f"cannot open {what} {path}: {exc.strerror}") from None
    try:
        st = os.fstat(fd)
        problem = ""
        if not stat.S_ISREG(st.st_mode):
            problem = "is not a regular file"
        elif os.geteuid() == 0 and (st.st_uid != 0 or st.st_mode & 0o022):
            problem = (f"is writable by a user other than root (owner uid {st.st_uid}, mode "
                       f"{stat.S_IMODE(st.st_mode):04o}): chown root and chmod go-w it")
        elif os.geteuid() == 0 and (bad := changeable_by_others([path])):
            _, where_, why = bad[0]
            problem = f"is reached through {where_}, which {why}: only root may change it"
        elif private and st.st_mode & 0o004:
            problem = (f"is readable by every user (mode {stat.S_IMODE(st.st_mode):04o}): "
                       "chmod o-r it")
        if problem:
            raise refuse(f"{what} {path} {problem}")
    except BaseException:
        os.close(fd)
        raise
    return fd
