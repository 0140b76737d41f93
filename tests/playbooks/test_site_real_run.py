"""A real run of site.yml against the throwaway Debian target, then a second run that changes nothing."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from click.testing import CliRunner

from scheduler.bootstrap import bootstrap, inventory_from_document, run_bootstrap

pytestmark = pytest.mark.timeout(300)

WHEELHOUSE_ENV = {"PIP_NO_INDEX": "1", "PIP_FIND_LINKS": "/var/cache/trainyard-wheels"}
NFS_MOUNT = {
    "src": "nfs.example.internal:/export/datasets",
    "path": "/datasets",
    "opts": "ro,hard,_netdev,nofail",
}


def _extravars(target) -> dict:
    return {
        **target.ssh_vars(),
        "common_trainyard_ssh_public_key": target.public_key,
        # The namespace has no route out: the agent's wheel comes from the image's wheelhouse.
        "trainyard_node_pip_env": WHEELHOUSE_ENV,
        "storage_nfs_mounts": [NFS_MOUNT],
    }


def _host_sysctl(name: str) -> str:
    return Path("/proc/sys", *name.split(".")).read_text().strip()


@pytest.fixture(scope="module")
def runs(target, tmp_path_factory):
    """site.yml applied twice for real; both results, events and the daemon calls recorded."""
    events = tmp_path_factory.mktemp("events")
    calls: list[tuple] = []
    lines: list[dict] = []
    host_before = _host_sysctl("vm.max_map_count")
    inventory = inventory_from_document(target.document())
    first = run_bootstrap(
        inventory,
        extravars=_extravars(target),
        events_path=events / "first.jsonl",
        node_bootstrap=lambda *args: calls.append(args),
        progress=lines.append,
    )
    second = run_bootstrap(
        inventory, extravars=_extravars(target), events_path=events / "second.jsonl"
    )
    return {
        "first": first,
        "second": second,
        "calls": calls,
        "lines": lines,
        "events": events,
        "host_before": host_before,
    }


def test_first_run_succeeds_and_changes_the_node(runs):
    node = runs["first"].hosts["node-a"]
    assert runs["first"].succeeded, runs["first"].to_json()
    assert (
        node.outcome == "changed"
        and node.changed > 0
        and node.failed == 0
        and node.unreachable == 0
    )


def test_second_run_changes_nothing(runs):
    node = runs["second"].hosts["node-a"]
    assert runs["second"].succeeded, runs["second"].to_json()
    assert node.changed == 0, [
        line for line in open(runs["second"].events_path) if '"changed"' in line
    ]
    assert node.ok > 0


def test_trainyard_user_logs_in_with_the_daemons_key(runs, target, tmp_path):
    passwd = (target.root / "etc/passwd").read_text()
    assert any(
        line.startswith("trainyard:") and line.endswith(":/bin/bash")
        for line in passwd.splitlines()
    )
    keys = target.root / "home/trainyard/.ssh/authorized_keys"
    assert keys.read_text() == target.public_key + "\n"
    assert oct(keys.stat().st_mode & 0o777) == "0o600"
    assert oct(keys.parent.stat().st_mode & 0o777) == "0o700"
    # The real proof: the daemon's private key opens a session as trainyard.
    daemon_key = target.private_key.with_name("daemon_ed25519")
    login = target.run("id -un")  # sanity: admin access still works
    assert login.returncode == 0
    as_trainyard = type(target)(
        **{**target.__dict__, "user": "trainyard", "private_key": daemon_key}
    )
    whoami = as_trainyard.run("id -un; ulimit -l")
    assert whoami.returncode == 0, whoami.stderr
    assert whoami.stdout.split()[0] == "trainyard"


def test_job_and_scratch_directories_belong_to_trainyard(runs, target):
    for path in ("var/lib/trainyard/jobs", "scratch/trainyard"):
        listing = target.run(f"stat -c %U:%G:%a /{path}")
        assert listing.stdout.strip() == "trainyard:trainyard:750", (path, listing.stderr)


def test_training_limits_and_kernel_settings_are_written(runs, target):
    limits = (target.root / "etc/security/limits.d/90-trainyard.conf").read_text()
    assert "*    hard    memlock    unlimited" in limits
    manager = (target.root / "etc/systemd/system.conf.d/90-trainyard-limits.conf").read_text()
    assert "DefaultLimitMEMLOCK=infinity" in manager
    assert (
        "vm.max_map_count = 1048576" in (target.root / "etc/sysctl.d/90-trainyard.conf").read_text()
    )


def test_the_test_machine_kernel_is_untouched(runs):
    # The target shares this kernel: sysctl --system must not have run there.
    assert _host_sysctl("vm.max_map_count") == runs["host_before"]


def test_agent_can_import_pynvml_with_system_python(runs, target):
    probe = target.run(
        "python3 -c 'import pynvml, sys; print(sys.version_info[0], pynvml.__name__)'",
        as_user="trainyard",
    )
    assert probe.returncode == 0, probe.stderr
    assert probe.stdout.split() == ["3", "pynvml"]


def test_node_description_carries_the_inventory_labels(runs, target):
    node = json.loads((target.root / "etc/trainyard/node.json").read_text())
    assert node == {
        "name": "node-a",
        "pool": "h100",
        "provider": "onprem",
        "gpu_model": "H100",
        "gpu_count": 8,
        "labels": {"rack": "r12", "fabric": "ib"},
    }


def test_nfs_mount_is_declared_for_boot(runs, target):
    fstab = (target.root / "etc/fstab").read_text()
    assert "nfs.example.internal:/export/datasets /datasets nfs ro,hard,_netdev,nofail 0 0" in fstab
    assert (target.root / "datasets").is_dir()


def test_host_without_gpu_gets_no_driver(runs, target):
    assert not (target.root / "etc/modprobe.d/blacklist-nouveau.conf").exists()
    first_events = [json.loads(line) for line in open(runs["first"].events_path)]
    plan = [e for e in first_events if e.get("task") == "Show the driver plan"]
    assert plan and plan[0]["status"] == "ok"


def test_progress_streams_each_task_per_host_and_the_daemon_hears_start_and_done(runs):
    tasks = [r for r in runs["lines"] if r["type"] == "task"]
    assert {
        "host": "node-a",
        "role": "common",
        "task": "Create the trainyard user",
        "status": "changed",
    }.items() <= next(r for r in tasks if r["task"] == "Create the trainyard user").items()
    assert runs["lines"][-1]["type"] == "stats"
    assert runs["calls"] == [("node-a", "start", ""), ("node-a", "done", "")]
    on_disk = [json.loads(line) for line in open(runs["first"].events_path)]
    assert len(on_disk) == len(runs["lines"])


def test_unreachable_host_is_reported_with_its_error(target):
    calls = []
    doc = target.document(name="node-gone", ssh_port=2222)
    result = run_bootstrap(
        inventory_from_document(doc),
        extravars=_extravars(target),
        node_bootstrap=lambda *args: calls.append(args),
    )
    node = result.hosts["node-gone"]
    assert not result.succeeded
    assert node.outcome == "unreachable"
    assert "Connection refused" in node.first_error or "port 2222" in node.first_error
    assert calls[0] == ("node-gone", "start", "")
    assert calls[-1][:2] == ("node-gone", "failed")


def test_cli_check_mode_after_bootstrap_reports_no_changes(runs, target, tmp_path):
    doc = tmp_path / "inventory.json"
    doc.write_text(json.dumps(target.document()))
    pub = tmp_path / "daemon.pub"
    pub.write_text(target.public_key + "\n")
    result = CliRunner().invoke(
        bootstrap,
        [
            "--inventory",
            str(doc),
            "--check",
            "--json",
            "--ssh-public-key",
            str(pub),
            "--private-key",
            str(target.private_key),
            "--known-hosts",
            str(target.known_hosts),
            "--events",
            str(tmp_path / "events.jsonl"),
            "-e",
            "trainyard_node_pip_env=" + json.dumps(WHEELHOUSE_ENV),
            "-e",
            "storage_nfs_mounts=" + json.dumps([NFS_MOUNT]),
        ],
        env={**os.environ, "TRAINYARD_HOME": str(tmp_path / "home")},
    )
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["check"] is True
    changed = [line for line in open(tmp_path / "events.jsonl") if '"status": "changed"' in line]
    assert summary["hosts"]["node-a"]["changed"] == 0, changed
    assert summary["hosts"]["node-a"]["outcome"] == "ok"
