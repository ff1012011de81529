"""envctl's own iptables chains (legacy xtables, through python-iptables) for hosts without nft.

Chains ENVCTL-PREROUTING / -OUTPUT / -POSTROUTING (nat) and ENVCTL-FORWARD (filter) hold every
environment's rules, each tagged with a comment `envctl:ENV …`; the built-in chains get one
jump each. Nothing else is read or changed: other chains are never flushed or deleted. When the
last environment's rules go, the jumps and the chains go too.

python-iptables drives libiptc, i.e. the *legacy* xtables tables: on a host whose `iptables`
is the nft-based one, these rules work in the kernel but `iptables -L` does not show them
(`iptables-legacy -L` does). That is why nftables is the default wherever nft exists.
"""

from __future__ import annotations

from typing import Any

from envctl.errors import HostError
from envctl.host.fwrules import Listing, Row, Rule, compare_rules
from envctl.spec.naming import env_of_comment

# envctl chain -> (table, built-in chain that jumps to it)
CHAINS = {
    "prerouting": ("nat", "PREROUTING"),
    "output": ("nat", "OUTPUT"),
    "postrouting": ("nat", "POSTROUTING"),
    "forward": ("filter", "FORWARD"),
}
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


class Iptables:
    """Reads and changes only envctl's chains and the jumps to them."""

    name = "iptables"

    def _tables(self) -> dict[str, Any]:
        iptc = _iptc()
        out = {}
        for name in ("nat", "filter"):
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
        iptc = _iptc()
        try:
            tables = self._tables()
            found = Listing(base=dict.fromkeys(self.base(), "missing"))
            any_chain = False
            for chain, (tname, builtin) in CHAINS.items():
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
        except (*_errors(), ValueError) as exc:
            raise HostError(f"apply iptables rules '{env}': {exc}") from exc

    def remove(self, env: str) -> None:
        """Delete `env`'s rules; with no rules left, the jumps and envctl's chains too."""
        if self.listing() is None:
            return  # already gone
        iptc = _iptc()
        try:
            tables = self._tables()
            self._delete_env_rules(tables, env)
            left = [c for c in CHAINS
                    if tables[CHAINS[c][0]].is_chain(chain_name(c))
                    and iptc.Chain(tables[CHAINS[c][0]], chain_name(c)).rules]
            if not left:
                for chain, (tname, builtin) in CHAINS.items():
                    self._drop_chain(tables[tname], chain, builtin)
            for t in tables.values():
                t.commit()
        except _errors() as exc:
            raise HostError(f"remove iptables rules '{env}': {exc}") from exc

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

    def _drop_chain(self, table: Any, chain: str, builtin: str) -> None:
        iptc = _iptc()
        name = chain_name(chain)
        parent = iptc.Chain(table, builtin)
        for r in list(parent.rules):
            if r.target.name == name:
                parent.delete_rule(r)
        if table.is_chain(name):
            table.delete_chain(name)

    def _delete_env_rules(self, tables: dict[str, Any], env: str) -> None:
        iptc = _iptc()
        for chain, (tname, _) in CHAINS.items():
            table = tables[tname]
            if not table.is_chain(chain_name(chain)):
                continue
            ch = iptc.Chain(table, chain_name(chain))
            for r in list(ch.rules):
                if env_of_comment(_comment(r)) == env:
                    ch.delete_rule(r)


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
    if rule.not_daddr:
        r.dst = "!" + rule.not_daddr
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
