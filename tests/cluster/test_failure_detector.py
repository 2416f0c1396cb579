"""Failure detection that an outage of the metadata store cannot fool (issue 26, item 2): the
detector's rules, driven with explicit times."""
from __future__ import annotations

from s3stream.cluster import FailureDetector

S = 1_000_000_000          # one second in ns


def beat(det: FailureDetector, now_s: float, tokens: dict[int, object]) -> list[int]:
    return det.observe(int(now_s * S), tokens.items())


def test_silence_counts_between_successful_reads_and_a_new_record_resets_it():
    det = FailureDetector(timeout=1.0, max_credit=0.25)
    t = 0.0
    assert beat(det, t, {2: "a", 3: "a"}) == []
    for _ in range(3):                       # 0.6 s: node 3 heartbeats, node 2 is silent
        t += 0.2
        assert beat(det, t, {2: "a", 3: f"b{t}"}) == []
    assert abs(det.silence(2) - 0.6) < 1e-9 and det.silence(3) == 0.0
    for _ in range(2):
        t += 0.2
        suspects = beat(det, t, {2: "a", 3: f"b{t}"})
    assert suspects == [2]                   # 1.0 s of counted silence
    assert beat(det, t + 0.2, {2: "new epoch", 3: "x"}) == []    # a restart resets it


def test_a_judge_gap_is_an_outage():
    """A judge that was paused, starved, or whose read waited 10 s for the store charges none
    of it to its peers and gives each a whole timeout again: the silence a peer had before the
    gap does not carry over (fault campaign seed 40: a peer paused before a PostgreSQL outage
    was failed over 0.3 s after the store came back, still reconnecting)."""
    det = FailureDetector(timeout=1.0, max_credit=0.25)
    t = 0.0
    for _ in range(5):
        beat(det, t, {2: "a"})
        t += 0.2
    assert det.silence(2) >= 0.8
    t += 10.0
    assert beat(det, t, {2: "a"}) == []
    assert det.silence(2) == 0.0 and det.outages == 1
    back = t
    while not beat(det, t, {2: "a"}):
        t += 0.2
    assert t - back >= 1.0 - 1e-9            # a whole timeout, counted in small steps


def test_an_outage_gives_every_peer_a_whole_timeout_again():
    """Silence of 0.9 s, then the judge cannot read the store: once it can again, nobody is
    suspected for a whole timeout, and a node that stays silent is suspected after it."""
    det = FailureDetector(timeout=1.0, max_credit=0.25)
    t = 0.0
    for _ in range(5):
        beat(det, t, {2: "a", 3: "a"})
        t += 0.2
    assert det.silence(2) >= 0.8
    det.unreachable()                        # a failed read: the store is down (for the judge)
    t += 10.0                                # a 10 s outage: every record is stale now
    assert beat(det, t, {2: "a", 3: "a"}) == []
    assert det.silence(2) == 0.0 and det.outages == 1
    back = t
    while True:
        t += 0.2
        suspects = beat(det, t, {2: "a", 3: f"alive {t}"})   # node 3 heartbeats again; node 2 is dead
        if suspects:
            break
    assert suspects == [2] and t - back >= 1.0 - 1e-9


def test_unknown_and_vanished_nodes():
    det = FailureDetector(timeout=1.0, max_credit=0.5)
    beat(det, 0.0, {2: "a"})
    beat(det, 0.5, {})                       # node 2 no longer listed (retired rows stay; ignore)
    assert det.silence(2) == 0.0
    beat(det, 1.0, {2: "a"})                 # seen again: a fresh start
    assert det.silence(2) == 0.0
    det.forget(2)
    assert det.silence(2) == 0.0
