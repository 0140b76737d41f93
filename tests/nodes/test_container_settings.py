"""The daemon's [nodes] settings for container images (pull timeout, image cache size), their
errors, and the agent command line that carries them to every node."""

from __future__ import annotations

import pytest

from scheduler.nodes import SshSettings, SshTarget, agent_argv
from scheduler.settings import Settings, SettingsError


def nodes_table(**values) -> Settings:
    return Settings.from_toml({"nodes": values}, source="trainyard.toml")


def test_pull_timeout_and_image_cache_default_to_the_agents_own():
    nodes = nodes_table().nodes
    assert (nodes.pull_timeout, nodes.image_cache_gb) == (1800.0, 200.0)


def test_pull_timeout_reads_slurm_times_and_seconds():
    assert nodes_table(pull_timeout="30:00").nodes.pull_timeout == 1800.0
    assert nodes_table(pull_timeout=3).nodes.pull_timeout == 3.0
    assert nodes_table(image_cache_gb=50).nodes.image_cache_gb == 50.0


@pytest.mark.parametrize("values, words", [
    ({"pull_timeout": 0}, "nodes.pull_timeout: must be > 0, got 0"),
    ({"pull_timeout": "soon"}, "nodes.pull_timeout: cannot read 'soon' as a duration; use seconds"),
    ({"image_cache_gb": 0}, "nodes.image_cache_gb: must be > 0, got 0"),
    ({"image_cache_gb": "200G"}, "nodes.image_cache_gb: expected a number, got '200G'"),
])
def test_a_bad_pull_timeout_or_cache_size_is_named_with_its_value(values, words):
    with pytest.raises(SettingsError) as e:
        nodes_table(**values)
    assert words in str(e.value)


@pytest.mark.parametrize("privilege", ["login", "sudo"])
def test_the_agent_is_started_with_the_daemons_pull_timeout_and_cache_size(privilege):
    target = SshTarget("g1", "10.0.0.1", 22, "root", "/k", privilege=privilege)
    argv = agent_argv(target, SshSettings("/kh", pull_timeout_s=90, image_cache_gb=12.5),
                      "/b/agent.pyz", "/var/lib/trainyard")
    assert argv[argv.index("--pull-timeout") + 1] == "90"
    assert argv[argv.index("--image-cache-gb") + 1] == "12.5"
