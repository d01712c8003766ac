#!/usr/bin/python
"""GPU facts for flodl fleets: what this box can offer, read from the vendor tools."""

from __future__ import annotations

DOCUMENTATION = r"""
module: gpu_facts
short_description: Report the GPUs of a box (vendor, name, arch, memory)
description:
  - Reads C(nvidia-smi) and C(rocm-smi) when they are installed and returns what they report
    as facts. On a box with neither (or with no GPU), the facts are empty and the module does
    not fail, so it can run on every host of a fleet.
  - C(flodl_gpu_variant) suggests a torch variant for the box (C(cu128) for NVIDIA, C(rocmX.Y) for AMD,
    C(cpu) otherwise); the worker role uses it for C(flodl_worker_libtorch=auto).
version_added: "0.1.0"
options: {}
author: flodl fleet maintainers (@flodl)
"""

EXAMPLES = r"""
- name: Learn the GPUs
  flodl.cluster.gpu_facts:

- name: Show them
  ansible.builtin.debug:
    var: ansible_facts.flodl_gpus
"""

RETURN = r"""
ansible_facts:
  description: The box's GPUs.
  returned: always
  type: dict
  contains:
    flodl_gpus:
      description:
        - One entry per GPU, in the vendor tool's index order.
        - C(arch) is spelled as torch spells it (C(sm_80), C(gfx90a)); empty when the tool does not say.
      type: list
      elements: dict
      sample:
        - {"index": 0, "vendor": "nvidia", "name": "NVIDIA A100", "memory_mib": 81920, "arch": "sm_80"}
    flodl_gpu_count:
      description: How many GPUs the box has.
      type: int
    flodl_gpu_vendor:
      description: C(nvidia), C(amd), C(mixed), or an empty string on a CPU box.
      type: str
    flodl_gpu_variant:
      description: A torch variant that covers this box.
      type: str
"""

import json
import re
from typing import Any

from ansible.module_utils.basic import AnsibleModule

NVIDIA_QUERY = "index,name,memory.total,compute_cap"
NVIDIA_FORMAT = "csv,noheader,nounits"
ROCM_QUERY = ["--showproductname", "--showmeminfo", "vram", "--json"]
CUDA_VARIANT = "cu128"  # covers sm_50..sm_120 in current torch builds

# The parsers are a copy of flodl_agent.hardware.gpus' (this module runs where the package is not
# installed); tests/unit/test_collection.py holds the two to the same answers.


def parse_nvidia(text: str) -> list[dict[str, Any]]:
    gpus = []
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) < 4 or not parts[0].isdigit():
            continue
        memory = int(float(parts[-2])) if re.fullmatch(r"[0-9.]+", parts[-2]) else None
        cap = re.fullmatch(r"(\d+)\.(\d+)", parts[-1])
        arch = f"sm_{cap.group(1)}{cap.group(2)}" if cap else ""
        name = ", ".join(parts[1:-2])  # a name may hold a comma; the other columns never do
        gpus.append(
            {"index": int(parts[0]), "vendor": "nvidia", "name": name, "memory_mib": memory, "arch": arch}
        )
    return gpus


def parse_rocm(text: str) -> list[dict[str, Any]]:
    try:
        data = json.loads(text)
    except ValueError:
        return []
    if not isinstance(data, dict):
        return []
    gpus = []
    for card, info in data.items():
        match = re.fullmatch(r"card(\d+)", card)
        if not match or not isinstance(info, dict):
            continue
        name = info.get("Card Series") or info.get("Card series") or info.get("Card model") or ""
        arch = str(info.get("GFX Version") or "").strip().split(":", maxsplit=1)[0]  # gfx90a:xnack- is gfx90a
        memory = info.get("VRAM Total Memory (B)")
        gpus.append(
            {
                "index": int(match.group(1)),
                "vendor": "amd",
                "name": str(name),
                "memory_mib": int(memory) // (1024 * 1024) if str(memory).isdigit() else None,
                "arch": arch,
            }
        )
    return sorted(gpus, key=lambda g: g["index"])  # card10 after card9


def rocm_variant(version_text: str) -> str:
    match = re.search(r"(\d+)\.(\d+)", version_text)
    return f"rocm{match.group(1)}.{match.group(2)}" if match else "rocm6.4"


def summarize(gpus: list[dict[str, Any]], rocm_version: str = "") -> dict[str, Any]:
    vendors = sorted({g["vendor"] for g in gpus})
    vendor = vendors[0] if len(vendors) == 1 else ("mixed" if vendors else "")
    variant = {"nvidia": CUDA_VARIANT, "amd": rocm_variant(rocm_version)}.get(vendor, "cpu")
    return {
        "flodl_gpus": gpus,
        "flodl_gpu_count": len(gpus),
        "flodl_gpu_vendor": vendor,
        "flodl_gpu_variant": variant,
    }


def main() -> None:
    module = AnsibleModule(argument_spec={}, supports_check_mode=True)
    gpus: list[dict[str, Any]] = []
    nvidia = module.get_bin_path("nvidia-smi")
    if nvidia:
        query = [nvidia, f"--query-gpu={NVIDIA_QUERY}", f"--format={NVIDIA_FORMAT}"]
        rc, out, _err = module.run_command(query)
        if rc == 0:
            gpus += parse_nvidia(out)
    rocm = module.get_bin_path("rocm-smi")
    version = ""
    if rocm:
        rc, out, _err = module.run_command([rocm, *ROCM_QUERY])
        if rc == 0:
            gpus += parse_rocm(out)
        rc, out, _err = module.run_command([rocm, "--showdriverversion", "--json"])
        version = out if rc == 0 else ""
    module.exit_json(changed=False, ansible_facts=summarize(gpus, version))


if __name__ == "__main__":
    main()
