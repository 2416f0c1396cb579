"""Replication policies: how a source partition is named on the target, and back.

As in MirrorMaker 2, the default policy prefixes the source cluster's alias ("A" + "." + "orders"
-> "A.orders"), so partitions of several source clusters never collide on one target and a
mirrored partition says where it came from. `upstream` inverts that for names the policy made.
Names are partition names (`partition/<name>` KV keys), so they must be non-empty and hold no
'/' (the key separator) or NUL; an alias must also not hold the separator, or `upstream` could not
split a name at the right place. Names holding the separator that were not made by the policy
("orders.v2") are ambiguous to `upstream`, exactly as in MM2; `source_chain` and `is_cycle` only
read prefixes, so they too assume names made by the policy.

The identity policy keeps names ("orders" -> "orders"): for a one-way migration into an empty
cluster, where consumers should find the same names. It cannot tell a mirrored name from a local
one, so `upstream` answers only for the source alias it was given.
"""
from __future__ import annotations

from typing import Protocol

from .errors import MirrorNameError


def check_name(what: str, name, example: str = "orders-0") -> str:
    """`name` if it is a usable partition name, group name, flow id or alias: a non-empty str
    without '/' or NUL; else MirrorNameError naming it."""
    if not isinstance(name, str) or not name or "/" in name or "\x00" in name:
        raise MirrorNameError(
            f"{what} must be a non-empty string without '/' or NUL, got {name!r} ({type(name).__name__}); "
            f"pass a plain name such as {example!r}")
    return name


class ReplicationPolicy(Protocol):
    """Names of mirrored partitions (see the module docstring)."""

    def target_name(self, source_alias: str, name: str) -> str:
        """The target partition that mirrors source partition `name` of cluster `source_alias`."""

    def upstream(self, target_name: str) -> tuple[str, str] | None:
        """(source alias, source name) of a partition this policy named; None for a local one."""


class DefaultReplicationPolicy:
    """`<source-alias><separator><name>`, MirrorMaker 2's DefaultReplicationPolicy."""

    def __init__(self, separator: str = ".") -> None:
        check_name("separator", separator, ".")
        self.separator = separator

    def _check_alias(self, alias) -> str:
        check_name("source alias", alias, "A")
        if self.separator in alias:
            raise MirrorNameError(
                f"source alias {alias!r} contains the separator {self.separator!r}, so mirrored names could not be "
                f"split back into alias and name; choose an alias without {self.separator!r} (e.g. "
                f"{alias.replace(self.separator, '_')!r}) or another separator")
        return alias

    def target_name(self, source_alias: str, name: str) -> str:
        self._check_alias(source_alias)
        check_name("partition name", name)
        return f"{source_alias}{self.separator}{name}"

    def upstream(self, target_name: str) -> tuple[str, str] | None:
        check_name("partition name", target_name)
        alias, sep, name = target_name.partition(self.separator)
        if not sep or not alias or not name:
            return None
        return alias, name

    def source_chain(self, name: str) -> list[str]:
        """The aliases `name` went through, nearest first: "B.A.orders" -> ["B", "A"]."""
        chain = []
        up = self.upstream(name)
        while up is not None:
            chain.append(up[0])
            up = self.upstream(up[1])
        return chain

    def is_cycle(self, target_alias: str, name: str) -> bool:
        """Whether mirroring source partition `name` into cluster `target_alias` would bring a
        partition back to a cluster it came from ("B.orders" of cluster A into B): such a flow
        would copy its own output forever. MM2 refuses these too."""
        return target_alias in self.source_chain(name)

    def __repr__(self) -> str:
        return f"DefaultReplicationPolicy(separator={self.separator!r})"


class IdentityReplicationPolicy:
    """Target name = source name (MirrorMaker 2's IdentityReplicationPolicy). `source_alias`, if
    given, is what `upstream` reports for every name; otherwise `upstream` knows nothing."""

    def __init__(self, source_alias: str | None = None) -> None:
        if source_alias is not None:
            check_name("source alias", source_alias, "A")
        self.source_alias = source_alias

    def target_name(self, source_alias: str, name: str) -> str:
        check_name("source alias", source_alias, "A")
        return check_name("partition name", name)

    def upstream(self, target_name: str) -> tuple[str, str] | None:
        check_name("partition name", target_name)
        return None if self.source_alias is None else (self.source_alias, target_name)

    def source_chain(self, name: str) -> list[str]:
        return []

    def is_cycle(self, target_alias: str, name: str) -> bool:
        return False

    def __repr__(self) -> str:
        return f"IdentityReplicationPolicy(source_alias={self.source_alias!r})"
