"""benchmarks.common.paused: a server's whole process tree stopped while another is measured."""

import subprocess
import time
from pathlib import Path

from benchmarks.common import paused, process_tree


def state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def test_paused_stops_a_process_and_its_children_then_continues_them():
    parent = subprocess.Popen(["bash", "-c", "sleep 30 & sleep 30 & wait"])
    try:
        deadline = time.monotonic() + 10
        while len(process_tree(parent.pid)) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        tree = process_tree(parent.pid)
        assert len(tree) == 3 and tree[0] == parent.pid
        with paused([parent.pid]):
            assert [state(pid) for pid in tree] == ["T"] * 3
        assert "T" not in [state(pid) for pid in tree]
    finally:
        parent.kill()
        parent.wait()


def test_a_process_gone_before_it_is_paused_is_skipped():
    gone = subprocess.Popen(["true"])
    gone.wait()
    assert process_tree(gone.pid) == [gone.pid]
    with paused([gone.pid]):
        pass
