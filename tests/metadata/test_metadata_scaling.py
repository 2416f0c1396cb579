"""Metadata that scales with the cluster, not with its history (issue 11): a node's own streams
through an index, ranges pruned by trims, a bounded delete list and a reclaimer that works
through it in steps."""
from __future__ import annotations

import sqlite3

import pytest

from s3stream.engine.lifecycle import ObjectReclaimer
from s3stream.metadata import (CommitRange, CommitRequest, CommitSSO, CommitStreamObject, ObjectState,
                               SqliteMetadataStore, StreamState)
from s3stream.objectstore import LocalObjectStore

SECOND = 1_000_000_000
TTL = 60 * SECOND


class FakeClock:
    def __init__(self) -> None:
        self.now = 1_000 * SECOND

    def __call__(self) -> int:
        return self.now


@pytest.fixture
def clock():
    return FakeClock()


@pytest.fixture
def store(tmp_path, clock):
    s = SqliteMetadataStore(str(tmp_path / "meta.db"), clock=clock)
    yield s
    s.close()


def commit_so(store, node, stream, start, end):
    (oid,) = store.prepare_objects(1, TTL)
    store.commit(CommitRequest(node.node_id, node.node_epoch, stream_objects=(
        CommitStreamObject(oid, end - start, CommitRange(stream.stream_id, stream.epoch, start, end)),)))
    return oid


def test_a_nodes_open_streams_only(store):
    n1, n2 = store.register_node(1, "/w1"), store.register_node(2, "/w2")
    mine = [store.create_stream(1, n1.node_epoch) for _ in range(3)]
    theirs = [store.create_stream(2, n2.node_epoch) for _ in range(4)]
    closed = store.close_stream(mine[0].stream_id, mine[0].epoch, 1)
    deleted = store.delete_stream(mine[1].stream_id, mine[1].epoch)
    assert closed.state == StreamState.CLOSED and deleted.state == StreamState.DELETED
    assert [m.stream_id for m in store.list_streams(owner_node_id=1)] == [mine[2].stream_id]
    assert [m.stream_id for m in store.list_streams(owner_node_id=2)] == [s.stream_id for s in theirs]
    assert store.list_streams(owner_node_id=3) == []
    moved = store.open_stream(closed.stream_id, 2, n2.node_epoch)
    assert moved.stream_id in [m.stream_id for m in store.list_streams(owner_node_id=2)]
    assert len(store.list_streams()) == 6 and len(store.list_streams(include_deleted=True)) == 7


def test_owner_lookup_uses_an_index(store):
    plan = " ".join(row[-1] for row in sqlite3.connect(store.path).execute(
        "EXPLAIN QUERY PLAN SELECT stream_id FROM streams WHERE owner_node_id = 1 AND state = 'OPENED'"))
    assert "streams_by_owner" in plan, plan


def test_trim_drops_ranges_below_the_start_but_keeps_the_last(store):
    nodes = [store.register_node(n, f"/w{n}") for n in (1, 2, 3)]
    s = store.create_stream(1, nodes[0].node_epoch)
    end = 0
    for i in range(6):                      # six holders, each writes 10 offsets then lets go
        node = nodes[i % 3]
        s = store.open_stream(s.stream_id, node.node_id, node.node_epoch) if i else s
        commit_so(store, node, s, end, end + 10)
        end += 10
        s = store.close_stream(s.stream_id, s.epoch, node.node_id)
    assert [(r.start_offset, r.end_offset) for r in s.ranges] == [(i * 10, i * 10 + 10) for i in range(6)]
    s = store.trim_stream(s.stream_id, s.epoch, 35)
    assert [(r.index, r.start_offset, r.end_offset) for r in s.ranges] == [(3, 30, 40), (4, 40, 50), (5, 50, 60)]
    s = store.trim_stream(s.stream_id, s.epoch, 60)          # everything: the last range stays
    assert [(r.index, r.start_offset, r.end_offset) for r in s.ranges] == [(5, 50, 60)]
    reopened = store.open_stream(s.stream_id, 1, nodes[0].node_epoch)
    assert [(r.index, r.node_id, r.start_offset) for r in reopened.ranges] == [(5, 3, 50), (6, 1, 60)]
    assert store.get_stream(s.stream_id) == reopened


def test_delete_list_is_bounded_and_the_reclaimer_works_through_it(store, tmp_path, clock):
    node = store.register_node(1, "/w1")
    s = store.create_stream(1, node.node_epoch)
    objects = LocalObjectStore(str(tmp_path / "objects"))
    ids = []
    for i in range(7):
        oid = commit_so(store, node, s, i * 10, i * 10 + 10)
        objects.put(store.get_object(oid).key, b"x" * 10)
        ids.append(oid)
    (orphan,) = store.prepare_objects(1, TTL)               # never committed: expires
    store.trim_stream(s.stream_id, s.epoch, 70)
    clock.now += TTL + SECOND
    due = [o.object_id for o in store.objects_to_delete(0)]
    assert due == sorted(ids + [orphan])
    assert [o.object_id for o in store.objects_to_delete(0, limit=3)] == due[:3]
    assert all(o.state == ObjectState.MARK_DESTROYED for o in store.objects_to_delete(0, limit=3))
    assert store.objects_to_delete(2 * TTL, limit=3) == [store.get_object(orphan)]

    reclaimer = ObjectReclaimer(objects, store, destroy_delay=0)
    reclaimer.batch = 3
    assert reclaimer.run_once() == 8
    assert store.objects_to_delete(0) == [] and list(objects.list("")) == []
    assert store.list_objects() == []


def test_other_streams_do_not_change_what_a_stream_reads(store):
    """The ranges of 500 other streams' objects do not leak into one stream's refs or meta."""
    n1, n2 = store.register_node(1, "/w1"), store.register_node(2, "/w2")
    mine = store.create_stream(1, n1.node_epoch)
    others = [store.create_stream(2, n2.node_epoch) for _ in range(500)]
    for i in range(0, 500, 100):
        (oid,) = store.prepare_objects(1, TTL)
        store.commit(CommitRequest(2, n2.node_epoch, sso=CommitSSO(oid, 100, tuple(
            CommitRange(o.stream_id, 0, 0, 5) for o in others[i:i + 100]))))
    commit_so(store, n1, mine, 0, 10)
    assert [(r.start_offset, r.end_offset) for r in store.get_object_refs(mine.stream_id, 0, 10)] == [(0, 10)]
    assert [m.stream_id for m in store.list_streams(owner_node_id=1)] == [mine.stream_id]
