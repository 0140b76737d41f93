"""The nvidia_driver role's decisions per distribution and GPU layout, from supplied facts, in check mode."""

from __future__ import annotations

from pathlib import Path

import pytest

from scheduler.bootstrap import PLAYBOOKS, run_bootstrap

pytestmark = pytest.mark.timeout(180)

HERE = Path(__file__).resolve().parent
GPU = {"address": "0000:18:00.0", "device": "0x2330", "class": "0x030200"}  # H100 SXM
SWITCH = {"address": "0000:05:00.0", "device": "0x22a3", "class": "0x068000"}  # NVSwitch


def observed(dist, major, version, *, gpus=8, switches=0, installed="", loaded="", nouveau=False):
    return {
        "distribution": dist,
        "distribution_major_version": major,
        "distribution_version": version,
        "architecture": "x86_64",
        "kernel": "5.14.0-427.el9.x86_64" if major == "9" else "6.8.0-45-generic",
        "gpus": [GPU] * gpus,
        "nvswitches": [SWITCH] * switches,
        "installed_driver_version": installed,
        "loaded_driver_version": loaded,
        "nouveau_loaded": nouveau,
    }


HOSTS = {
    "ubuntu2404-hgx-new": {
        "nvidia_driver_observed": observed("Ubuntu", "24", "24.04", switches=4, nouveau=True)
    },
    "ubuntu2204-pcie-current": {
        "nvidia_driver_observed": observed(
            "Ubuntu", "22", "22.04", gpus=2, installed="580.95.05", loaded="580.95.05"
        )
    },
    "debian12-hgx-pinned-upgrade": {
        "nvidia_driver_version": "580.95.05",
        "nvidia_driver_observed": observed(
            "Debian", "12", "12.7", switches=4, installed="570.172.08", loaded="570.172.08"
        ),
    },
    "rocky9-hgx-pending-reboot": {
        "nvidia_driver_observed": observed(
            "Rocky", "9", "9.4", switches=6, installed="580.95.05", loaded="580.82.07"
        )
    },
    "rhel9-proprietary": {
        "nvidia_driver_kernel_modules": "proprietary",
        "nvidia_driver_observed": observed("RedHat", "9", "9.4", gpus=4),
    },
    "ubuntu2404-cpu-only": {"nvidia_driver_observed": observed("Ubuntu", "24", "24.04", gpus=0)},
    "ubuntu2004-gpu": {"nvidia_driver_observed": observed("Ubuntu", "20", "20.04")},
}


@pytest.fixture(scope="module")
def plans():
    """One check-mode run over every scenario; the plan each host's set_fact produced."""
    # TEST-NET address: if any task tried to reach a host, it would fail as unreachable.
    hostvars = {
        name: {**v, "ansible_host": "192.0.2.1", "ansible_ssh_common_args": "-o ConnectTimeout=2"}
        for name, v in HOSTS.items()
    }
    found: dict[str, dict] = {}
    messages: dict[str, str] = {}

    def on_event(event):
        data = event.get("event_data") or {}
        res = data.get("res") or {}
        if event.get("event") == "runner_on_ok" and "nvidia_driver_plan" in res.get(
            "ansible_facts", {}
        ):
            found[data["host"]] = res["ansible_facts"]["nvidia_driver_plan"]
        if event.get("event") == "runner_on_ok" and data.get("task") == "Show the driver plan":
            messages[data["host"]] = res.get("msg", "")

    result = run_bootstrap(
        {"all": {"hosts": hostvars}},
        playbook=HERE / "driver_plan.yml",
        check=True,
        envvars={"ANSIBLE_ROLES_PATH": str(PLAYBOOKS / "roles")},
        on_event=on_event,
    )
    return {"result": result, "plan": found, "msg": messages}


def test_no_host_is_contacted(plans):
    assert all(h.unreachable == 0 for h in plans["result"].hosts.values())
    assert plans["result"].check is True


def test_ubuntu_hgx_gets_server_open_driver_and_fabric_manager_matched_to_it(plans):
    plan = plans["plan"]["ubuntu2404-hgx-new"]
    assert plan["source"] == "distro"
    assert plan["packages"] == ["nvidia-driver-580-server-open", "nvidia-utils-580-server"]
    assert plan["fabricmanager"] is True
    # Version unknown until the driver is installed: the role fills the exact installed version in.
    assert plan["fabricmanager_packages"] == [
        "nvidia-fabricmanager-580={driver_version}-*",
        "libnvidia-nscq-580={driver_version}-*",
    ]
    assert plan["reboot"] is True
    assert "nouveau is loaded and must be unloaded" in plan["reboot_reasons"]


def test_pcie_host_with_current_driver_needs_no_fabric_manager_and_no_reboot(plans):
    plan = plans["plan"]["ubuntu2204-pcie-current"]
    assert plan["gpus"] == 2 and plan["nvswitches"] == 0
    assert plan["fabricmanager"] is False and plan["fabricmanager_packages"] == []
    assert plan["reboot"] is False
    assert "reboot no" in plans["msg"]["ubuntu2204-pcie-current"]


def test_debian_uses_cuda_repo_and_pins_driver_and_fabric_manager_to_one_version(plans):
    plan = plans["plan"]["debian12-hgx-pinned-upgrade"]
    assert plan["source"] == "cuda_repo"
    assert plan["repo"]["keyring"] == (
        "https://developer.download.nvidia.com/compute/cuda/repos/debian12/x86_64/cuda-keyring_1.1-1_all.deb"
    )
    assert plan["packages"] == ["linux-headers-6.8.0-45-generic", "nvidia-open-580=580.95.05-*"]
    assert plan["fabricmanager_packages"] == [
        "nvidia-fabricmanager-580=580.95.05-*",
        "libnvidia-nscq-580=580.95.05-*",
    ]
    assert plan["reboot"] is True
    assert plan["reboot_reasons"] == ["installed driver 570.172.08 is not on branch 580"]


def test_rhel_family_uses_module_stream_and_reboots_when_loaded_driver_is_stale(plans):
    plan = plans["plan"]["rocky9-hgx-pending-reboot"]
    assert plan["repo"]["repo_file"].endswith("/rhel9/x86_64/cuda-rhel9.repo")
    assert plan["packages"][-1] == "@nvidia-driver:580-open"
    assert plan["fabricmanager_packages"] == [
        "nvidia-fabric-manager-580.95.05",
        "libnvidia-nscq-580.95.05",
    ]
    assert plan["reboot_reasons"] == [
        "loaded driver 580.82.07 differs from the installed 580.95.05"
    ]


def test_proprietary_modules_select_the_dkms_stream(plans):
    plan = plans["plan"]["rhel9-proprietary"]
    assert plan["packages"] == [
        "kernel-devel-5.14.0-427.el9.x86_64",
        "kernel-headers",
        "@nvidia-driver:580-dkms",
    ]
    assert plan["fabricmanager"] is False


def test_host_without_gpu_is_left_alone(plans):
    plan = plans["plan"]["ubuntu2404-cpu-only"]
    assert plan["install"] is False and plan["packages"] == [] and plan["reboot"] is False
    assert plans["msg"]["ubuntu2404-cpu-only"] == "no NVIDIA GPU: nothing to do"
    assert plans["result"].hosts["ubuntu2404-cpu-only"].outcome == "ok"


def test_unsupported_distribution_with_gpu_fails_with_the_reason(plans):
    host = plans["result"].hosts["ubuntu2004-gpu"]
    assert host.outcome == "failed"
    assert (
        "Ubuntu 20.04 is not supported (Ubuntu 22.04/24.04, Debian 12, RHEL 9 family)"
        in host.first_error
    )
