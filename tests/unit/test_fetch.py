"""What a runtime build fetches (the base image, the wheelhouse), once, however many ask at once."""

from pathlib import Path

import pytest
from typer.testing import CliRunner

from factory.cli import app
from factory.image import build, wheelhouse
from factory.image.build import base_image_lock, ensure_base_image
from factory.image.flavors import FLAVORS
from factory.image.wheelhouse import ensure_wheelhouse, wheelhouse_dir, wheelhouse_lock
from factory.locking import replacing, replacing_dir
from tests.concurrency import after_the_first


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("INFERKILN_CACHE", str(tmp_path))
    return tmp_path


def completed(flavor):
    """The flavor's current wheelhouse as a finished download leaves it."""
    current = wheelhouse_dir(flavor)
    current.mkdir(parents=True)
    (current / ".complete").write_text("")
    return current


def test_a_flavors_earlier_wheelhouses_are_removed_and_others_kept(cache):
    """The cached wheelhouse is returned without a download; an earlier lock's of the same flavor
    goes, another flavor's (whose name ends the same) stays."""
    flavor = FLAVORS["cpu"]
    current = completed(flavor)
    stale, other = current.parent / "cpu-0123456789abcdef", current.parent / "vllm-cpu-0123456789abcdef"
    for directory in (stale, other):
        directory.mkdir()
        (directory / "a.whl").write_bytes(b"")
    assert ensure_wheelhouse(flavor, lambda _: None) == current
    assert not stale.exists() and other.exists() and current.exists()


def test_a_second_caller_waits_for_the_download_under_way_and_takes_its_wheelhouse(cache, monkeypatch):
    """The test suite's early `inferkiln fetch` and a build may want one wheelhouse at once: the
    second waits on the flavor's lock and downloads nothing (here a download would fail)."""
    flavor = FLAVORS["cuda"]
    monkeypatch.setattr(wheelhouse, "_download", lambda *_: pytest.fail("downloaded a second time"))
    found = after_the_first(wheelhouse_lock(flavor), lambda: ensure_wheelhouse(flavor, lambda _: None),
                            first=lambda: completed(flavor))
    assert found == wheelhouse_dir(flavor)


def test_an_interrupted_download_of_the_flavor_is_cleared_and_another_flavors_kept(cache, monkeypatch):
    flavor = FLAVORS["cpu"]
    parent = wheelhouse_dir(flavor).parent
    interrupted, others = parent / ".wheels-cpu-x1", parent / ".wheels-vllm-cpu-x1"
    for directory in (interrupted, others):
        directory.mkdir(parents=True)
    monkeypatch.setattr(wheelhouse, "_download", lambda flavor, *_: completed(flavor))
    assert ensure_wheelhouse(flavor, lambda _: None) == wheelhouse_dir(flavor)
    assert not interrupted.exists() and others.exists()


def test_a_second_caller_waits_for_the_base_image_under_way_and_takes_it(cache, monkeypatch):
    """As above, for the base image: one debootstrap, whoever asks first."""
    reference, images = "inferkiln/base:test", set()
    monkeypatch.setattr(build, "_existing", lambda client, ref: "sha256:1" if ref in images else None)
    monkeypatch.setattr(build, "_pulled_or_bootstrapped", lambda *_: pytest.fail("bootstrapped a second time"))
    found = after_the_first(base_image_lock(reference), lambda: ensure_base_image(None, lambda _: None, reference),
                            first=lambda: images.add(reference))
    assert found == reference


def test_fetch_names_an_unknown_flavor_as_bad_input():
    result = CliRunner().invoke(app, ["fetch", "cpu", "rocm"])
    assert result.exit_code == 2
    assert "error: fetch: unknown flavor 'rocm'; one of cpu, vllm-cpu, cuda" in result.output


def test_a_new_installer_replaces_the_old_whole_under_a_reader(cache):
    """A build that opened the wheelhouse's uv before the factory's uv changed reads the old file to
    its end; the wheelhouse then holds the new one, and no staging copy is left beside it."""
    from uv import find_uv_bin

    current = completed(FLAVORS["cpu"])
    installer = current / wheelhouse.INSTALLER
    old = b"an older uv " * 100_000
    installer.write_bytes(old)
    with installer.open("rb") as reading:
        assert wheelhouse.cached_wheelhouse(FLAVORS["cpu"]) == current
        assert reading.read() == old
    assert installer.read_bytes() == Path(find_uv_bin()).read_bytes()
    assert sorted(p.name for p in current.iterdir()) == [".complete", wheelhouse.INSTALLER]


def test_a_replacement_that_fails_leaves_the_old_file_and_no_partial_one(tmp_path):
    target = tmp_path / "catalog.json"
    target.write_text("old")
    with pytest.raises(OSError), replacing(target) as staged:
        staged.write_text("half")
        raise OSError("disk full")
    assert target.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["catalog.json"]


def test_a_folder_is_replaced_whole_and_nothing_staged_stays(tmp_path):
    target = tmp_path / "model"
    target.mkdir()
    (target / "old.bin").write_text("old")
    with replacing_dir(target, ".model-") as staged:
        assert staged.parent == tmp_path and target.exists()  # the old folder stays until the new is whole
        (staged / "new.bin").write_text("new")
    assert [p.name for p in target.iterdir()] == ["new.bin"]
    assert [p.name for p in tmp_path.iterdir()] == ["model"]


def test_a_folder_replacement_that_fails_leaves_the_old_folder_and_no_partial_one(tmp_path):
    target = tmp_path / "wheels"
    target.mkdir()
    (target / "old.whl").write_text("old")
    with pytest.raises(OSError), replacing_dir(target, ".wheels-") as staged:
        (staged / "half.whl").write_text("half")
        raise OSError("disk full")
    assert [p.name for p in target.iterdir()] == ["old.whl"]
    assert [p.name for p in tmp_path.iterdir()] == ["wheels"]
