"""The inventory output (DESIGN.md boundary 6): cloud and on-prem nodes in one document."""

from __future__ import annotations

import json

import pytest
from infra_helpers import build_cluster

from infra import inventory


def test_hybrid_inventory_lists_cloud_and_onprem_nodes_in_config_order(hybrid_config):
    nodes = build_cluster(hybrid_config).inventory

    assert inventory.problems(nodes) == []
    assert [n["name"] for n in nodes] == ["h100-0", "h100-1", "l4-0", "l4-1", "l4-2", "lab-gpu-01", "lab-gpu-02"]
    assert all(list(n) == list(inventory.FIELDS) for n in nodes)
    h100, l4, lab = nodes[0], nodes[2], nodes[5]
    assert h100 == {
        "name": "h100-0",
        "address": h100["address"],
        "ssh_user": "ubuntu",
        "ssh_port": 22,
        "pool": "h100",
        "provider": "aws",
        "gpu_model": "NVIDIA H100 80GB HBM3",
        "gpu_count": 8,
        "labels": {"instance-type": "p5.48xlarge", "capacity": "on-demand"},
    }
    assert h100["address"].startswith("203.0.113.")  # the Elastic IP of a multi-card node
    assert l4["address"].startswith("198.51.100.")  # the instance's own public address
    assert l4["labels"] == {"instance-type": "g6.xlarge", "capacity": "spot"}
    assert lab == {
        "name": "lab-gpu-01",
        "address": "10.1.2.11",
        "ssh_user": "ops",
        "ssh_port": 22,
        "pool": "lab",
        "provider": "onprem",
        "gpu_model": "NVIDIA A100-SXM4-80GB",
        "gpu_count": 8,
        "labels": {},
    }
    assert len({n["address"] for n in nodes}) == len(nodes)


def test_pool_labels_join_the_node_labels_and_win(hybrid_config):
    hybrid_config["pools"][1]["labels"] = {"team": "vision", "capacity": "preemptible"}
    nodes = build_cluster(hybrid_config).inventory
    assert nodes[2]["labels"] == {"instance-type": "g6.xlarge", "capacity": "preemptible", "team": "vision"}


def test_inventory_round_trips_through_a_file(tmp_path, hybrid_config):
    nodes = build_cluster(hybrid_config).inventory
    path = tmp_path / "inventory.json"
    inventory.write(path, nodes)
    assert inventory.load(path) == nodes
    assert json.loads(path.read_text()) == nodes


@pytest.mark.parametrize(
    ("doc", "problem"),
    [
        ({"name": "x"}, "an inventory is a JSON list of nodes"),
        ([{"name": "a"}], "[0] (a) lacks address, ssh_user"),
        ([dict.fromkeys(inventory.FIELDS, "") | {"name": "a", "provider": "gcp", "ssh_port": 22, "gpu_count": 0, "labels": {}, "address": "h"}],
         "provider must be aws or onprem"),
        ([dict.fromkeys(inventory.FIELDS, "") | {"name": "a", "provider": "aws", "ssh_port": "22", "gpu_count": 0, "labels": {}, "address": "h"}],
         "ssh_port and gpu_count must be whole numbers"),
    ],
)
def test_malformed_inventories_are_refused_with_the_reason(tmp_path, doc, problem):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match="is not a trainyard inventory") as info:
        inventory.load(path)
    assert problem in str(info.value)


def test_a_repeated_node_name_is_a_problem(hybrid_config):
    nodes = build_cluster(hybrid_config).inventory
    assert inventory.problems([nodes[0], nodes[0]]) == ["[1] repeats the node name 'h100-0'"]


def test_the_playbooks_inventory_reads_the_document_as_exported(hybrid_config):
    from scheduler.bootstrap import inventory_from_document

    nodes = build_cluster(hybrid_config).inventory
    hosts = inventory_from_document(nodes)["all"]["hosts"]
    assert list(hosts) == [n["name"] for n in nodes]
    assert hosts["lab-gpu-01"]["ansible_host"] == "10.1.2.11" and hosts["lab-gpu-01"]["ansible_user"] == "ops"
    assert hosts["h100-0"]["ansible_host"] == nodes[0]["address"]
