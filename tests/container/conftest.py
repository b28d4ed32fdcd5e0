"""Host-side image tests: `pytest tests/container --image dlenv:cu116` (needs Docker and the image)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def image(request):
    name = request.config.getoption("--image")
    if not name:
        pytest.skip("pass --image NAME to test a built image")
    return name


@pytest.fixture(scope="session")
def docker_client(image):
    docker = pytest.importorskip("docker")
    try:
        client = docker.from_env()
        client.ping()
    except Exception as e:  # no engine on this machine
        pytest.skip(f"no Docker engine reachable ({e.__class__.__name__})")
    return client
