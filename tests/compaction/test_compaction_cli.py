"""python -m compaction stats|run against a real SQLite file and local store."""
import json
import random
import subprocess
import sys

from test_compaction import Node
from test_engine import read_all


def cli(*args):
    out = subprocess.run([sys.executable, "-m", "compaction", *args], capture_output=True, text=True, check=True)
    return out.stdout


def test_stats_and_run(tmp_path):
    node = Node(tmp_path)
    rng = random.Random(8)
    streams = node.create(4)
    for _ in range(3):
        for s in streams:
            node.append(s, [2000] * 5, rng)
        node.upload()
    expected = {s: list(node.model[s]) for s in streams}
    node.close()
    meta = f"sqlite:///{tmp_path}/meta.db"
    before = json.loads(cli("stats", "--metadata", meta, "--json"))
    assert before["objects"]["stream_set_objects"]["count"] == 3
    assert before["nodes"]["1"]["compacted_stream_set_objects"] == 0
    result = json.loads(cli("run", "--node", "1", "--metadata", meta, "--store", f"file://{tmp_path}/objects",
                            "--destroy-delay", "0", "--json"))
    assert result["commits"] == 1 and result["objects_compacted"] == 3 and result["objects_deleted"] == 3
    after = json.loads(cli("stats", "--metadata", meta, "--json"))
    assert after["objects"]["stream_set_objects"]["count"] == 1
    assert after["nodes"]["1"]["compacted_stream_set_objects"] == 1
    assert "stream_set_objects:" in cli("stats", "--metadata", meta)
    reopened = Node(tmp_path, node_id=2)
    for stream_id, batches in expected.items():
        assert read_all(reopened.client.open_stream(stream_id)) == batches
    reopened.close()
