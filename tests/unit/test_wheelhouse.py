from factory.image.flavors import FLAVORS
from factory.image.wheelhouse import ensure_wheelhouse, wheelhouse_dir


def test_a_flavors_earlier_wheelhouses_are_removed_and_others_kept(tmp_path, monkeypatch):
    """The cached wheelhouse is returned without a download; an earlier lock's of the same flavor
    goes, another flavor's (whose name ends the same) stays."""
    monkeypatch.setenv("INFERKILN_CACHE", str(tmp_path))
    flavor = FLAVORS["cpu"]
    current = wheelhouse_dir(flavor)
    current.mkdir(parents=True)
    (current / ".complete").write_text("")
    stale, other = current.parent / "cpu-0123456789abcdef", current.parent / "vllm-cpu-0123456789abcdef"
    for directory in (stale, other):
        directory.mkdir()
        (directory / "a.whl").write_bytes(b"")
    assert ensure_wheelhouse(flavor, lambda _: None) == current
    assert not stale.exists() and other.exists() and current.exists()
