"""The suite's own clean-up (tests/conftest.py), on real images built FROM scratch in a real Docker
Engine: what a run built goes, what was there before stays, and so do this checkout's base images."""

from __future__ import annotations

import io
import time
import uuid

import pytest

from factory.stack import docker_client
from tests.conftest import current_base_images, remove_images_built_since

pytestmark = pytest.mark.slow  # needs a Docker Engine


def build(client, tag: str) -> str:
    """An image of no layers, built in a second (a label makes each one distinct)."""
    dockerfile = io.BytesIO(f"FROM scratch\nLABEL test.id={uuid.uuid4().hex}\n".encode())
    image, _ = client.images.build(fileobj=dockerfile, tag=tag, rm=True)
    return image.id


def exists(client, image_id: str) -> bool:
    return any(image.id == image_id for image in client.images.list(all=True))


@pytest.fixture
def client():
    return docker_client()


def test_a_run_removes_what_it_built_and_replaced_base_images_only(client):
    unique = uuid.uuid4().hex[:8]
    bases = {tag for image in client.images.list() for tag in image.tags} & current_base_images()
    before = build(client, f"inferkiln-suite-test/before:{unique}")
    stale_runtime = build(client, f"inferkiln/runtime-cpu:stale-{unique}")
    time.sleep(1.1)  # image creation times are whole seconds
    started = int(time.time())
    built = build(client, f"inferkiln/tiny-suite-test:{unique}")
    retagged = build(client, f"127.0.0.1:5000/inferkiln/tiny-suite-test:{unique}")
    try:
        remove_images_built_since(started)
        assert not exists(client, built) and not exists(client, retagged)
        assert not exists(client, stale_runtime), "a runtime image this checkout replaces is kept"
        assert exists(client, before), "an image from before the run was removed"
        assert bases <= {tag for image in client.images.list() for tag in image.tags}, \
            "this checkout's base images were removed"
    finally:
        for image_id in (before, stale_runtime, built, retagged):
            if exists(client, image_id):
                client.images.remove(image_id, force=True)
