"""envctl's own iptables chains (legacy xtables, through python-iptables) for hosts without nft.

Chains ENVCTL-PREROUTING / -OUTPUT / -POSTROUTING (nat), ENVCTL-FORWARD (filter) and
ENVCTL-RAW-PREROUTING (raw: the loopback guard, before conntrack) hold every environment's
rules, each tagged with a comment `envctl:ENV …`; the built-in chains get one jump each.
Nothing else is read or changed: other chains are never flushed or deleted. An environment's
rules go with it; the chains and jumps are shared by every environment and go with the last
one (`release_base`), and only those envctl made: a chain or an unconditional jump that was
there before, a chain that holds a rule envctl did not make or that something else still
jumps to, and every jump envctl did not add (an operator's conditional one) stay.

Every change holds the xtables lock (/run/xtables.lock, or $XTABLES_LOCKFILE) from its read to
its commit, as `iptables -w` does: libiptc replaces a whole table per commit, so an `iptables`
run between the two would otherwise be undone.

Reading never makes a table or loads a module: python-iptables' import runs `modprobe
ip_tables` and opening a table creates it in the namespace, so neither happens before
/proc/net/ip_tables_names shows that the table exists already (otherwise nothing of envctl's
can be in it).

python-iptables drives libiptc, i.e. the *legacy* xtables tables: on a host whose `iptables`
is the nft-based one, these rules work in the kernel but `iptables -L` does not show them
(`iptables-legacy -L` does). That is why nftables is the default wherever nft exists.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from envctl.errors import HostError
from envctl.host.fwrules import Listing, Row, Rule, compare_rules
from envctl.spec.naming import env_of_comment

XTABLES_LOCK = "/run/xtables.lock"
# How long a change waits for another program's hold on the xtables lock (iptables -w waits
# forever by default; envctl holds its own global lock meanwhile, so it gives up in time).
LOCK_WAIT = 60.0
TABLES_NAMES = Path("/proc/net/ip_tables_names")

# envctl chain -> (table, built-in chain that jumps to it)
CHAINS = {
    "prerouting": ("nat", "PREROUTING"),
    "output": ("nat", "OUTPUT"),
    "postrouting": ("nat", "POSTROUTING"),
    "forward": ("filter", "FORWARD"),
    "raw-prerouting": ("raw", "PREROUTING"),
}
TABLES = tuple(dict.fromkeys(table for table, _ in CHAINS.values()))
JUMP_COMMENT = "envctl: jump"


def chain_name(chain: str) -> str:
    return f"ENVCTL-{chain.upper()}"


def _iptc():  # noqa: ANN202 - imported lazily: loading libiptc costs start-up time
    try:
        import iptc
    except ImportError as exc:  # the optional extra is not installed
        raise HostError("use iptables: python-iptables is not installed "
                        "(pip install 'envctl[iptables]')") from exc
    return iptc


def _errors() -> tuple[type[Exception], ...]:
    iptc = _iptc()
    return (iptc.IPTCError, iptc.errors.XTablesError)


def existing_tables(path: Path = TABLES_NAMES) -> set[str]:
    """The legacy xtables tables that exist in this network namespace (none when ip_tables
    is not even loaded), read without making any."""
    try:
        return set(path.read_text().split())
    except OSError:
        return set()


@contextlib.contextmanager
def xtables_lock(*, wait: float = LOCK_WAIT) -> Iterator[None]:
    """Hold the xtables lock (flock on $XTABLES_LOCKFILE or /run/xtables.lock, as `iptables
    -w`), waiting up to `wait` seconds for another program to let go."""
    path = os.environ.get("XTABLES_LOCKFILE") or XTABLES_LOCK
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        raise HostError(f"lock iptables '{path}': open: {exc.strerror}") from exc
    try:
        deadline, said = time.monotonic() + wait, False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:  # EWOULDBLOCK: somebody holds it; anything else raises
                if not said:
                    sys.stderr.write(f"envctl: waiting for the xtables lock {path} (held by "
                                     "another iptables)\n")
                    sys.stderr.flush()
                    said = True
                if time.monotonic() >= deadline:
                    raise HostError(f"lock iptables '{path}': flock: still held by another "
                                    f"program after {wait:g} s") from None
                time.sleep(0.05)
        yield
    finally:
        os.close(fd)  # releases the lock


class Iptables:
    """Reads and changes only envctl's chains and the jumps to them."""

    name = "iptables"

    def __init__(self, *, tables_names: Path = TABLES_NAMES) -> None:
        self.tables_names = tables_names

    def _tables(self, *, create: bool = True) -> dict[str, Any]:
        """nat, filter and raw, freshly read; with `create` False only those that exist already
        (opening a table makes it)."""
        names = TABLES
        if not create:
            present = existing_tables(self.tables_names)
            names = tuple(n for n in names if n in present)
            if not names:
                return {}
        iptc = _iptc()
        out = {}
        for name in names:
            t = iptc.Table(name)
            t.autocommit = False
            t.refresh()
            out[name] = t
        return out

    @staticmethod
    def base() -> dict[str, str]:
        """Each chain envctl needs and the jump to it, as `Listing.base` describes them."""
        out = {}
        for chain, (_, builtin) in CHAINS.items():
            out[f"chain {chain_name(chain)}"] = "present"
            out[f"jump {builtin} -> {chain_name(chain)}"] = "present"
        return out

    def listing(self) -> Listing | None:
        """envctl's chains, the jumps to them, and every rule in them (chain, comment,
        content); None when none of the chains exists."""
        if not existing_tables(self.tables_names) & set(TABLES):
            return None  # no table, so none of envctl's chains: nothing opened, nothing made
        iptc = _iptc()
        try:
            tables = self._tables(create=False)
            found = Listing(base=dict.fromkeys(self.base(), "missing"))
            any_chain = False
            for chain, (tname, builtin) in CHAINS.items():
                if tname not in tables:
                    continue
                table, name = tables[tname], chain_name(chain)
                jump = _jump_state(iptc.Chain(table, builtin), name)
                found.base[f"jump {builtin} -> {name}"] = jump
                if not table.is_chain(name):
                    continue
                any_chain = True
                found.base[f"chain {name}"] = "present"
                for rule in iptc.Chain(table, name).rules:
                    found.rows.append(Row(chain, None, _comment(rule), _content(rule)))
            return found if any_chain else None
        except _errors() as exc:
            raise HostError(f"read iptables chains 'ENVCTL-*': list: {exc}") from exc

    @staticmethod
    def comments(listing: Listing, env: str) -> list[str]:
        return listing.comments(env)

    @staticmethod
    def content(rule: Rule) -> tuple[str, ...]:
        """What `rule` lists back as, in `_content` form."""
        try:
            return _content(_rule(rule))
        except _errors() as exc:
            raise HostError(f"iptables rule '{rule.comment}': {exc}") from exc

    def replace(self, env: str, rules: list[Rule], listing: Listing | None) -> None:
        """Ensure the chains and unconditional jumps, delete those of `env`'s rules that
        differ from `rules`, append the ones of `rules` not there. Only a table that changed
        is committed, each once (libiptc replaces a whole table per commit)."""
        iptc = _iptc()
        try:
            with xtables_lock():
                self._replace(iptc, env, rules)
        except (*_errors(), ValueError) as exc:
            raise HostError(f"apply iptables rules '{env}': {exc}") from exc

    def _replace(self, iptc: Any, env: str, rules: list[Rule]) -> None:
        """Under the xtables lock, from the read to the commit."""
        tables = self._tables()
        changed: set[str] = set()
        for chain, (tname, builtin) in CHAINS.items():
            if self._ensure_chain(tables[tname], chain, builtin):
                changed.add(tname)
        rows = []
        for chain, (tname, _) in CHAINS.items():
            for r in iptc.Chain(tables[tname], chain_name(chain)).rules:
                rows.append(Row(chain, None, _comment(r), _content(r)))
        drop, add = compare_rules(rows, env, [(r, _content(_rule(r))) for r in rules])
        for row in drop:
            tname = CHAINS[row.chain][0]
            ch = iptc.Chain(tables[tname], chain_name(row.chain))
            ch.delete_rule(next(r for r in ch.rules if (_comment(r), _content(r))
                                == (row.comment, row.content)))
            changed.add(tname)
        for rule in add:
            tname = CHAINS[rule.chain][0]
            iptc.Chain(tables[tname], chain_name(rule.chain)).append_rule(_rule(rule))
            changed.add(tname)
        for tname in sorted(changed):
            tables[tname].commit()

    def remove(self, env: str) -> None:
        """Delete `env`'s rules, and nothing else (the chains and jumps are the shared
        `release_base`'s); success when they are already gone."""
        if self.listing() is None:
            return  # already gone
        try:
            with xtables_lock():
                tables = self._tables(create=False)
                for tname in self._delete_env_rules(tables, env):
                    tables[tname].commit()
        except _errors() as exc:
            raise HostError(f"remove iptables rules '{env}': {exc}") from exc

    # ------------------------------------------------------------------ chains and jumps

    def base_memo(self) -> dict[str, Any]:
        """What existed before envctl: which of its chains, and which unconditional jumps."""
        listing = self.listing()
        base = listing.base if listing is not None else {}
        return {"chains": sorted(k.split()[1] for k, v in base.items()
                                 if k.startswith("chain ") and v == "present"),
                "jumps": sorted(k.split(" ", 1)[1] for k, v in base.items()
                                if k.startswith("jump ") and v == "present")}

    def ensure_base(self) -> None:
        """Make envctl's chains and the unconditional jumps to them where missing."""
        try:
            with xtables_lock():
                tables = self._tables()
                changed = {tname for chain, (tname, builtin) in CHAINS.items()
                           if self._ensure_chain(tables[tname], chain, builtin)}
                for tname in sorted(changed):
                    tables[tname].commit()
        except _errors() as exc:
            raise HostError(f"create iptables chains 'ENVCTL-*': {exc}") from exc

    def release_base(self, memo: dict[str, Any]) -> None:
        """The last holder's removal: the jumps envctl added, and the chains it made that hold
        no rule of anybody else's and that nothing else jumps to."""
        if self.listing() is None:
            return  # already gone
        try:
            with xtables_lock():
                tables = self._tables(create=False)
                changed = set()
                for chain, (tname, builtin) in CHAINS.items():
                    if tname in tables and self._release(tables[tname], chain, builtin, memo):
                        changed.add(tname)
                for tname in sorted(changed):
                    tables[tname].commit()
        except _errors() as exc:
            raise HostError(f"remove iptables chains 'ENVCTL-*': {exc}") from exc

    def release_note(self, memo: dict[str, Any]) -> str:
        """What `release_base` will leave, for `down` and `status`; "" when everything goes."""
        if not existing_tables(self.tables_names) & set(TABLES):
            return ""
        try:
            tables = self._tables(create=False)
            kept = []
            for chain, (tname, builtin) in CHAINS.items():
                if tname in tables:
                    why = self._kept_because(tables[tname], chain, builtin, memo)
                    if why:
                        kept.append(f"chain {chain_name(chain)} {why}")
        except _errors() as exc:
            raise HostError(f"read iptables chains 'ENVCTL-*': list: {exc}") from exc
        return "kept: " + "; ".join(kept) if kept else ""

    # ------------------------------------------------------------------ helpers

    def _ensure_chain(self, table: Any, chain: str, builtin: str) -> bool:
        """Make the chain and the unconditional jump to it where missing; True if it did."""
        iptc = _iptc()
        name = chain_name(chain)
        changed = False
        if not table.is_chain(name):
            table.create_chain(name)
            changed = True
        parent = iptc.Chain(table, builtin)
        if _jump_state(parent, name) != "present":
            jump = iptc.Rule()
            jump.target = iptc.Target(jump, name)
            _add_comment(jump, JUMP_COMMENT)
            parent.insert_rule(jump)
            changed = True
        return changed

    @staticmethod
    def _is_our_jump(parent: str, rule: Any, chain: str, builtin: str,
                     memo: dict[str, Any]) -> bool:
        """Whether `rule` of chain `parent` is a jump to `chain` envctl added: in `builtin`,
        unconditional, with envctl's comment, and only when no unconditional jump was there
        before envctl (then that one serves, and envctl added none)."""
        name = chain_name(chain)
        return (parent == builtin and f"{builtin} -> {name}" not in memo.get("jumps", [])
                and bool(rule.target) and rule.target.name == name
                and _content(rule) == (f"-j {name}",) and _comment(rule) == JUMP_COMMENT)

    def _our_jumps(self, table: Any, chain: str, builtin: str,
                   memo: dict[str, Any]) -> list[Any]:
        iptc = _iptc()
        return [r for r in iptc.Chain(table, builtin).rules
                if self._is_our_jump(builtin, r, chain, builtin, memo)]

    def _kept_because(self, table: Any, chain: str, builtin: str,
                      memo: dict[str, Any]) -> str:
        """Why chain `chain` stays at the last holder's removal ("" when it goes)."""
        iptc = _iptc()
        name = chain_name(chain)
        if not table.is_chain(name):
            return ""
        if name in memo.get("chains", []):
            return "existed before envctl"
        theirs = [r for r in iptc.Chain(table, name).rules if env_of_comment(_comment(r)) is None]
        if theirs:
            return f"holds {len(theirs)} rule(s) envctl did not make"
        refs = {c.name for c in table.chains for r in c.rules
                if r.target and r.target.name == name
                and not self._is_our_jump(c.name, r, chain, builtin, memo)}
        if refs:
            return f"is still jumped to from {', '.join(sorted(refs))}"
        return ""

    def _release(self, table: Any, chain: str, builtin: str, memo: dict[str, Any]) -> bool:
        """Delete what envctl made of `chain` and its jump; True if anything changed."""
        iptc = _iptc()
        name = chain_name(chain)
        parent = iptc.Chain(table, builtin)
        changed = False
        for r in self._our_jumps(table, chain, builtin, memo):
            parent.delete_rule(r)
            changed = True
        if table.is_chain(name) and not self._kept_because(table, chain, builtin, memo):
            ch = iptc.Chain(table, name)
            for r in list(ch.rules):  # all tagged (checked above): envctl's own
                ch.delete_rule(r)
            table.delete_chain(name)
            changed = True
        return changed

    def _delete_env_rules(self, tables: dict[str, Any], env: str) -> set[str]:
        """Delete `env`'s rules; the names of the tables that changed."""
        iptc = _iptc()
        changed = set()
        for chain, (tname, _) in CHAINS.items():
            table = tables.get(tname)
            if table is None or not table.is_chain(chain_name(chain)):
                continue
            ch = iptc.Chain(table, chain_name(chain))
            for r in list(ch.rules):
                if env_of_comment(_comment(r)) == env:
                    ch.delete_rule(r)
                    changed.add(tname)
        return changed


def _comment(rule: Any) -> str:
    for m in rule.matches:
        if m.name == "comment":
            return m.comment or ""
    return ""


ANY = "0.0.0.0/0.0.0.0"


def _content(rule: Any) -> tuple[str, ...]:
    """A rule's matches and target, one part each, roughly as iptables-save writes them (the
    comment left out: it is compared on its own). python-iptables reads both a rule built
    here and one read back from the kernel through the same xtables save functions, so the
    two are equal until someone edits the rule."""
    parts = []
    for flag, value in (("-s", rule.src), ("-d", rule.dst), ("-i", rule.in_interface),
                        ("-o", rule.out_interface), ("-p", rule.protocol)):
        if value and value not in (ANY, "!" + ANY) and not (flag == "-p" and value in (
                "ip", "all", "0")):
            parts.append(f"{flag} {value}")
    for m in rule.matches:
        if m.name != "comment":
            parts.append(f"-m {m.name}" + _params(m.get_all_parameters()))
    target = rule.target.name if rule.target else ""
    parts.append(f"-j {target}" + (_params(rule.target.get_all_parameters()) if target else ""))
    return tuple(parts)


def _params(params: dict[str, list[str]]) -> str:
    return "".join(f" --{k} {' '.join(v)}".rstrip() for k, v in sorted(params.items()))


def _jump_state(parent: Any, name: str) -> str:
    """`present` when built-in chain `parent` jumps to `name` unconditionally; `conditional`
    when every jump to it has a match; `missing` when none does."""
    jumps = [r for r in parent.rules if r.target and r.target.name == name]
    if any(_content(r) == (f"-j {name}",) for r in jumps):
        return "present"
    return "conditional" if jumps else "missing"


def _add_comment(rule: Any, text: str) -> None:
    m = rule.create_match("comment")
    m.comment = text


def _rule(rule: Rule) -> Any:
    """The python-iptables rule for `rule`: the same matches, in the same order, as nft's."""
    iptc = _iptc()
    r = iptc.Rule()
    if rule.iif:
        r.in_interface = rule.iif
    if rule.oif:
        r.out_interface = rule.oif
    if rule.not_oif:
        r.out_interface = "!" + rule.not_oif
    if rule.saddr:
        r.src = rule.saddr
    if rule.daddr:
        r.dst = rule.daddr
    if rule.local_daddr:
        m = r.create_match("addrtype")
        m.dst_type = "LOCAL"
    if rule.proto:
        r.protocol = rule.proto
        if rule.dport is not None:
            m = r.create_match(rule.proto)
            m.dport = str(rule.dport)
    if rule.not_dnat:
        m = r.create_match("conntrack")
        m.ctstate = "!DNAT"  # the DNAT virtual state is the status bit nft calls `ct status dnat`
    if rule.dnat:
        m = r.create_match("conntrack")
        m.ctstate = "DNAT"
    _add_comment(r, rule.comment)
    if rule.action == "masquerade":
        r.target = iptc.Target(r, "MASQUERADE")
    elif rule.action == "dnat":
        t = iptc.Target(r, "DNAT")
        t.to_destination = f"{rule.to_addr}:{rule.to_port}"
        r.target = t
    elif rule.action == "drop":
        r.target = iptc.Target(r, "DROP")
    else:
        raise ValueError(f"unknown firewall action {rule.action!r}")
    return r
