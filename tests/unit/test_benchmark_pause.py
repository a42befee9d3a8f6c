"""benchmarks.common.paused: a server's whole process tree stopped while another is measured."""

import subprocess

import psutil

from benchmarks.common import paused
from tests.conftest import wait_for


def test_paused_stops_a_process_and_its_children_then_continues_them():
    parent = subprocess.Popen(["bash", "-c", "sleep 30 & sleep 30 & wait"])
    try:
        root = psutil.Process(parent.pid)
        tree = [root, *wait_for(lambda: root.children() if len(root.children()) == 2 else None, 10,
                                "bash's two children", 0.05)]
        with paused([parent.pid]):
            assert [process.status() for process in tree] == [psutil.STATUS_STOPPED] * 3
        assert psutil.STATUS_STOPPED not in [process.status() for process in tree]
    finally:
        parent.kill()
        parent.wait()


def test_a_process_gone_before_it_is_paused_is_skipped():
    gone = subprocess.Popen(["true"])
    gone.wait()
    with paused([gone.pid]):
        pass
