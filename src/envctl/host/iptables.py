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
from envctl.host.firewall import Rule
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

    def listing(self) -> list[tuple[str, int, str]] | None:
        """(chain, position, comment) of every rule in envctl's chains; None without chains."""
        try:
            tables = self._tables()
            rules = []
            found = False
            for chain, (tname, _) in CHAINS.items():
                table = tables[tname]
                if not table.is_chain(chain_name(chain)):
                    continue
                found = True
                for pos, rule in enumerate(_iptc().Chain(table, chain_name(chain)).rules):
                    rules.append((chain, pos, _comment(rule)))
            return rules if found else None
        except _errors() as exc:
            raise HostError(f"read iptables chains 'ENVCTL-*': list: {exc}") from exc

    @staticmethod
    def comments(listing: list[tuple[str, int, str]], env: str) -> list[str]:
        return [c for _, _, c in listing if env_of_comment(c) == env]

    def replace(self, env: str, rules: list[Rule],
                listing: list[tuple[str, int, str]] | None) -> None:
        """Ensure the chains and jumps, delete `env`'s rules, append `rules`; each table is
        committed once (libiptc replaces a whole table per commit)."""
        iptc = _iptc()
        try:
            tables = self._tables()
            for chain, (tname, builtin) in CHAINS.items():
                self._ensure_chain(tables[tname], chain, builtin)
            self._delete_env_rules(tables, env)
            for rule in rules:
                tname = CHAINS[rule.chain][0]
                iptc.Chain(tables[tname], chain_name(rule.chain)).append_rule(_rule(rule))
            for t in tables.values():
                t.commit()
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

    def _ensure_chain(self, table: Any, chain: str, builtin: str) -> None:
        iptc = _iptc()
        name = chain_name(chain)
        if not table.is_chain(name):
            table.create_chain(name)
        parent = iptc.Chain(table, builtin)
        if not any(r.target.name == name for r in parent.rules):
            jump = iptc.Rule()
            jump.target = iptc.Target(jump, name)
            _add_comment(jump, JUMP_COMMENT)
            parent.insert_rule(jump)

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
