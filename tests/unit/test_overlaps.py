import base64
import dataclasses
import hashlib
import zipfile
from pathlib import Path

import pytest

from factory.errors import CheckFailed
from factory.image.flavors import FLAVORS
from factory.image.overlaps import OVERLAPS_FILE, Overlap, check_overlaps, find_overlaps, installed_files


def make_wheel(directory: Path, name: str, version: str, files: dict[str, bytes]) -> Path:
    """A wheel as pip and uv read it: the files, and a RECORD with each one's sha256."""
    dist_info = f"{name}-{version}.dist-info"
    record = []
    wheel = directory / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        for path, content in {**files, f"{dist_info}/METADATA": f"Name: {name}\n".encode()}.items():
            archive.writestr(path, content)
            digest = base64.urlsafe_b64encode(hashlib.sha256(content).digest()).rstrip(b"=").decode()
            record.append(f"{path},sha256={digest},{len(content)}")
        archive.writestr(f"{dist_info}/RECORD", "\n".join(record + [f"{dist_info}/RECORD,,"]) + "\n")
    return wheel


@pytest.fixture
def house(tmp_path: Path) -> Path:
    """Two wheels that carry one module each with their own content, and one file alike."""
    make_wheel(tmp_path, "cuda_bindings", "13.5.0", {"cuda/bindings/driver.py": b"13.5", "cuda/__init__.py": b""})
    make_wheel(tmp_path, "cuda_python", "12.6.2", {"cuda/bindings/driver.py": b"12.6", "cuda/__init__.py": b"",
                                                   "cuda_python-12.6.2.data/purelib/cuda/extra.py": b"x"})
    make_wheel(tmp_path, "other", "1.0", {"other/__init__.py": b"", "other-1.0.data/scripts/tool": b"#!"})
    return tmp_path


def test_only_files_two_wheels_install_differently_overlap(house):
    assert find_overlaps(sorted(house.glob("*.whl"))) == [
        Overlap("cuda/bindings/driver.py", ("cuda-bindings", "cuda-python"))]


def test_a_wheels_data_installs_where_its_scheme_puts_it(house):
    assert set(installed_files(house / "cuda_python-12.6.2-py3-none-any.whl")) == {
        "cuda/bindings/driver.py", "cuda/__init__.py", "cuda/extra.py"}
    assert "scripts:tool" in installed_files(house / "other-1.0-py3-none-any.whl")


def test_an_unsettled_overlap_stops_the_build_naming_the_wheels_and_files(house):
    flavor = dataclasses.replace(FLAVORS["cpu"], install_last=())
    with pytest.raises(CheckFailed, match=r"cuda-bindings and cuda-python: 1 file\(s\), e\.g\. cuda/bindings/driver\.py"):
        check_overlaps(flavor, house, lambda _: None)


@pytest.mark.parametrize("settled", [{"install_last": ("cuda-bindings",)}, {"install_last": ("cuda_python",)},
                                     {"prune": ("cuda/bindings",)}, {"prune": ("cuda/bindings/*.py",)}])
def test_install_last_or_prune_settles_an_overlap(house, settled):
    check_overlaps(dataclasses.replace(FLAVORS["cpu"], **settled), house, lambda _: None)


def test_two_winners_settle_nothing_and_a_needless_one_is_noted(house, tmp_path):
    with pytest.raises(CheckFailed):
        check_overlaps(dataclasses.replace(FLAVORS["cpu"], install_last=("cuda-bindings", "cuda-python")),
                       house, lambda _: None)
    notes: list[str] = []
    check_overlaps(dataclasses.replace(FLAVORS["cpu"], install_last=("cuda-bindings", "other")), house, notes.append)
    assert notes == ["cpu flavor: install_last names other, whose files no other wheel of the lock carries"]


def test_overlaps_are_found_once_per_wheelhouse(house):
    flavor = dataclasses.replace(FLAVORS["cpu"], install_last=("cuda-bindings",))
    check_overlaps(flavor, house, lambda _: None)
    assert (house / OVERLAPS_FILE).is_file()
    for wheel in house.glob("*.whl"):
        wheel.unlink()  # what was found is kept, not found again
    with pytest.raises(CheckFailed):
        check_overlaps(dataclasses.replace(flavor, install_last=()), house, lambda _: None)
