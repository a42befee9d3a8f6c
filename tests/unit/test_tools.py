"""The tools the factory installs into its cache (checkov's environment): once, whole, for all callers."""

import pytest

from factory import stack
from tests.concurrency import after_the_first


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("INFERKILN_CACHE", str(tmp_path))
    monkeypatch.setattr(stack.shutil, "which", lambda name: None)  # none on PATH: the cache's
    return tmp_path


def test_a_second_caller_waits_for_checkovs_install_under_way_and_takes_it(cache, monkeypatch):
    """The chart's policy check may run twice at once on a fresh machine: the second waits on the
    environment's lock and installs nothing (here an install would fail)."""
    venv = cache / "tools" / stack.CHECKOV_SPEC.replace("==", "-")
    monkeypatch.setattr(stack.subprocess, "run", lambda *_, **__: pytest.fail("installed a second time"))

    def first():
        (venv / "bin").mkdir(parents=True)
        (venv / stack.COMPLETE).write_text(stack.CHECKOV_SPEC)

    found = after_the_first(venv.with_name(venv.name + ".lock"), stack.checkov_binary, first)
    assert found == str(venv / "bin" / "checkov")


def test_an_install_that_did_not_finish_is_made_again(cache, monkeypatch):
    """The script appears before pip is done: without the marker a second call installs anew."""
    venv = cache / "tools" / stack.CHECKOV_SPEC.replace("==", "-")
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "checkov").write_text("#!/bin/sh\n")
    calls = []
    monkeypatch.setattr(stack.subprocess, "run", lambda args, **_: calls.append(args[:3]))
    assert stack.checkov_binary() == str(venv / "bin" / "checkov")
    assert calls[0][1:3] == ["-m", "venv"] and calls[1][1] == "install"
    assert (venv / stack.COMPLETE).read_text() == stack.CHECKOV_SPEC
    stack.checkov_binary()
    assert len(calls) == 2, "a finished install is not made again"
