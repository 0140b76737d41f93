#!/usr/bin/python
"""Ansible module: what the NVIDIA driver role must know about a host (PCI devices, modules)."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: nvidia_host_facts
short_description: Report NVIDIA PCI devices and driver module state
description:
  - Reads C(/sys/bus/pci/devices) for devices of vendor 10de (NVIDIA), separating GPUs
    (display and 3D controllers, PCI class 0x03) from NVSwitches (bridges, class 0x0680).
  - Reports whether nouveau is loaded, the version of the loaded nvidia module, and the
    version of the nvidia module installed for the running kernel (C(modinfo)).
  - Changes nothing; supports check mode.
options:
  sysfs:
    description: Root of sysfs (for tests).
    type: str
    default: /sys
author: trainyard
"""

RETURN = r"""
ansible_facts:
  description: C(nvidia_host) with C(gpus), C(nvswitches), C(nouveau_loaded),
    C(loaded_driver_version), C(installed_driver_version).
  returned: always
  type: dict
"""

import os  # noqa: E402

from ansible.module_utils.basic import AnsibleModule  # noqa: E402

NVIDIA_VENDOR = "0x10de"


def _read(path):
    try:
        with open(path, encoding="ascii", errors="replace") as fh:
            return fh.read().strip()
    except OSError:
        return ""


def pci_devices(sysfs):
    base = os.path.join(sysfs, "bus", "pci", "devices")
    gpus, switches = [], []
    try:
        names = sorted(os.listdir(base))
    except OSError:
        return gpus, switches
    for name in names:
        dev = os.path.join(base, name)
        if _read(os.path.join(dev, "vendor")).lower() != NVIDIA_VENDOR:
            continue
        pci_class = _read(os.path.join(dev, "class")).lower()
        entry = {"address": name, "device": _read(os.path.join(dev, "device")).lower(), "class": pci_class}
        if pci_class.startswith("0x03"):
            gpus.append(entry)
        elif pci_class.startswith("0x0680"):
            switches.append(entry)
    return gpus, switches


def main():
    module = AnsibleModule(argument_spec={"sysfs": {"type": "str", "default": "/sys"}}, supports_check_mode=True)
    sysfs = module.params["sysfs"]
    gpus, switches = pci_devices(sysfs)
    modules = _read("/proc/modules")
    loaded = {line.split(" ", 1)[0] for line in modules.splitlines() if line}
    installed = ""
    modinfo = module.get_bin_path("modinfo") or (os.path.exists("/sbin/modinfo") and "/sbin/modinfo")
    if modinfo:
        rc, out, _err = module.run_command([modinfo, "-F", "version", "nvidia"])
        if rc == 0:
            installed = out.strip()
    facts = {
        "gpus": gpus,
        "nvswitches": switches,
        "nouveau_loaded": "nouveau" in loaded,
        "loaded_driver_version": _read(os.path.join(sysfs, "module", "nvidia", "version")),
        "installed_driver_version": installed,
    }
    module.exit_json(changed=False, ansible_facts={"nvidia_host": facts})


if __name__ == "__main__":
    main()
