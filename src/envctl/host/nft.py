"""envctl's own nftables tables: `inet envctl` (NAT, port forwards, isolation, the loopback
guard) and `bridge envctl` (anti-spoofing on the environments' bridge ports), each changed in
atomic JSON transactions.

Every change is one JSON document run as one transaction, exactly what `nft -j -f -` runs: by
default through libnftables (the library the `nft` command is a thin front end of, loaded with
ctypes, so a run of 32 environments does not pay 32 x 4 process starts), or through the `nft`
command itself with `ENVCTL_NFT=cli` or when the library cannot be loaded. Only envctl's two
tables are ever read or written; other tables are never listed, flushed or deleted.

Ownership: an environment's rules are tagged (`envctl:ENV …`) and go with it. The table and
its base chains are shared by every environment and owned apart from the rules (see
`base_memo` / `release_plan`): they go with the last environment, and only what envctl made
and holds nothing of anybody else's (another chain, a set, an untagged rule).

Reading never loads a module: before any netlink socket of the netfilter family is opened
(which makes the kernel load nfnetlink and nf_tables), `nf_tables_present` checks, from
/sys/module, /proc/modules and modules.builtin, that nf_tables is there already; when it is
not, nothing of envctl's can exist and every read answers "absent".

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
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from envctl.errors import HostError
from envctl.host.fwrules import Listing, PortRule, Row, Rule, compare_rules
from envctl.spec.naming import env_of_comment

FAMILY, TABLE = "inet", "envctl"
# name -> (type, hook, priority): nat at dstnat (-100) / srcnat (100), filter at 0, and the
# loopback guard at raw (-300, before conntrack and NAT), as nft's named priorities.
BASE_CHAINS = {
    "prerouting": ("nat", "prerouting", -100),
    "output": ("nat", "output", -100),
    "postrouting": ("nat", "postrouting", 100),
    "forward": ("filter", "forward", 0),
    "raw-prerouting": ("filter", "prerouting", -300),
}
# The bridge family's filter priority (-200): frames from a port are judged before the bridge
# learns their source MAC or forwards them, whether to another port or to the host.
BRIDGE_FAMILY = "bridge"
BRIDGE_CHAINS = {"prerouting": ("filter", "prerouting", -200)}
NFT_CTX_OUTPUT_JSON = 1 << 4
# NFT_MSG_GETGEN of the nftables netfilter subsystem; its answer carries NFTA_GEN_ID (be32).
NETLINK_NETFILTER, NFNL_SUBSYS_NFTABLES, NFT_MSG_GETGEN, NFTA_GEN_ID = 12, 10, 16, 1
GEN_MASK = 0xFFFFFFFF
# What a table listing holds besides the table, its chains and rules: all somebody's objects.
_NOT_OBJECTS = ("metainfo", "table", "chain", "rule")

Chains = dict[str, tuple[str, str, int]]


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
    if rule.local_daddr:
        e.append(_match({"fib": {"result": "type", "flags": ["daddr"]}}, "local"))
    if rule.proto:
        e.append(_match(_meta("l4proto"), rule.proto))
    if rule.dport is not None:
        e.append(_match({"payload": {"protocol": "th", "field": "dport"}}, rule.dport))
    if rule.not_dnat:
        # A flag test (`ct status ! dnat`: status & dnat == 0), never `!=`, which compares
        # the whole status word and so matches every packet.
        e.append(_match({"ct": {"key": "status"}}, "dnat", "!"))
    if rule.dnat:
        e.append(_match({"ct": {"key": "status"}}, "dnat", "in"))
    if rule.action == "masquerade":
        e.append({"masquerade": None})
    elif rule.action == "dnat":
        e.append({"dnat": {"family": "ip", "addr": rule.to_addr, "port": rule.to_port}})
    elif rule.action == "drop":
        e.append({"drop": None})
    else:
        raise ValueError(f"unknown firewall action {rule.action!r}")
    return e


def port_rule_exprs(rule: PortRule) -> list[dict[str, Any]]:
    """The nft JSON (bridge family) of an anti-spoofing rule: frames in from the port whose
    field is not the environment's value are counted and dropped. `ip saddr` and `arp …`
    imply their ether type; nft adds (and, listing, folds away) that dependency itself."""
    proto, _, fld = rule.field.partition(" ")
    value: Any = {"set": rule.value.split(",")} if rule.field == "ether type" else rule.value
    return [_match(_meta("iifname"), rule.port),
            _match({"payload": {"protocol": proto, "field": fld}}, value, "!="),
            {"counter": None}, {"drop": None}]


def canonical(exprs: list[dict[str, Any]]) -> tuple[str, ...]:
    """A rule's expressions in one form for both what envctl generates and what libnftables
    lists back, one compact JSON string per expression. nft 1.0.6 lists `meta l4proto P`
    followed by `th dport N` as the single `P dport N` (it folds the protocol dependency),
    and an address prefix of /32 as the bare address; both sides are brought to that form.
    A counter is compared without its numbers, which only the kernel changes. Everything else
    is compared as it is, so a hand edit of any match or statement shows."""
    out: list[dict[str, Any]] = []
    for e in exprs:
        if isinstance(e, dict) and "counter" in e:
            e = {"counter": None}
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


def base(chains: Chains = BASE_CHAINS) -> dict[str, str]:
    """Each base chain envctl needs, as `Listing.base` describes a found one."""
    return {f"chain {name}": _describe_chain(ctype, hook, prio, "accept")
            for name, (ctype, hook, prio) in chains.items()}


def _describe_chain(ctype: object, hook: object, prio: object, policy: object) -> str:
    return f"type {ctype} hook {hook} priority {prio} policy {policy}"


def _describe(chain: dict[str, Any]) -> str:
    if "hook" not in chain:
        return "not a base chain"
    return _describe_chain(chain.get("type"), chain.get("hook"), chain.get("prio"),
                           chain.get("policy"))


def table_commands(family: str = FAMILY, table: str = TABLE,
                   chains: Chains = BASE_CHAINS) -> list[dict[str, Any]]:
    """`add` the table and its base chains: a no-op for the ones that exist."""
    cmds: list[dict[str, Any]] = [{"add": {"table": {"family": family, "name": table}}}]
    for name, (ctype, hook, prio) in chains.items():
        cmds.append({"add": {"chain": {"family": family, "table": table, "name": name,
                                       "type": ctype, "hook": hook, "prio": prio,
                                       "policy": "accept"}}})
    return cmds


def add_rule_command(rule: Rule | PortRule, *, family: str = FAMILY, table: str = TABLE,
                     exprs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {"add": {"rule": {"family": family, "table": table, "chain": rule.chain,
                             "comment": rule.comment,
                             "expr": rule_exprs(rule) if exprs is None else exprs}}}


def delete_rule_command(chain: str, handle: int, *, family: str = FAMILY,
                        table: str = TABLE) -> dict[str, Any]:
    return {"delete": {"rule": {"family": family, "table": table, "chain": chain,
                                "handle": handle}}}


def delete_chain_command(chain: str, *, family: str = FAMILY,
                         table: str = TABLE) -> dict[str, Any]:
    return {"delete": {"chain": {"family": family, "table": table, "name": chain}}}


def delete_table_command(family: str = FAMILY, table: str = TABLE) -> dict[str, Any]:
    return {"delete": {"table": {"family": family, "name": table}}}


def document(cmds: list[dict[str, Any]]) -> str:
    return json.dumps({"nftables": cmds})


# ---------------------------------------------------------------- the table's ownership (pure)


@dataclass
class Inventory:
    """Everything one table holds: each chain (described as `Listing.base` does, or "not a base
    chain"), each chain's rules as (handle, comment), and every other object in it ("set
    blocked", "map m", "flowtable f", …)."""

    chains: dict[str, str] = field(default_factory=dict)
    rules: dict[str, list[tuple[int, str]]] = field(default_factory=dict)
    objects: list[str] = field(default_factory=list)

    @classmethod
    def from_listing(cls, items: list[dict[str, Any]]) -> Inventory:
        inv = cls()
        for item in items:
            for what, body in item.items():
                if what == "chain":
                    inv.chains[body["name"]] = _describe(body)
                elif what == "rule":
                    inv.rules.setdefault(body["chain"], []).append(
                        (body["handle"], body.get("comment", "")))
                elif what not in _NOT_OBJECTS:
                    inv.objects.append(f"{what} {body.get('name', '')}".strip())
        return inv

    def foreign_rules(self, chain: str) -> int:
        """How many rules of `chain` carry no environment's tag: somebody else's."""
        return sum(1 for _, c in self.rules.get(chain, []) if env_of_comment(c) is None)


@dataclass
class Release:
    """What the last holder's removal does: delete the whole table, or only `chains` (with the
    tagged rules left in them); `kept` says what stays and why."""

    table: bool
    chains: list[str]
    kept: list[str]


def base_memo(inv: Inventory | None, chains: Chains) -> dict[str, Any]:
    """What existed before envctl: the table, and which of envctl's base chains (as found)."""
    return {"table": inv is not None,
            "chains": {} if inv is None else {c: inv.chains[c] for c in chains
                                              if c in inv.chains}}


def refusal(memo: dict[str, Any], chains: Chains, where: str) -> str:
    """Why envctl will not use the table as found ("" when it will): a chain of one of its base
    chains' names is there in another shape, which envctl would have to change."""
    want = base(chains)
    for name, found in sorted(memo.get("chains", {}).items()):
        if found != want[f"chain {name}"]:
            return (f"chain {name} in table {where} exists as '{found}', not as the base chain "
                    f"envctl needs ('{want[f'chain {name}']}'); envctl does not change what it "
                    "did not make")
    return ""


def release_plan(memo: dict[str, Any], inv: Inventory, chains: Chains, where: str) -> Release:
    """What envctl may delete of the table as found now (`inv`) given what existed before it
    (`memo`): the base chains it made, unless they hold a rule that is not envctl's; the table
    too when envctl made it and nothing else is left in it."""
    existed = memo.get("chains", {})
    kept, drop = [], []
    if memo.get("table"):
        kept.append(f"table {where} existed before envctl")
    for name in chains:
        if name not in inv.chains:
            continue
        if name in existed:
            kept.append(f"chain {name} existed before envctl")
        elif inv.foreign_rules(name):
            kept.append(f"chain {name} holds {inv.foreign_rules(name)} rule(s) envctl did "
                        "not make")
        else:
            drop.append(name)
    others = [f"chain {c}" for c in inv.chains if c not in chains] + inv.objects
    if not memo.get("table") and others:
        kept.insert(0, f"table {where} holds {', '.join(others)}, not envctl's")
    whole = not memo.get("table") and not others and len(drop) == len(inv.chains)
    return Release(table=whole, chains=[] if whole else drop, kept=[] if whole else kept)


# ---------------------------------------------------------------- modules


def nf_tables_present(*, proc: Path = Path("/proc"), sys: Path = Path("/sys"),
                      modules: Path | None = None) -> bool:
    """Whether nf_tables is in the kernel already (loaded, or built in), read from files only:
    opening a NETLINK_NETFILTER socket or asking nftables anything would make the kernel load
    it. A kernel without loadable modules (no /proc/modules) loads nothing, so asking is
    harmless there."""
    if (sys / "module" / "nf_tables").is_dir():
        return True  # loaded, or built in with parameters
    try:
        loaded = (proc / "modules").read_text()
    except FileNotFoundError:
        return True  # no module support: nothing can be loaded by asking
    except OSError:
        return False
    if any(line.split(" ", 1)[0] == "nf_tables" for line in loaded.splitlines()):
        return True
    tree = modules or Path("/lib/modules") / os.uname().release
    try:
        builtin = (tree / "modules.builtin").read_text()
    except OSError:
        return False
    return any(line.rsplit("/", 1)[-1] == "nf_tables.ko" for line in builtin.splitlines())


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
        self._nl = self._socket()

    @staticmethod
    def _socket():  # noqa: ANN205 - netlink.Requests, imported lazily
        from envctl.host.netlink import Requests

        return Requests(socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, NETLINK_NETFILTER))

    def read(self) -> int | None:
        """The generation, or None when it cannot be read (then nothing kept is used)."""
        from envctl.host.netlink import attrs

        try:
            if self._nl.broken:  # a reply that was not read whole: the socket is out of step
                self._nl.close()
                self._nl = self._socket()
            bodies = self._nl.request((NFNL_SUBSYS_NFTABLES << 8) | NFT_MSG_GETGEN,
                                      struct.pack("=BBH", 0, 0, 0))
            gen = attrs(bodies[0], 4).get(NFTA_GEN_ID) if bodies else None
        except OSError:  # no answer, or a malformed one (EPROTO): nothing kept is trusted
            return None
        return struct.unpack(">I", gen)[0] if gen is not None and len(gen) == 4 else None


class NftTable:
    """Reads and changes only one table of envctl's (`family` `table` with base `chains`)."""

    name = "nftables"

    def __init__(self, family: str, table: str, chains: Chains,
                 exprs: Callable[[Any], list[dict[str, Any]]], *,
                 present: Callable[[], bool] = nf_tables_present) -> None:
        self.family, self.table, self.chains = family, table, chains
        self.where = f"{family} {table}"
        self._exprs = exprs
        self._present = present
        self._seen_present = False
        self._nft: _Library | _Command | None = None
        self._gen: _Generation | None = None
        # The table as last read or written by this process, and the generation it is valid at.
        self._kept: Listing | None = None
        self._kept_gen: int | None = None
        # envctl's other tables in this namespace (see link): a transaction of this table's
        # leaves their kept listings valid.
        self.peers: list[NftTable] = []

    def link(self, other: NftTable) -> None:
        """Tell both tables of each other's transactions (one ruleset generation counts all)."""
        self.peers.append(other)
        other.peers.append(self)

    @property
    def transport(self) -> str:
        return "libnftables" if isinstance(self._t(), _Library) else "nft -j -f -"

    def _t(self) -> _Library | _Command:
        if self._nft is None:
            self._nft = _transport()
        return self._nft

    def _readable(self) -> bool:
        """Whether reading may ask the kernel: only once nf_tables is there (see the module
        docstring); until then nothing of envctl's exists."""
        if not self._seen_present:
            self._seen_present = self._present()
        return self._seen_present

    def _generation(self) -> int | None:
        if not self._readable():
            return None
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

    def _list(self) -> list[dict[str, Any]] | None:
        """Everything in the table, as nft lists it; None when there is no table."""
        if not self._readable():
            return None
        out = self._run([{"list": {"tables": {"family": self.family}}}], "read nftables",
                        "list tables")
        if not any(item.get("table", {}).get("name") == self.table
                   for item in json.loads(out or '{"nftables": []}')["nftables"]):
            return None
        out = self._run([{"list": {"table": {"family": self.family, "name": self.table}}}],
                        f"read nftables table '{self.where}'", "list table")
        return json.loads(out)["nftables"]

    def _read(self) -> Listing | None:
        items = self._list()
        if items is None:
            return None
        found = Listing(base={k: "missing" for k in self.base()})
        for item in items:
            c, r = item.get("chain"), item.get("rule")
            if c and f"chain {c['name']}" in found.base:
                found.base[f"chain {c['name']}"] = _describe(c)
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
        new = (before + 1) & GEN_MASK if before is not None else None
        if new is not None and self._generation() == new:
            self._kept, self._kept_gen = after, new
            for other in self.peers:
                if other._kept_gen == before:  # read at `before`: only this one came since
                    other._kept_gen = new

    def _forget(self) -> None:
        self._kept, self._kept_gen = None, None

    # ------------------------------------------------------------------ rules

    def base(self) -> dict[str, str]:
        return base(self.chains)

    def content(self, rule: Any) -> tuple[str, ...]:
        """What `rule` lists back as, in `canonical` form."""
        return canonical(self._exprs(rule))

    @staticmethod
    def comments(listing: Listing, env: str) -> list[str]:
        """The comments of `env`'s rules in `listing`, in table order."""
        return listing.comments(env)

    def replace(self, env: str, rules: list[Any], listing: Listing | None) -> None:
        """In one transaction: ensure the table and base chains (`add` is a no-op for those
        that exist), delete those of `env`'s rules (as found in `listing`, just read under
        the global lock) that differ from `rules`, add the ones of `rules` not there."""
        want = [(r, self.content(r)) for r in rules]
        drop, add = compare_rules(listing.rows if listing else [], env, want)
        if any(r.handle is None for r in drop):
            listing = self.listing(handles=True)
            drop, add = compare_rules(listing.rows if listing else [], env, want)
        if listing != self._kept:
            self._forget()  # not derived from the kept listing
        where = {"family": self.family, "table": self.table}
        cmds = table_commands(self.family, self.table, self.chains)
        cmds += [delete_rule_command(r.chain, r.handle, **where) for r in drop
                 if r.handle is not None]
        cmds += [add_rule_command(r, exprs=self._exprs(r), **where) for r in add]
        kept = [r for r in (listing.rows if listing else []) if r not in drop]
        after = Listing(base=self.base(), rows=kept + [Row(r.chain, None, r.comment,
                                                           self.content(r)) for r in add])
        self._commit(cmds, f"apply nftables rules '{env}' in table '{self.where}'", after)

    def remove(self, env: str) -> None:
        """Delete `env`'s rules, and nothing else (the table and its base chains are the
        shared `release_base`'s); success when they (or the table) are already gone."""
        listing = self.listing(handles=True)
        if listing is None:
            return
        mine = [r for r in listing.rows if env_of_comment(r.comment) == env]
        if not mine:
            return
        cmds = [delete_rule_command(r.chain, r.handle, family=self.family, table=self.table)
                for r in mine]
        after = Listing(base=dict(listing.base), rows=[r for r in listing.rows if r not in mine])
        self._commit(cmds, f"remove nftables rules '{env}' from table '{self.where}'", after)

    # ------------------------------------------------------------------ the table itself

    def inventory(self) -> Inventory | None:
        """Everything the table holds now; None when there is no table."""
        items = self._list()
        return None if items is None else Inventory.from_listing(items)

    def base_memo(self) -> dict[str, Any]:
        return base_memo(self.inventory(), self.chains)

    def ensure_base(self) -> None:
        """Make the table and the base chains where missing; nothing else is touched."""
        self._forget()
        self._run(table_commands(self.family, self.table, self.chains),
                  f"create nftables table '{self.where}'", "transaction")

    def release_base(self, memo: dict[str, Any]) -> None:
        """The last holder's removal: delete what envctl made of the table (`release_plan`)
        in one transaction; success when it is already gone."""
        inv = self.inventory()
        if inv is None:
            return
        plan = release_plan(memo, inv, self.chains, self.where)
        where = {"family": self.family, "table": self.table}
        if plan.table:
            cmds = [delete_table_command(self.family, self.table)]
        else:
            # A chain goes only empty: its (tagged) rules by handle first, in the same
            # transaction, so a rule somebody adds meanwhile makes it fail instead of going.
            cmds = [delete_rule_command(c, h, **where) for c in plan.chains
                    for h, _ in inv.rules.get(c, [])]
            cmds += [delete_chain_command(c, **where) for c in plan.chains]
        if cmds:
            self._forget()
            self._run(cmds, f"remove nftables table '{self.where}'", "transaction")

    def release_note(self, memo: dict[str, Any]) -> str:
        """What `release_base` will do, for `down` and `status`; "" when everything goes."""
        inv = self.inventory()
        if inv is None:
            return ""
        plan = release_plan(memo, inv, self.chains, self.where)
        return "kept: " + "; ".join(plan.kept) if plan.kept else ""


class Nftables(NftTable):
    """Table `inet envctl`: every environment's NAT, port-forward and isolation rules."""

    name = "nftables"

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(FAMILY, TABLE, BASE_CHAINS, rule_exprs, **kwargs)


class BridgeNftables(NftTable):
    """Table `bridge envctl`: every environment's anti-spoofing rules on its bridge port."""

    name = "nftables-bridge"

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(BRIDGE_FAMILY, TABLE, BRIDGE_CHAINS, port_rule_exprs, **kwargs)


def _copy(listing: Listing | None) -> Listing | None:
    return None if listing is None else Listing(base=dict(listing.base), rows=list(listing.rows))
