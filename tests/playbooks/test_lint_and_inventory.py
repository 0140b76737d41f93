"""The playbooks pass ansible-lint's production profile and a syntax check; the inventory reads boundary 6."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from scheduler.bootstrap import PLAYBOOKS, BootstrapError, inventory_from_document

pytestmark = pytest.mark.timeout(180)

BIN = Path(sys.executable).parent
ENV = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}", "NO_COLOR": "1"}
ROLES = ["common", "nvidia_driver", "cuda", "container_toolkit", "storage", "trainyard_node"]

DOC = [
    {
        "name": "gpu-a1",
        "address": "10.0.1.11",
        "ssh_user": "ubuntu",
        "ssh_port": 22,
        "pool": "h100-spot",
        "provider": "aws",
        "gpu_model": "H100",
        "gpu_count": 8,
        "labels": {"capacity": "spot"},
    },
    {
        "name": "dgx-01",
        "address": "192.168.10.5",
        "ssh_user": "admin",
        "ssh_port": 2222,
        "pool": "dgx",
        "provider": "onprem",
        "gpu_model": "A100",
        "gpu_count": 8,
        "labels": {},
    },
]


def test_ansible_lint_production_profile_passes_without_skips():
    assert not (PLAYBOOKS / ".ansible-lint").read_text().count("skip_list")
    lint = subprocess.run(
        [str(BIN / "ansible-lint"), "--offline", "--profile", "production"],
        cwd=PLAYBOOKS,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=170,
    )
    assert lint.returncode == 0, lint.stdout[-3000:] + lint.stderr[-3000:]
    assert "Profile 'production' was required, and it passed" in lint.stderr + lint.stdout


def test_site_yml_passes_syntax_check():
    check = subprocess.run(
        [str(BIN / "ansible-playbook"), "--syntax-check", "-i", "localhost,", "site.yml"],
        cwd=PLAYBOOKS,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert check.returncode == 0, check.stdout + check.stderr


@pytest.mark.parametrize("role", ROLES)
def test_every_role_documents_its_variables_and_has_a_readme(role):
    base = PLAYBOOKS / "roles" / role
    defaults = (base / "defaults" / "main.yml").read_text()
    assert (base / "README.md").read_text().strip()
    # Every variable in defaults/main.yml sits in a paragraph that opens with a comment explaining it.
    lines = defaults.splitlines()
    variables = [i for i, ln in enumerate(lines) if ln[:1].isalpha()]
    assert variables, f"{role} documents no variables"
    for i in variables:
        name = lines[i].split(":")[0]
        assert name.startswith(f"{role}_"), f"{role}: variable {name} lacks the role prefix"
        paragraph_start = i
        while paragraph_start > 0 and lines[paragraph_start - 1].strip():
            paragraph_start -= 1
        assert lines[paragraph_start].startswith("#"), f"{role}: {name} has no comment above it"


def test_inventory_script_lists_hosts_with_connection_vars_and_groups(tmp_path):
    path = tmp_path / "inventory.json"
    path.write_text(json.dumps(DOC))
    listing = subprocess.run(
        [
            str(BIN / "ansible-inventory"),
            "-i",
            str(PLAYBOOKS / "inventory" / "trainyard_inventory.py"),
            "--list",
        ],
        env={**ENV, "TRAINYARD_INVENTORY": str(path)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert listing.returncode == 0, listing.stderr
    inv = json.loads(listing.stdout)
    dgx = inv["_meta"]["hostvars"]["dgx-01"]
    assert (dgx["ansible_host"], dgx["ansible_user"], dgx["ansible_port"]) == (
        "192.168.10.5",
        "admin",
        2222,
    )
    assert dgx["trainyard_gpu_count"] == 8 and dgx["trainyard_pool"] == "dgx"
    assert inv["pool_h100_spot"]["hosts"] == ["gpu-a1"]
    assert inv["provider_onprem"]["hosts"] == ["dgx-01"]


def test_inventory_script_names_the_missing_document(tmp_path):
    run = subprocess.run(
        [sys.executable, str(PLAYBOOKS / "inventory" / "trainyard_inventory.py"), "--list"],
        env={**ENV, "TRAINYARD_INVENTORY": str(tmp_path / "nope.json")},
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert run.returncode == 1
    assert f"inventory document {tmp_path / 'nope.json'} does not exist" in run.stderr


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"provider": "gcp"}, "node 'gpu-a1': provider 'gcp' is not one of aws, onprem"),
        ({"ssh_port": "22"}, "node 'gpu-a1': ssh_port must be a non-negative integer, got '22'"),
        ({"name": "dgx-01"}, "node name 'dgx-01' appears twice"),
    ],
)
def test_bad_inventory_documents_are_refused_with_the_node_and_field(change, message):
    doc = [{**DOC[0], **change}, DOC[1]]
    with pytest.raises(BootstrapError) as err:
        inventory_from_document(doc)
    assert str(err.value) == message


def test_inventory_document_lacking_fields_names_them():
    with pytest.raises(BootstrapError, match="node 'gpu-a1' lacks ssh_user, gpu_count"):
        inventory_from_document(
            [{k: v for k, v in DOC[0].items() if k not in ("ssh_user", "gpu_count")}]
        )
