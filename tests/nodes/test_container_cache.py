"""A node's image cache with real podman and a real registry: kept by digest, evicted least
recently used first when it passes its high-water mark."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from scheduler import containers
from tests.nodes.conftest import TEST_BASE
from tests.nodes.registry import build_image, podman_config, podman_env
from tests.nodes.test_containers import lab  # noqa: F401 - the registries and the image


@pytest.fixture
def podman_here(monkeypatch, lab):  # noqa: F811
    """This process's podman with storage of its own (as a node's agent has)."""
    work = Path(tempfile.mkdtemp(prefix="cache-", dir=TEST_BASE))
    etc = podman_config(work, [lab["open"].address], work / "run")
    env = podman_env(etc)
    for name in ("CONTAINERS_CONF", "CONTAINERS_STORAGE_CONF", "CONTAINERS_REGISTRIES_CONF"):
        monkeypatch.setenv(name, env[name])
    yield work
    subprocess.run(["podman", "rmi", "--all", "--force"], capture_output=True, env=env)
    shutil.rmtree(work, ignore_errors=True)


def held(image_id: str) -> bool:
    return subprocess.run(["podman", "image", "inspect", image_id], capture_output=True).returncode == 0


def test_the_least_recently_used_image_goes_when_the_cache_passes_its_high_water_mark(
        podman_here, lab):  # noqa: F811
    other = f"{lab['open'].address}/tiny:2"
    builder = podman_here / "builder2"
    build_image(builder, podman_config(builder, [lab["open"].address], builder / "run"), other)
    cache = containers.ImageCache(str(podman_here / "images"), high_water_bytes=2**40)
    first = containers.ensure("podman", containers.parse_image(lab["image"]), cache, 60)
    assert first["pulled_now"] and first["digest"] == lab["digest"] and held(first["id"])
    cache.high_water = int(first["size"] * 1.5)  # room for one image, not two
    again = containers.ensure("podman", containers.parse_image(lab["image"]), cache, 60)
    assert again["pulled_now"] is False and again["id"] == first["id"]
    second = containers.ensure("podman", containers.parse_image(other), cache, 60)
    assert second["pulled_now"] and second["id"] != first["id"]
    assert [row["refs"] for row in cache.listing()] == [[other]]
    assert not held(first["id"]) and held(second["id"])
    # the evicted image comes back with a pull when a job wants it again
    back = containers.ensure("podman", containers.parse_image(lab["image"]), cache, 60)
    assert back["pulled_now"] and back["digest"] == lab["digest"]
    assert [row["refs"] for row in cache.listing()] == [[lab["image"]]]


def test_an_image_pinned_by_digest_uses_the_cached_image_of_that_digest_and_no_other(
        podman_here, lab):  # noqa: F811
    cache = containers.ImageCache(str(podman_here / "images"), high_water_bytes=2**40)
    by_tag = containers.ensure("podman", containers.parse_image(lab["image"]), cache, 60)
    repository = lab["image"].rsplit(":", 1)[0]
    pinned = containers.ensure("podman", containers.parse_image(f"{repository}@{lab['digest']}"),
                               cache, 60)
    assert pinned["pulled_now"] is False and pinned["id"] == by_tag["id"]
    absent = f"{repository}@sha256:{'0' * 64}"
    with pytest.raises(containers.ContainerError, match=rf"cannot pull {absent}: .*manifest unknown"):
        containers.ensure("podman", containers.parse_image(absent), cache, 60)
