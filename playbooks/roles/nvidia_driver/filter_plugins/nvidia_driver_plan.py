"""Ansible filter: the NVIDIA driver role's decisions as one pure function of host facts.

`observed | nvidia_driver_plan(settings)` answers which repository and packages a host needs,
whether it needs fabric manager (and at which exact version), what to hold, and whether a
reboot is due. No I/O: the role's tasks carry the plan out, tests check it with plain data.
"""

from __future__ import annotations

REDHAT_LIKE = {"RedHat", "Rocky", "AlmaLinux", "OracleLinux", "CentOS"}
CUDA_REPO_DIRS = {
    ("Ubuntu", "22"): "ubuntu2204",
    ("Ubuntu", "24"): "ubuntu2404",
    ("Debian", "12"): "debian12",
}
ARCH_DIRS = {"x86_64": "x86_64", "aarch64": "sbsa"}


def _platform(observed):
    """(family, cuda repo dir) for a supported platform, else (None, reason)."""
    dist = observed.get("distribution", "")
    major = str(observed.get("distribution_major_version", ""))
    if (dist, major) in CUDA_REPO_DIRS:
        return ("apt", CUDA_REPO_DIRS[(dist, major)])
    if dist in REDHAT_LIKE and major == "9":
        return ("dnf", "rhel9")
    version = observed.get("distribution_version", major)
    return (None, f"{dist} {version} is not supported (Ubuntu 22.04/24.04, Debian 12, RHEL 9 family)")


def nvidia_driver_plan(observed, settings):
    """Decide what the role does on one host. `settings` holds the role's variables (no prefix)."""
    branch = str(settings["branch"])
    version = str(settings.get("version") or "")
    open_modules = settings.get("kernel_modules", "open") == "open"
    gpus = list(observed.get("gpus") or [])
    switches = list(observed.get("nvswitches") or [])
    plan = {
        "gpus": len(gpus),
        "nvswitches": len(switches),
        "install": False,
        "supported": True,
        "reason": "",
        "source": "",
        "repo": {},
        "cuda_repo": {},
        "packages": [],
        "fabricmanager": False,
        "fabricmanager_packages": [],
        "fabricmanager_version": "",
        "hold_pattern": "",
        "reboot": False,
        "reboot_reasons": [],
        "target_version": version,
    }
    if not gpus:
        plan["reason"] = "no NVIDIA GPU (PCI vendor 10de) on this host; nothing to do"
        return plan
    if version and not version.startswith(branch + "."):
        raise ValueError(
            f"nvidia_driver_version {version} is not on branch {branch}; "
            f"set nvidia_driver_branch to {version.split('.')[0]} or pick a {branch}.x version"
        )

    manager, repo_dir = _platform(observed)
    if manager is None:
        plan.update(supported=False, reason=repo_dir)
        return plan
    arch = ARCH_DIRS.get(observed.get("architecture", "x86_64"), "x86_64")
    kernel = observed.get("kernel", "")
    source = settings.get("source", "auto")
    if source == "auto":
        source = "distro" if observed.get("distribution") == "Ubuntu" else "cuda_repo"
    if source == "distro" and observed.get("distribution") != "Ubuntu":
        raise ValueError(
            f"nvidia_driver_source distro is only available on Ubuntu; "
            f"{observed.get('distribution')} gets the driver from NVIDIA's CUDA repository (cuda_repo)"
        )
    plan["source"] = source
    base = str(settings.get("cuda_repo_base", "https://developer.download.nvidia.com/compute/cuda/repos"))
    url = f"{base}/{repo_dir}/{arch}"
    if manager == "apt":
        cuda_repo = {"kind": "apt", "url": url, "keyring": f"{url}/cuda-keyring_1.1-1_all.deb"}
    else:
        cuda_repo = {"kind": "dnf", "url": url, "repo_file": f"{url}/cuda-{repo_dir}.repo"}
    plan["cuda_repo"] = cuda_repo  # the cuda role installs the toolkit from it
    if source == "cuda_repo":
        plan["repo"] = cuda_repo

    # Driver packages, pinned to the branch (and the exact version when one is given).
    if manager == "apt" and source == "distro":
        flavour = f"{branch}-server-open" if open_modules else f"{branch}-server"
        names = [f"nvidia-driver-{flavour}", f"nvidia-utils-{branch}-server"]
        packages = [f"{name}={version}-*" if version else name for name in names]
    elif manager == "apt":
        name = f"nvidia-open-{branch}" if open_modules else f"cuda-drivers-{branch}"
        packages = [f"linux-headers-{kernel}", f"{name}={version}-*" if version else name]
    else:
        stream = f"{branch}-open" if open_modules else f"{branch}-dkms"
        packages = [f"kernel-devel-{kernel}", "kernel-headers", f"@nvidia-driver:{stream}"]
    plan["packages"] = packages

    # Fabric manager: NVSwitch systems (HGX/DGX) need it at exactly the driver's version,
    # or CUDA fails with error 802 although nvidia-smi lists the GPUs.
    wanted_fm = settings.get("fabricmanager", "auto")
    plan["fabricmanager"] = bool(switches) if wanted_fm == "auto" else bool(wanted_fm)
    installed = str(observed.get("installed_driver_version") or "")
    loaded = str(observed.get("loaded_driver_version") or "")
    on_branch = installed.startswith(branch + ".")
    needs_install = not installed or not on_branch or bool(version and installed != version)
    plan["install"] = True
    plan["fabricmanager_version"] = version or ("" if needs_install else installed)
    if plan["fabricmanager"]:
        fm_version = plan["fabricmanager_version"] or "{driver_version}"
        if manager == "apt":
            plan["fabricmanager_packages"] = [
                f"nvidia-fabricmanager-{branch}={fm_version}-*",
                f"libnvidia-nscq-{branch}={fm_version}-*",
            ]
        else:
            plan["fabricmanager_packages"] = [
                f"nvidia-fabric-manager-{fm_version}",
                f"libnvidia-nscq-{fm_version}",
            ]
    # Packages to hold (regex over installed package names).
    plan["hold_pattern"] = "^(nvidia-|libnvidia-|cuda-drivers|nvidia_|kmod-nvidia)"

    reasons = []
    if not installed:
        reasons.append(f"driver {branch} will be installed")
    elif not on_branch:
        reasons.append(f"installed driver {installed} is not on branch {branch}")
    elif version and installed != version:
        reasons.append(f"installed driver {installed} differs from the pinned {version}")
    if observed.get("nouveau_loaded"):
        reasons.append("nouveau is loaded and must be unloaded")
    if loaded and installed and loaded != installed and not needs_install:
        reasons.append(f"loaded driver {loaded} differs from the installed {installed}")
    plan["reboot_reasons"] = reasons
    plan["reboot"] = bool(reasons)
    return plan


class FilterModule:
    def filters(self):
        return {"nvidia_driver_plan": nvidia_driver_plan}
