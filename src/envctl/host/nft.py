"""envctl's own nftables table `inet envctl`: per-environment rules in atomic JSON transactions.

Every change is one JSON document run as one transaction, exactly what `nft -j -f -` runs: by
default through libnftables (the library the `nft` command is a thin front end of, loaded with
ctypes, so a run of 32 environments does not pay 32 x 4 process starts), or through the `nft`
command itself with `ENVCTL_NFT=cli` or when the library cannot be loaded. Only the table
`inet envctl` is ever read or written; other tables are never listed, flushed or deleted.

The table's listing is kept between calls and used again only while the kernel's ruleset
generation (bumped by every committed nftables transaction in the namespace, whoever makes it)
is the one it was read at, or the one right after this process's own transaction, whose effect
is applied to the kept copy. Any other change anywhere in nftables means a fresh listing.
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import socket
import struct
import subprocess
from typing import Any

from envctl.errors import HostError
from envctl.host.fwrules import Listing, Row, Rule, compare_rules
from envctl.spec.naming import env_of_comment

FAMILY, TABLE = "inet", "envctl"
# name -> (type, hook, priority): nat at dstnat (-100) / srcnat (100), filter at 0, as nft's
# named priorities.
BASE_CHAINS = {
    "prerouting": ("nat", "prerouting", -100),
    "output": ("nat", "output", -100),
    "postrouting": ("nat", "postrouting", 100),
    "forward": ("filter", "forward", 0),
}
NFT_CTX_OUTPUT_JSON = 1 << 4
# NFT_MSG_GETGEN of the nftables netfilter subsystem; its answer carries NFTA_GEN_ID (be32).
NETLINK_NETFILTER, NFNL_SUBSYS_NFTABLES, NFT_MSG_GETGEN, NFTA_GEN_ID = 12, 10, 16, 1
GEN_MASK = 0xFFFFFFFF



# ---------------------------------------------------------------- JSON generation (pure)


def _match(left: dict[str, Any], right: Any, op: str = "==") -> dict[str, Any]:
    return {"match": {"op": op, "left": left, "right": right}}


def _meta(key: str) -> dict[str, Any]:
    return {"meta": {"key": key}}


def _ip(field: str) -> dict[str, Any]:
    return {"payload": {"protocol": "ip", "field": field}}


def _prefix(cidr: str) -> Any:
    addr, _, plen = cidr.partition("/")
    return {"prefix": {"addr": addr, "len": int(plen)}} if plen else addr


def rule_exprs(rule: Rule) -> list[dict[str, Any]]:
    """The nft JSON expressions of `rule`, matches first, then its statement."""
    e: list[dict[str, Any]] = []
    if rule.iif:
        e.append(_match(_meta("iifname"), rule.iif))
    if rule.oif:
        e.append(_match(_meta("oifname"), rule.oif))
    if rule.not_oif:
        e.append(_match(_meta("oifname"), rule.not_oif, "!="))
    if rule.saddr:
        e.append(_match(_ip("saddr"), _prefix(rule.saddr)))
    if rule.daddr:
        e.append(_match(_ip("daddr"), _prefix(rule.daddr)))
    if rule.not_daddr:
        e.append(_match(_ip("daddr"), _prefix(rule.not_daddr), "!="))
    if rule.local_daddr:
        e.append(_match({"fib": {"result": "type", "flags": ["daddr"]}}, "local"))
    if rule.proto:
        e.append(_match(_meta("l4proto"), rule.proto))
    if rule.dport is not None:
        e.append(_match({"payload": {"protocol": "th", "field": "dport"}}, rule.dport))
    if rule.not_dnat:
        e.append(_match({"ct": {"key": "status"}}, "dnat", "!="))
    if rule.action == "masquerade":
        e.append({"masquerade": None})
    elif rule.action == "dnat":
        e.append({"dnat": {"family": "ip", "addr": rule.to_addr, "port": rule.to_port}})
    elif rule.action == "drop":
        e.append({"drop": None})
    else:
        raise ValueError(f"unknown firewall action {rule.action!r}")
    return e


def canonical(exprs: list[dict[str, Any]]) -> tuple[str, ...]:
    """A rule's expressions in one form for both what envctl generates and what libnftables
    lists back, one compact JSON string per expression. nft 1.0.6 lists `meta l4proto P`
    followed by `th dport N` as the single `P dport N` (it folds the protocol dependency),
    and an address prefix of /32 as the bare address; both sides are brought to that form.
    Everything else is compared as it is, so a hand edit of any match or statement shows."""
    out: list[dict[str, Any]] = []
    for e in exprs:
        m = e.get("match") if isinstance(e, dict) else None
        if m and out and m.get("op") == "==" and m.get("left") == {
                "payload": {"protocol": "th", "field": "dport"}}:
            prev = out[-1].get("match")
            if (prev and prev.get("op") == "==" and prev.get("left") == _meta("l4proto")
                    and prev.get("right") in ("tcp", "udp")):
                out[-1] = _match({"payload": {"protocol": prev["right"], "field": "dport"}},
                                 m["right"])
                continue
        if m and isinstance(m.get("right"), dict) and m["right"].get("prefix", {}).get(
                "len") == 32:
            e = _match(m["left"], m["right"]["prefix"]["addr"], m.get("op", "=="))
        out.append(e)
    return tuple(json.dumps(e, sort_keys=True, separators=(",", ":")) for e in out)


def content(rule: Rule) -> tuple[str, ...]:
    """What `rule` lists back as, in `canonical` form."""
    return canonical(rule_exprs(rule))


def base() -> dict[str, str]:
    """Each base chain envctl needs, as `Listing.base` describes a found one."""
    return {f"chain {name}": _describe_chain(ctype, hook, prio, "accept")
            for name, (ctype, hook, prio) in BASE_CHAINS.items()}


def _describe_chain(ctype: object, hook: object, prio: object, policy: object) -> str:
    return f"type {ctype} hook {hook} priority {prio} policy {policy}"


def table_commands() -> list[dict[str, Any]]:
    """`add` the table and its base chains: a no-op for the ones that exist."""
    cmds: list[dict[str, Any]] = [{"add": {"table": {"family": FAMILY, "name": TABLE}}}]
    for name, (ctype, hook, prio) in BASE_CHAINS.items():
        cmds.append({"add": {"chain": {"family": FAMILY, "table": TABLE, "name": name,
                                       "type": ctype, "hook": hook, "prio": prio,
                                       "policy": "accept"}}})
    return cmds


def add_rule_command(rule: Rule) -> dict[str, Any]:
    return {"add": {"rule": {"family": FAMILY, "table": TABLE, "chain": rule.chain,
                             "comment": rule.comment, "expr": rule_exprs(rule)}}}


def delete_rule_command(chain: str, handle: int) -> dict[str, Any]:
    return {"delete": {"rule": {"family": FAMILY, "table": TABLE, "chain": chain,
                                "handle": handle}}}


def delete_table_command() -> dict[str, Any]:
    return {"delete": {"table": {"family": FAMILY, "name": TABLE}}}


def document(cmds: list[dict[str, Any]]) -> str:
    return json.dumps({"nftables": cmds})


# ---------------------------------------------------------------- transports


class _Library:
    """libnftables through ctypes: one context, JSON in and out."""

    def __init__(self) -> None:
        lib = ctypes.CDLL("libnftables.so.1", use_errno=True)
        lib.nft_ctx_new.restype = ctypes.c_void_p
        lib.nft_ctx_new.argtypes = [ctypes.c_uint32]
        for f in ("nft_ctx_buffer_output", "nft_ctx_buffer_error"):
            getattr(lib, f).argtypes = [ctypes.c_void_p]
        for f in ("nft_ctx_get_output_buffer", "nft_ctx_get_error_buffer"):
            getattr(lib, f).argtypes = [ctypes.c_void_p]
            getattr(lib, f).restype = ctypes.c_char_p
        lib.nft_ctx_output_set_flags.argtypes = [ctypes.c_void_p, ctypes.c_uint]
        lib.nft_run_cmd_from_buffer.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
        ctx = lib.nft_ctx_new(0)
        if not ctx:
            raise OSError("nft_ctx_new failed")
        lib.nft_ctx_buffer_output(ctx)
        lib.nft_ctx_buffer_error(ctx)
        lib.nft_ctx_output_set_flags(ctx, NFT_CTX_OUTPUT_JSON)
        self.lib, self.ctx = lib, ctx

    def run(self, doc: str) -> tuple[bool, str, str]:
        rc = self.lib.nft_run_cmd_from_buffer(self.ctx, doc.encode())
        out = (self.lib.nft_ctx_get_output_buffer(self.ctx) or b"").decode()
        err = (self.lib.nft_ctx_get_error_buffer(self.ctx) or b"").decode()
        return rc == 0, out, err


class _Command:
    """`nft -j -f -` with the document on stdin."""

    def __init__(self, nft: str) -> None:
        self.nft = nft

    def run(self, doc: str) -> tuple[bool, str, str]:
        res = subprocess.run([self.nft, "-j", "-f", "-"], input=doc, capture_output=True,
                             text=True, check=False)
        return res.returncode == 0, res.stdout, res.stderr


def _transport() -> _Library | _Command:
    if os.environ.get("ENVCTL_NFT") != "cli":
        try:
            return _Library()
        except OSError:
            pass  # no library: the command does the same
    nft = shutil.which("nft")
    if nft is None:
        raise HostError("use nftables: neither libnftables nor the nft command is installed "
                        "(install the nftables package, or set network.firewall: iptables)")
    return _Command(nft)


# ---------------------------------------------------------------- the adapter


class _Generation:
    """The nftables ruleset generation of this process's network namespace."""

    def __init__(self) -> None:
        from envctl.host.netlink import Requests

        self._nl = Requests(socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM,
                                          NETLINK_NETFILTER))

    def read(self) -> int | None:
        """The generation, or None when it cannot be read (then nothing kept is used)."""
        from envctl.host.netlink import attrs

        try:
            bodies = self._nl.request((NFNL_SUBSYS_NFTABLES << 8) | NFT_MSG_GETGEN,
                                      struct.pack("=BBH", 0, 0, 0))
        except OSError:
            return None
        gen = attrs(bodies[0], 4).get(NFTA_GEN_ID) if bodies else None
        return struct.unpack(">I", gen)[0] if gen is not None and len(gen) == 4 else None


class Nftables:
    """Reads and changes only table `inet envctl`."""

    name = "nftables"

    def __init__(self) -> None:
        self._nft: _Library | _Command | None = None
        self._gen: _Generation | None = None
        # The table as last read or written by this process, and the generation it is valid at.
        self._kept: Listing | None = None
        self._kept_gen: int | None = None

    @property
    def transport(self) -> str:
        return "libnftables" if isinstance(self._t(), _Library) else "nft -j -f -"

    def _t(self) -> _Library | _Command:
        if self._nft is None:
            self._nft = _transport()
        return self._nft

    def _generation(self) -> int | None:
        if self._gen is None:
            try:
                self._gen = _Generation()
            except OSError:
                return None
        return self._gen.read()

    def _run(self, cmds: list[dict[str, Any]], action: str, op: str) -> str:
        ok, out, err = self._t().run(document(cmds))
        if not ok:
            raise HostError(f"{action}: {op}: {err.strip() or 'nft failed'}")
        return out

    def _table_exists(self) -> bool:
        out = self._run([{"list": {"tables": {"family": FAMILY}}}], "read nftables",
                        "list tables")
        return any(item.get("table", {}).get("name") == TABLE
                   for item in json.loads(out or '{"nftables": []}')["nftables"])

    def _read(self) -> Listing | None:
        if not self._table_exists():
            return None
        out = self._run([{"list": {"table": {"family": FAMILY, "name": TABLE}}}],
                        "read nftables table 'inet envctl'", "list table")
        found = Listing(base={k: "missing" for k in base()})
        for item in json.loads(out)["nftables"]:
            c, r = item.get("chain"), item.get("rule")
            if c and f"chain {c['name']}" in found.base:
                found.base[f"chain {c['name']}"] = (
                    _describe_chain(c.get("type"), c.get("hook"), c.get("prio"),
                                    c.get("policy")) if "hook" in c else "not a base chain")
            if r:
                found.rows.append(Row(r["chain"], r["handle"], r.get("comment", ""),
                                      canonical(r.get("expr", []))))
        return found

    def listing(self, *, handles: bool = False) -> Listing | None:
        """The table's base chains and rules (chain, handle, comment, content); None when
        there is no table.

        Rules this process added itself have handle None unless `handles` asks for a fresh
        read (the kernel assigns them; only a delete needs them)."""
        gen = self._generation()
        if gen is not None and self._kept_gen == gen:
            kept = self._kept
            if not handles or all(r.handle is not None for r in (kept.rows if kept else ())):
                return _copy(kept)
        found = self._read()
        stable = gen is not None and self._generation() == gen  # nothing changed meanwhile
        self._kept, self._kept_gen = (found, gen) if stable else (None, None)
        return _copy(found)

    def _commit(self, cmds: list[dict[str, Any]], action: str, after: Listing | None) -> None:
        """Run one transaction; keep `after` as the table when the generation shows that this
        transaction, and nothing else, happened since the listing it was derived from."""
        before = self._kept_gen
        self._kept, self._kept_gen = None, None
        self._run(cmds, action, "transaction")
        if before is not None and self._generation() == (before + 1) & GEN_MASK:
            self._kept, self._kept_gen = after, (before + 1) & GEN_MASK

    content = staticmethod(content)
    base = staticmethod(base)

    @staticmethod
    def comments(listing: Listing, env: str) -> list[str]:
        """The comments of `env`'s rules in `listing`, in table order."""
        return listing.comments(env)

    def replace(self, env: str, rules: list[Rule], listing: Listing | None) -> None:
        """In one transaction: ensure the table and base chains (`add` is a no-op for those
        that exist), delete those of `env`'s rules (as found in `listing`, just read under
        the global lock) that differ from `rules`, add the ones of `rules` not there."""
        want = [(r, content(r)) for r in rules]
        drop, add = compare_rules(listing.rows if listing else [], env, want)
        if any(r.handle is None for r in drop):
            listing = self.listing(handles=True)
            drop, add = compare_rules(listing.rows if listing else [], env, want)
        if listing != self._kept:
            self._kept, self._kept_gen = None, None  # not derived from the kept listing
        cmds = table_commands()
        cmds += [delete_rule_command(r.chain, r.handle) for r in drop if r.handle is not None]
        cmds += [add_rule_command(r) for r in add]
        kept = [r for r in (listing.rows if listing else []) if r not in drop]
        after = Listing(base=base(), rows=kept + [Row(r.chain, None, r.comment, content(r))
                                                   for r in add])
        self._commit(cmds, f"apply nftables rules '{env}'", after)

    def remove(self, env: str) -> None:
        """Delete `env`'s rules, and the table when no other environment has rules in it;
        success when they (or the table) are already gone."""
        listing = self.listing(handles=True)
        if listing is None:
            return
        mine = [r for r in listing.rows if env_of_comment(r.comment) == env]
        others = [r for r in listing.rows if env_of_comment(r.comment) != env]
        if not others:
            cmds, after = [delete_table_command()], None
        elif mine:
            cmds = [delete_rule_command(r.chain, r.handle) for r in mine]
            after = Listing(base=dict(listing.base), rows=others)
        else:
            return
        self._commit(cmds, f"remove nftables rules '{env}'", after)


def _copy(listing: Listing | None) -> Listing | None:
    return None if listing is None else Listing(base=dict(listing.base), rows=list(listing.rows))
