"""The Pulumi program entry: stack config in, cluster and inventory exported, config errors without a trace."""

from __future__ import annotations

import json
from pathlib import Path

import pulumi
import pytest
from infra_helpers import aws_pool, onprem_pool, quiet_pulumi_aws, set_recording_mocks, stack_config

from infra.program import default_cluster_name, main


@pytest.fixture
def stack_cfg():
    def set_config(raw: dict) -> None:
        pulumi.runtime.set_all_config(
            {f"trainyard:{k}": (v if isinstance(v, str) else json.dumps(v)) for k, v in raw.items()}
        )

    yield set_config
    pulumi.runtime.set_all_config({})


def run_main(stack: str = "Prod_EU") -> list:
    mocks, monitor = set_recording_mocks(stack)

    @pulumi.runtime.test
    def run():
        main()

    with quiet_pulumi_aws():
        run()
    return list(monitor.get_registered_resources())


def test_the_program_builds_the_cluster_from_stack_config(stack_cfg):
    stack_cfg(stack_config(aws_pool("l4", "g6.xlarge", 2), onprem_pool()))
    urns = run_main()
    assert any(u.endswith("trainyard:infra:GpuCluster::prod-eu") for u in urns)
    assert sum(":Instance::" in u for u in urns) == 2


def test_a_config_error_stops_the_program_with_the_message_only(stack_cfg):
    stack_cfg(stack_config(aws_pool("l4", "g6.xlarge", -1)))
    with pytest.raises(pulumi.RunError) as info:
        run_main()
    assert "pools[0] (l4): count must be 0 or more, got -1" in str(info.value)
    assert info.value.__cause__ is None and info.value.__suppress_context__


def test_an_explicit_cluster_name_wins_over_the_stack_name(stack_cfg):
    stack_cfg(stack_config(onprem_pool(), clusterName="lab"))
    urns = run_main()
    assert urns == ["urn:pulumi:Prod_EU::trainyard::pulumi:pulumi:Stack$trainyard:infra:GpuCluster::lab"]


@pytest.mark.parametrize(("stack", "name"), [("dev", "dev"), ("Prod_EU", "prod-eu"), ("__", "trainyard"), ("x" * 40, "x" * 32)])
def test_stack_names_become_valid_cluster_names(stack, name):
    assert default_cluster_name(stack) == name


def test_the_project_file_runs_infra_and_the_example_stack_is_valid():
    import yaml

    from infra.config import parse_config

    root = Path(__file__).resolve().parents[2]
    project = yaml.safe_load((root / "Pulumi.yaml").read_text())
    assert project["name"] == "trainyard" and project["runtime"]["name"] == "python"
    assert (root / project["main"] / "__main__.py").is_file()
    example = yaml.safe_load((root / "Pulumi.example.yaml").read_text())["config"]
    raw = {k.split(":", 1)[1]: v for k, v in example.items() if k.startswith("trainyard:")}
    assert [p.name for p in parse_config(raw, default_name="example").pools] == ["h100", "l4", "lab"]
