"""Consumer group offsets: commit and read a group's offset per partition, in the cluster's
metadata KV, fenced by the group's generation (issue 13; the mirror translates these offsets).

KV layout (JSON values, keys sorted):
- `consumer/<group>/generation`: {"generation": n, "member": name, "at": ns}: the group's current
  generation, n >= 1, and the member whose `join` started it.
- `consumer/<group>/offsets/<partition>`: {"offset": o, "generation": n, "at": ns, "metadata": s}:
  the next offset the group will consume in the partition, and the generation that committed it.

Rules:
- `join` starts generation n + 1 by compare-and-set on the generation record, so concurrent joins
  never share a generation, and every join fences all earlier generations.
- `commit` writes the offset record by compare-and-set guarded by the generation record exactly as
  the committer read it (`MetadataStore.replace_kv`). The guard passes only while the group's
  generation is the committer's (generations only grow), so a member fenced by a later join has its
  commit refused (StaleGenerationError) even if it does not know yet that it was fenced.
- An offset never moves backwards, whatever generation stored it, unless the commit passes
  `allow_rewind=True` (a deliberate reset); committing the stored offset again changes nothing. So a
  slow member cannot undo progress, and a rewind is always explicit.
- A conflict (another committer changed the partition's record or the generation between the read
  and the write) is retried from a fresh read, a bounded number of times. Commits of different
  partitions touch different keys and never conflict with each other.
- `delete_group` removes the generation record first, which fences every commit at once, then the
  offsets. A crash in between leaves offsets without a generation: the group is still listed, no
  commit lands, and deleting again finishes. Delete only a group nobody consumes with: a later
  `join` starts again at generation 1, so a member of the deleted group that is still running would
  be fenced only until the new group reached its generation number.

Names of groups and partitions are non-empty strings without '/' (the key separator) or NUL.
"""
from __future__ import annotations

import json
import time
from typing import Callable

from ..errors import InvalidArgumentError, MetadataError, S3StreamError, check_int
from ..metadata import MetadataStore

PREFIX = "consumer/"

#: Attempts of a compare-and-set before giving up. Each failed attempt means another writer changed
#: the same record in between, so running out takes sustained contention on one key.
MAX_ATTEMPTS = 64


class StaleGenerationError(S3StreamError):
    """A commit named a generation that is not the group's current one: a later `join` fenced this
    member (or the group was deleted). Nothing was written. The member stops, rejoins and resumes
    from the committed offsets."""

    def __init__(self, group: str, generation: int, current: int | None) -> None:
        now = f"the current one is {current}" if current is not None else "the group has no generation (deleted)"
        super().__init__(
            f"consumer group {group!r}: generation {generation} is stale, {now}; another member joined since "
            f"(or the group was deleted), so this member was fenced and its commit refused: rejoin with "
            f"ConsumerGroups.join() and resume from the committed offsets")
        self.group = group
        self.generation = generation
        self.current = current


def _check_name(what: str, name) -> str:
    if not isinstance(name, str) or not name or "/" in name or "\x00" in name:
        raise InvalidArgumentError(
            f"{what} must be a non-empty string without '/' or NUL, got {name!r} ({type(name).__name__}); "
            f"pass a plain name such as 'orders-0'")
    return name


def _encode(record: dict) -> bytes:
    return json.dumps(record, sort_keys=True).encode()


class ConsumerGroups:
    """Consumer groups' generations and committed offsets in `meta` (see the module docstring).
    `clock` gives the ns stamped into records as "at" (inject a fake one in tests)."""

    def __init__(self, meta: MetadataStore, clock: Callable[[], int] = time.time_ns) -> None:
        self.meta = meta
        self.clock = clock

    @staticmethod
    def _generation_key(group: str) -> str:
        return f"{PREFIX}{group}/generation"

    @staticmethod
    def _offsets_prefix(group: str) -> str:
        return f"{PREFIX}{group}/offsets/"

    def join(self, group: str, member: str) -> int:
        """Start a new generation of `group` for `member` and return it (1 for a new group). Every
        earlier generation is fenced from now on: its commits raise StaleGenerationError."""
        _check_name("group", group)
        if not isinstance(member, str) or not member:
            raise InvalidArgumentError(f"member must be a non-empty string, got {member!r}; pass the member's id")
        key = self._generation_key(group)
        for _ in range(MAX_ATTEMPTS):
            raw = self.meta.get_kv(key)
            generation = (json.loads(raw)["generation"] if raw is not None else 0) + 1
            value = _encode({"generation": generation, "member": member, "at": self.clock()})
            if self.meta.replace_kv(key, raw, value):
                return generation
        raise MetadataError(f"consumer group {group!r}: join lost {MAX_ATTEMPTS} races with other joins; "
                            f"retry later, with fewer members joining at once")

    def generation(self, group: str) -> int | None:
        """The group's current generation (None: no member ever joined, or it was deleted)."""
        owner = self.generation_owner(group)
        return None if owner is None else owner[0]

    def generation_owner(self, group: str) -> tuple[int, str | None] | None:
        """(current generation, the member that started it by joining) of `group`; None if no
        member ever joined, or it was deleted."""
        raw = self.meta.get_kv(self._generation_key(_check_name("group", group)))
        if raw is None:
            return None
        record = json.loads(raw)
        return record["generation"], record.get("member")

    def commit(self, group: str, partition: str, offset: int, generation: int, metadata: str = "",
               allow_rewind: bool = False) -> bool:
        """Store `offset` as the group's committed offset of `partition`, if `generation` is the
        group's current one (else StaleGenerationError). Moving the offset backwards raises
        InvalidArgumentError unless `allow_rewind`. Returns True if written, False if the offset
        was already stored (nothing changes then, not even the metadata)."""
        _check_name("group", group)
        _check_name("partition", partition)
        check_int("offset", offset)
        check_int("generation", generation, minimum=1)
        if not isinstance(metadata, str):
            raise InvalidArgumentError(f"metadata must be a string, got {type(metadata).__name__}; "
                                       f"encode it (e.g. json.dumps) first")
        generation_key = self._generation_key(group)
        key = self._offsets_prefix(group) + partition
        for _ in range(MAX_ATTEMPTS):
            generation_raw = self.meta.get_kv(generation_key)
            current = None if generation_raw is None else json.loads(generation_raw)["generation"]
            if generation_raw is None or current != generation:
                raise StaleGenerationError(group, generation, current)
            raw = self.meta.get_kv(key)
            stored = None if raw is None else json.loads(raw)["offset"]
            if stored == offset:
                return False
            if stored is not None and offset < stored and not allow_rewind:
                raise InvalidArgumentError(
                    f"consumer group {group!r}, partition {partition!r}: offset {offset} is behind the committed "
                    f"offset {stored}; a commit only moves forward: pass allow_rewind=True to reset it on purpose")
            value = _encode({"offset": offset, "generation": generation, "at": self.clock(), "metadata": metadata})
            if self.meta.replace_kv(key, raw, value, guard=(generation_key, generation_raw)):
                return True
            # The partition's record or the generation changed in between: judge again from a fresh read.
        raise MetadataError(f"consumer group {group!r}, partition {partition!r}: commit lost {MAX_ATTEMPTS} races "
                            f"with other commits of the same partition; commit it from one member at a time")

    def committed(self, group: str, partition: str) -> int | None:
        """The group's committed offset of `partition` (None if none was committed)."""
        raw = self.meta.get_kv(self._offsets_prefix(_check_name("group", group)) + _check_name("partition", partition))
        return None if raw is None else json.loads(raw)["offset"]

    def offsets(self, group: str) -> dict[str, int]:
        """Every committed offset of the group, {partition: offset}, partitions ascending (one read)."""
        prefix = self._offsets_prefix(_check_name("group", group))
        return {key[len(prefix):]: json.loads(raw)["offset"] for key, raw in self.meta.list_kv(prefix).items()}

    def groups(self) -> list[str]:
        """Every group with a generation or a committed offset, ascending."""
        return sorted({key[len(PREFIX):].split("/", 1)[0] for key in self.meta.list_kv(PREFIX)})

    def delete_group(self, group: str) -> None:
        """Remove the group's generation and offsets, and nothing of any other group. The generation
        goes first, so no commit lands after this starts. Only for a group nobody consumes with
        any more (see the module docstring)."""
        self.meta.delete_kv(self._generation_key(_check_name("group", group)))
        for key in self.meta.list_kv(self._offsets_prefix(group)):
            self.meta.delete_kv(key)
