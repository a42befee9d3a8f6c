"""Shared fixtures: the real tiny model and a real server on a loopback port."""

from __future__ import annotations

import fcntl
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
import uvicorn
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families

from factory.stack import docker_up, stack_up
from factory.tinymodel import ensure_tiny_model
from service.launcher import ServerProcess, free_port


# Every test session on the machine holds this file shared; the last one to end cleans up.
SESSIONS_LOCK = Path(tempfile.gettempdir()) / "inferkiln-test-sessions.lock"


@pytest.fixture(scope="session", autouse=True)
def images_built_are_removed() -> Iterator[None]:
    """CI runs on a long-lived machine, and one run builds some 20 images (1.7 to 8 GB each):
    without this, their layers fill its disk within a few runs. A session that ends while another
    runs (a developer's unit tests beside CI) leaves the images for the last session to remove, with
    its own start time in the lock file: removing them would take images from under the other's tests."""
    started = int(time.time())
    with SESSIONS_LOCK.open("a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_SH)
        yield
        if not last_session(lock):
            lock.write(f"{earliest_start(lock, started)}\n")
            lock.flush()
            fcntl.flock(lock, fcntl.LOCK_UN)  # the others may have ended meanwhile: one more try
            if not last_session(lock):
                return
        since = earliest_start(lock, started)
        if docker_up():
            remove_images_built_since(since)
        lock.truncate(0)


def earliest_start(lock, started: int) -> int:
    """The earliest of `started` and the start times the sessions that ended before left in the lock file."""
    lock.seek(0)
    return min([started, *(int(line) for line in lock.read().split())])


def last_session(lock) -> bool:
    """Whether no other test session holds the lock (this one then holds it alone)."""
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False


def current_base_images() -> set[str]:
    """This checkout's base images, the Debian base and each flavor's runtime: the factory reuses them."""
    from factory.image.context import runtime_reference
    from factory.image.flavors import DEBIAN_BASE_IMAGE, FLAVORS

    return {DEBIAN_BASE_IMAGE, *map(runtime_reference, FLAVORS.values())}


def remove_images_built_since(started: int) -> None:
    """Removes the images built since `started`, and the base images this checkout's replace, but
    keeps this checkout's own, so the next run on this machine need not build them again."""
    import docker

    current = current_base_images()
    current_repositories = {reference.rsplit(":", 1)[0] for reference in current}
    api = docker.from_env().api
    # newest first, so that an image goes before the image it was built on
    for image in sorted(api.images(), key=lambda image: image["Created"], reverse=True):
        tags = set(image.get("RepoTags") or ())
        if tags & current:
            continue
        built_here = image["Created"] >= started
        replaced = any(tag.rsplit(":", 1)[0] in current_repositories for tag in tags)
        if built_here or replaced:
            try:
                api.remove_image(image["Id"], force=built_here)
            except docker.errors.APIError:  # a container or a newer image still uses it
                pass


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Unit tests first, each module's tests in their order: a broken unit shows in minutes, and the
    early fetch below has their time to overlap."""
    items.sort(key=lambda item: "integration" in item.path.parts)


@pytest.fixture(scope="session", autouse=True)
def runtime_inputs_fetched_early(request) -> Iterator[None]:
    """Where image builds are among the tests, `inferkiln fetch` runs beside the session from its
    start: on a fresh machine the base image and the wheelhouses (4 GB from PyPI) are mostly network
    time, which then overlaps the tests before the first build rather than adding to the run (CI's
    bound is 45 minutes on a fresh machine). A build that comes first waits on the fetch's locks
    (factory.image) and fails as it would alone where the fetch failed; on a machine that has them
    it is a no-op. A process, not a thread: tests point INFERKILN_CACHE elsewhere for a while. The
    session waits for it at its end (a short session on a fresh machine), so as not to leave a
    debootstrap half done."""
    if not any(item.get_closest_marker("slow") for item in request.session.items):
        yield
        return
    request.getfixturevalue("local_stack")  # dockerd up before the fetch and the tests both need it
    fetch = subprocess.Popen([sys.executable, "-m", "factory.cli", "fetch"], stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, start_new_session=True)
    yield
    fetch.wait()


@pytest.fixture(scope="session")
def local_stack() -> dict[str, str]:
    """The machine's stack (dockerd, the registry at 127.0.0.1:5000, helm), started before any test
    points INFERKILN_HOME at a catalog of its own: started under it, the machine's registry would keep
    its data in that test's temporary directory, and serve on from there after pytest removed it."""
    return stack_up()


@pytest.fixture(scope="module")
def own_catalog(local_stack, tmp_path_factory) -> Iterator[Path]:
    """INFERKILN_HOME at a catalog of the module's own, for the module's tests; the registry and the
    images stay the machine's (`local_stack` is up first)."""
    path = tmp_path_factory.mktemp("inferkiln-home")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("INFERKILN_HOME", str(path))
        yield path


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    """Trained once per machine (about 40 s), then reused from the cache."""
    return ensure_tiny_model()


@pytest.fixture(scope="session")
def tokenizer(tiny_model_dir):
    """The tiny model's tokenizer, as transformers loads it."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="session")
def server(tiny_model_dir, tmp_path_factory):
    """One shared server for the tests that only send requests."""
    log = tmp_path_factory.mktemp("server") / "service.log"
    with ServerProcess(["--model", str(tiny_model_dir)], log_path=log) as proc:
        yield proc


@contextmanager
def app_in_thread(app, **config) -> Iterator[str]:
    """An ASGI app on a real uvicorn server over loopback, in a thread of the test process: its URL."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", **config))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)


@pytest.fixture(scope="session")
def client(server) -> OpenAI:
    return OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="session")
def model_name() -> str:
    return "tiny-llama"


def wait_for(predicate, timeout: float, what: str, interval: float = 0.5):
    """The predicate's first value that is not None, polled every `interval` s for `timeout` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (value := predicate()) is not None:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out waiting for {what}")


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    """Every sample of /v1/metrics, parsed by prometheus_client, keyed by (name, sorted labels)."""
    text = httpx.get(f"{url}/v1/metrics").text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def metric(samples: dict, name: str, **labels) -> float:
    """Sum of the samples of `name` whose labels include `labels`."""
    return sum(v for (n, lbls), v in samples.items()
               if n == name and all(dict(lbls).get(k) == val for k, val in labels.items()))


AIPERF_PYTHON = Path(__file__).parents[1] / ".venv-aiperf" / "bin" / "python"


@pytest.fixture(scope="session")
def aiperf_read():
    """What NVIDIA AIPerf's own code reads from report run directories (tests/aiperf_reader.py)."""
    import json
    import subprocess

    assert AIPERF_PYTHON.exists(), "AIPerf's environment is missing: run scripts/setup.sh"

    def read(*run_dirs: Path) -> dict[str, dict]:
        done = subprocess.run([str(AIPERF_PYTHON), str(Path(__file__).parent / "aiperf_reader.py"),
                               *map(str, run_dirs)], capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        return {Path(k).name: v for k, v in json.loads(done.stdout).items()}

    return read
