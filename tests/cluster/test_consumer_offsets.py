"""Consumer group offsets (s3stream.records.consumer) over both metadata stores (SQLite, PostgreSQL):
round trips, generation fencing, forward-only commits, concurrent committers and joiners on
several stores sharing one database, input validation, group deletion."""
from __future__ import annotations

import json
import threading

import pytest

from s3stream.records.consumer import ConsumerGroups, StaleGenerationError
from s3stream.errors import InvalidArgumentError, S3StreamError

SECOND = 1_000_000_000


class FakeClock:
    def __init__(self, now: int = 1_000 * SECOND) -> None:
        self.now = now

    def __call__(self) -> int:
        return self.now


@pytest.fixture
def meta(open_same_metadata):
    return open_same_metadata()


@pytest.fixture
def groups(meta):
    return ConsumerGroups(meta, clock=FakeClock())


def run_threads(targets) -> list[BaseException]:
    """Run each callable on its own thread, started together; the exceptions they raised."""
    errors: list[BaseException] = []
    start = threading.Barrier(len(targets))

    def run(target):
        start.wait()
        try:
            target()
        except BaseException as e:   # reported to the test, which fails on it
            errors.append(e)

    threads = [threading.Thread(target=run, args=(t,)) for t in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads)
    return errors


def test_commit_and_read_round_trip(groups, meta):
    assert groups.committed("g", "orders-0") is None and groups.generation("g") is None
    generation = groups.join("g", "member-a")
    assert generation == 1 and groups.generation("g") == 1
    assert groups.commit("g", "orders-0", 42, generation, metadata="ckpt-1") is True
    assert groups.committed("g", "orders-0") == 42
    assert json.loads(meta.get_kv("consumer/g/offsets/orders-0")) == {
        "offset": 42, "generation": 1, "at": 1_000 * SECOND, "metadata": "ckpt-1"}
    assert json.loads(meta.get_kv("consumer/g/generation")) == {
        "generation": 1, "member": "member-a", "at": 1_000 * SECOND}
    assert groups.commit("g", "orders-0", 50, generation) is True and groups.committed("g", "orders-0") == 50
    assert groups.commit("g", "orders-0", 0, generation, allow_rewind=True) and groups.committed("g", "orders-0") == 0


def test_generation_owner_names_the_member_that_joined(groups):
    assert groups.generation_owner("g") is None
    groups.join("g", "alpha")
    assert groups.generation_owner("g") == (1, "alpha")
    groups.join("g", "beta")
    assert groups.generation_owner("g") == (2, "beta") and groups.generation("g") == 2


def test_offsets_of_a_group(groups):
    gen_a, gen_b = groups.join("a", "m"), groups.join("b", "m")
    for partition, offset in (("p2", 7), ("p0", 3), ("p1", 0)):
        groups.commit("a", partition, offset, gen_a)
    groups.commit("b", "p0", 99, gen_b)
    groups.join("ab", "m")      # a group whose name starts with another's shares nothing with it
    assert groups.offsets("a") == {"p0": 3, "p1": 0, "p2": 7}
    assert list(groups.offsets("a")) == ["p0", "p1", "p2"]
    assert groups.offsets("b") == {"p0": 99} and groups.offsets("ab") == {} and groups.offsets("none") == {}
    assert groups.groups() == ["a", "ab", "b"]


def test_stale_generation_commit_is_refused(groups, meta):
    old = groups.join("g", "member-a")
    groups.commit("g", "p", 10, old)
    new = groups.join("g", "member-b")
    assert new == old + 1
    before = meta.get_kv("consumer/g/offsets/p")
    for offset in (5, 10, 20):                        # backwards, equal, forwards: all refused
        with pytest.raises(StaleGenerationError) as info:
            groups.commit("g", "p", offset, old, allow_rewind=True)
        assert isinstance(info.value, S3StreamError)
        assert (info.value.group, info.value.generation, info.value.current) == ("g", old, new)
        message = str(info.value)
        assert "'g'" in message and f"generation {old}" in message and f"current one is {new}" in message
        assert "rejoin" in message
    with pytest.raises(StaleGenerationError):
        groups.commit("g", "other", 1, old)          # a partition it never committed either
    assert meta.get_kv("consumer/g/offsets/p") == before and groups.committed("g", "other") is None
    assert groups.commit("g", "p", 20, new) and groups.committed("g", "p") == 20
    with pytest.raises(StaleGenerationError, match="no generation"):
        groups.commit("never-joined", "p", 1, 1)
    assert groups.groups() == ["g"]


def test_backwards_commit_needs_allow_rewind(groups, meta):
    generation = groups.join("g", "m")
    groups.commit("g", "p", 100, generation, metadata="first")
    before = meta.get_kv("consumer/g/offsets/p")
    with pytest.raises(InvalidArgumentError, match=r"offset 99 is behind the committed offset 100.*allow_rewind"):
        groups.commit("g", "p", 99, generation)
    assert groups.commit("g", "p", 100, generation, metadata="second") is False     # equal: a no-op
    assert meta.get_kv("consumer/g/offsets/p") == before
    # Forward-only holds across generations too: a new generation resets only on purpose.
    later = groups.join("g", "m2")
    with pytest.raises(InvalidArgumentError, match="allow_rewind"):
        groups.commit("g", "p", 1, later)
    assert meta.get_kv("consumer/g/offsets/p") == before
    assert groups.commit("g", "p", 1, later, allow_rewind=True) and groups.committed("g", "p") == 1


def test_concurrent_commits_of_different_partitions_all_land(groups, open_same_metadata):
    generation = groups.join("g", "leader")
    members, partitions_each, rounds = 4, 3, 5
    stores = [ConsumerGroups(open_same_metadata()) for _ in range(members)]

    def member(index: int):
        def run():
            for offset in range(1, rounds + 1):
                for p in range(partitions_each):
                    assert stores[index].commit("g", f"p{index}-{p}", offset * 10, generation, metadata=str(index))
        return run

    assert run_threads([member(i) for i in range(members)]) == []
    assert groups.offsets("g") == {f"p{i}-{p}": rounds * 10 for i in range(members) for p in range(partitions_each)}


def test_concurrent_joins_get_distinct_generations_and_only_the_last_commits(groups, open_same_metadata):
    count = 6
    stores = [ConsumerGroups(open_same_metadata()) for _ in range(count)]
    joined: dict[int, int] = {}

    def joiner(index: int):
        def run():
            joined[index] = stores[index].join("g", f"member-{index}")
        return run

    assert run_threads([joiner(i) for i in range(count)]) == []
    assert sorted(joined.values()) == list(range(1, count + 1))
    last = max(joined, key=joined.get)
    assert groups.generation("g") == count
    assert json.loads(stores[0].meta.get_kv("consumer/g/generation"))["member"] == f"member-{last}"

    refused: list[int] = []

    def committer(index: int):
        def run():
            try:
                stores[index].commit("g", f"p{index}", 10 + index, joined[index])
            except StaleGenerationError as e:
                assert e.current == count
                refused.append(index)
        return run

    assert run_threads([committer(i) for i in range(count)]) == []
    assert sorted(refused) == sorted(i for i in range(count) if i != last)
    assert groups.offsets("g") == {f"p{last}": 10 + last}


def test_bad_inputs_are_refused_and_change_nothing(groups, meta):
    generation = groups.join("g", "m")
    groups.commit("g", "p", 5, generation)
    before = meta.list_kv("")
    bad_commits = [                       # (arguments, what the message must name)
        (("", "p", 6, generation), "group must be a non-empty string"),
        (("g/x", "p", 6, generation), "'g/x'"),
        ((None, "p", 6, generation), "None"),
        (("g", "", 6, generation), "partition must be a non-empty string"),
        (("g", "a/b", 6, generation), "'a/b'"),
        (("g", 3, 6, generation), "partition must be"),
        (("g", "p", -1, generation), "offset must be between 0 and .*got -1"),
        (("g", "p", True, generation), "offset must be an int, got True"),
        (("g", "p", 6.0, generation), "offset must be an int, got 6.0"),
        (("g", "p", 6, str(generation)), f"generation must be an int, got '{generation}'"),
        (("g", "p", 6, 0), "generation must be between 1 and .*got 0"),
    ]
    for args, message in bad_commits:
        with pytest.raises(InvalidArgumentError, match=message):
            groups.commit(*args)
    with pytest.raises(InvalidArgumentError, match="metadata"):
        groups.commit("g", "p", 6, generation, metadata=b"bytes")
    for call in (lambda: groups.join("", "m"), lambda: groups.join("a/b", "m"), lambda: groups.join("g", ""),
                 lambda: groups.committed("g", "a/b"), lambda: groups.offsets(""), lambda: groups.delete_group("g/")):
        with pytest.raises(InvalidArgumentError):
            call()
    assert meta.list_kv("") == before
    assert groups.committed("g", "p") == 5 and groups.generation("g") == generation


def test_delete_group_removes_only_that_group(groups, meta):
    meta.put_kv("assignment/g", b"not a consumer key")
    for group in ("g", "g2", "other"):
        generation = groups.join(group, "m")
        for p in ("p0", "p1"):
            groups.commit(group, p, 3, generation)
    others = {k: v for k, v in meta.list_kv("").items() if not k.startswith("consumer/g/")}
    old = groups.generation("g")
    groups.delete_group("g")
    assert meta.list_kv("consumer/g/") == {} and groups.offsets("g") == {} and groups.generation("g") is None
    assert meta.list_kv("") == others
    assert groups.groups() == ["g2", "other"] and groups.offsets("g2") == {"p0": 3, "p1": 3}
    with pytest.raises(StaleGenerationError):                  # a member of the deleted group is fenced
        groups.commit("g", "p0", 4, old)
    groups.delete_group("g")                                   # deleting again (or a crash's rest) is fine
    assert groups.join("g", "m") == 1 and groups.offsets("g") == {}


class RacingStore:
    """A MetadataStore that runs `race()` (another writer's step) just before its first
    replace_kv, so a commit's compare-and-set meets a change made after its reads."""

    def __init__(self, meta, race) -> None:
        self._meta = meta
        self._race = race

    def __getattr__(self, name):
        return getattr(self._meta, name)

    def replace_kv(self, *args, **kw):
        race, self._race = self._race, None
        if race is not None:
            race()
        return self._meta.replace_kv(*args, **kw)


def test_commit_judges_a_conflict_again_from_a_fresh_read(groups, meta):
    generation = groups.join("g", "m")

    def racing(race):
        return ConsumerGroups(RacingStore(meta, race))

    # Another member of the generation moved the partition forward: a commit further on lands...
    assert racing(lambda: groups.commit("g", "p", 20, generation)).commit("g", "p", 30, generation)
    assert groups.committed("g", "p") == 30
    # ...one that is now behind is refused, and one equal to it is a no-op.
    with pytest.raises(InvalidArgumentError, match="offset 35 is behind the committed offset 40"):
        racing(lambda: groups.commit("g", "p", 40, generation)).commit("g", "p", 35, generation)
    assert racing(lambda: groups.commit("g", "p", 50, generation)).commit("g", "p", 50, generation) is False
    # Another partition's commit in between is no conflict at all.
    assert racing(lambda: groups.commit("g", "q", 1, generation)).commit("g", "p", 60, generation)
    # A join in between fences the commit, although it read the generation as current.
    with pytest.raises(StaleGenerationError) as info:
        racing(lambda: groups.join("g", "m2")).commit("g", "p", 70, generation)
    assert info.value.current == generation + 1
    assert groups.offsets("g") == {"p": 60, "q": 1}
