"""Image references and container mounts as users write them (docker, podman, pyxis/enroot,
`#SBATCH` lines of pyxis and shifter), and the errors for the ones that no runtime would take."""

from __future__ import annotations

import pytest

from scheduler.containers import ContainerError, parse_image, parse_mounts
from scheduler.slurm.sbatch import SbatchError, parse

DIGEST = "sha256:" + "ab" * 32


@pytest.mark.parametrize("ref, parsed", [
    ("busybox", ("", "busybox", "latest", "")),
    ("library/ubuntu:22.04", ("", "library/ubuntu", "22.04", "")),
    ("nvcr.io/nvidia/pytorch:24.01-py3", ("nvcr.io", "nvidia/pytorch", "24.01-py3", "")),
    ("nvcr.io#nvidia/pytorch:24.01-py3", ("nvcr.io", "nvidia/pytorch", "24.01-py3", "")),  # enroot
    ("docker://127.0.0.1:5000/tiny:1", ("127.0.0.1:5000", "tiny", "1", "")),
    (f"localhost/tiny@{DIGEST}", ("localhost", "tiny", "", DIGEST)),
    (f"registry.local:443/a/b:7@{DIGEST}", ("registry.local:443", "a/b", "7", DIGEST)),
])
def test_image_references_parse_as_the_runtimes_read_them(ref, parsed):
    image = parse_image(ref)
    assert (image.registry, image.repository, image.tag, image.digest) == parsed


@pytest.mark.parametrize("ref", [
    "UPPER/Case:tag", "Not A/Image!", "", " busybox", "tiny:", "tiny@sha256:short",
    "a//b", "tiny:" + "x" * 129,
])
def test_an_image_reference_that_does_not_parse_says_how_to_write_one(ref):
    with pytest.raises(ContainerError) as e:
        parse_image(ref)
    assert f"image {ref!r} is not a valid image reference" in str(e.value)
    assert "[REGISTRY[:PORT]/]REPOSITORY[:TAG][@sha256:DIGEST]" in str(e.value)


def test_container_mounts_in_pyxis_spelling():
    assert parse_mounts("/data:/data:ro,/scratch,/home/a/x:/x") == [
        {"src": "/data", "dst": "/data", "ro": True},
        {"src": "/scratch", "dst": "/scratch", "ro": False},
        {"src": "/home/a/x", "dst": "/x", "ro": False},
    ]


@pytest.mark.parametrize("text, words", [
    ("data:/data", "'data' is not an absolute path"),
    ("/a:/b:rx", "container mount '/a:/b:rx' does not parse"),
    ("/a:/b:ro:x", "does not parse; write SRC[:DST[:ro|rw]]"),
])
def test_a_mount_that_does_not_parse_is_named(text, words):
    with pytest.raises(ContainerError, match=words.replace("[", r"\[").replace("]", r"\]")):
        parse_mounts(text)


def sbatch(*lines: str):
    return parse("#!/bin/sh\n" + "".join(f"#SBATCH {line}\n" for line in lines) + "hostname\n",
                 submit_dir="/tmp", submit_host="login")


def test_pyxis_sbatch_lines_become_the_jobs_container():
    spec = sbatch("--container-image=nvcr.io#nvidia/pytorch:24.01-py3",
                  "--container-mounts=/data:/data:ro,/scratch", "--container-workdir=/workspace",
                  "--container-name=keep")
    body = spec.to_submit_body("x")
    assert (body["image"], body["container_mounts"], body["container_workdir"]) == (
        "nvcr.io#nvidia/pytorch:24.01-py3", ["/data:/data:ro", "/scratch"], "/workspace")
    assert spec.warning() == "sbatch: warning: recorded but not acted on by trainyard: --container-name"


def test_shifters_image_line_names_the_image_without_its_type():
    assert sbatch("--image=docker:nvcr.io/nvidia/pytorch:24.01-py3").to_submit_body("x")[
        "image"] == "nvcr.io/nvidia/pytorch:24.01-py3"
    assert "image" not in sbatch("--gpus=1").to_submit_body("x")


@pytest.mark.parametrize("lines, words", [
    (["--container-image=Not/Valid"], "script line 2: #SBATCH --container-image=Not/Valid: "
                                      "--container-image=Not/Valid: image 'Not/Valid' is not a "
                                      "valid image reference"),
    (["--container-image=tiny:1", "--container-mounts=data:/data"], "'data' is not an absolute path"),
    (["--container-image=tiny:1", "--container-workdir=work"], "give an absolute path inside"),
    (["--container-mounts=/data"], "--container-mounts needs an image to run in; add "
                                   "#SBATCH --container-image=IMAGE"),
    (["--container-image=tiny:1", "--image=docker:tiny:2"], "two different images; give one"),
])
def test_container_lines_that_cannot_run_are_refused_at_their_line(lines, words):
    with pytest.raises(SbatchError) as e:
        sbatch(*lines)
    assert words in str(e.value)
