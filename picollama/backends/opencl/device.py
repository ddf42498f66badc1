"""Which OpenCL device to run on, and what it offers.

``select_device(cl, spec)`` picks a device by ``spec``:

- ``None``: the ``PYOPENCL_CTX`` environment variable if set (same forms as below), else
  the first GPU or accelerator of any platform, else the first device (PoCL's CPU device
  when that is all there is);
- an ``int`` n: the n-th device of all platforms' devices in order (``describe_devices``
  lists them; a ``BackendError`` for a device not found shows the list), as the CUDA
  backend's ``device=n``;
- ``"P:D"`` or a digit string ``"P"``: device D (default 0) of platform P, as pyopencl's
  ``PYOPENCL_CTX``;
- any other string: the first device whose platform or device name, vendor or version
  contains it, ignoring case (``"pocl"``, ``"nvidia"``, ``"gfx1100"``).

``DeviceInfo`` holds what the kernels need to know: the optional features they use when
the device reports them (``cl_khr_fp64``, hardware FMA) and the limits that decide whether
a model fits (global memory, the largest single buffer).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from picollama.backends.base import BackendError

__all__ = ["DeviceInfo", "list_devices", "select_device", "describe_devices"]


@dataclass(frozen=True)
class DeviceInfo:
    """An OpenCL device and the facts about it that the backend uses."""

    device: object  # pyopencl.Device
    platform_name: str
    name: str
    kind: str  # "CPU", "GPU", "accelerator"
    version: str
    compute_units: int
    global_mem: int  # bytes
    max_alloc: int  # bytes of the largest single buffer
    local_mem: int  # bytes per work-group
    max_work_group: int
    little_endian: bool
    fp64: bool  # cl_khr_fp64 (or a double config)
    fp16: bool  # cl_khr_fp16: reported, not used (see common.cl)
    subgroups: bool  # cl_khr_subgroups or cl_intel_subgroups: reported, not used
    fma: bool  # single precision fma in hardware (CL_FP_FMA)
    search_text: str = ""  # names, vendors and versions, lower case: what a name spec matches

    @property
    def is_cpu(self) -> bool:
        return self.kind == "CPU"

    @property
    def label(self) -> str:
        return f"{self.platform_name} / {self.name} ({self.kind})"


def _kind(cl, device) -> str:
    t = device.type
    if t & cl.device_type.GPU:
        return "GPU"
    if t & cl.device_type.ACCELERATOR:
        return "accelerator"
    if t & cl.device_type.CPU:
        return "CPU"
    return "other"


def _info(cl, platform, device) -> DeviceInfo:
    exts = set(device.extensions.split())
    try:
        fp_config = int(device.single_fp_config)
    except cl.Error:
        fp_config = 0
    try:
        double_config = int(device.double_fp_config)
    except cl.Error:
        double_config = 0
    names = (platform.name, platform.vendor, platform.version, device.name, device.vendor)
    return DeviceInfo(
        device=device,
        platform_name=platform.name.strip(),
        name=device.name.strip(),
        kind=_kind(cl, device),
        version=device.version.strip(),
        compute_units=int(device.max_compute_units),
        global_mem=int(device.global_mem_size),
        max_alloc=int(device.max_mem_alloc_size),
        local_mem=int(device.local_mem_size),
        max_work_group=int(device.max_work_group_size),
        little_endian=bool(device.endian_little),
        fp64="cl_khr_fp64" in exts or double_config != 0,
        fp16="cl_khr_fp16" in exts,
        subgroups=bool(exts & {"cl_khr_subgroups", "cl_intel_subgroups"}),
        fma=bool(fp_config & int(cl.device_fp_config.FMA)),
        search_text=" / ".join(n.strip() for n in names).lower(),
    )


def list_devices(cl) -> list[tuple[int, int, DeviceInfo]]:
    """(platform index, device index, info) of every device of every platform."""
    try:
        platforms = cl.get_platforms()
    except cl.Error as err:  # the ICD loader's "no platform" (PLATFORM_NOT_FOUND_KHR)
        raise BackendError(f"no OpenCL platform is installed ({err})") from None
    found = []
    for p_i, platform in enumerate(platforms):
        try:
            devices = platform.get_devices()
        except cl.Error:  # a platform with no devices raises DEVICE_NOT_FOUND
            continue
        for d_i, device in enumerate(devices):
            found.append((p_i, d_i, _info(cl, platform, device)))
    return found


def describe_devices(found: list[tuple[int, int, DeviceInfo]]) -> str:
    """One line: "n = platform:device name; ..." for every device."""
    items = [f"{n} = {p}:{d} {info.label}" for n, (p, d, info) in enumerate(found)]
    return "; ".join(items) if items else "none"


def select_device(cl, spec: int | str | None = None) -> DeviceInfo:
    """The device that ``spec`` names (see the module docstring); ``BackendError`` if none."""
    found = list_devices(cl)
    if not found:
        raise BackendError(
            "no OpenCL device found: install a GPU driver's OpenCL runtime, or PoCL for the "
            "CPU (pip install 'picollama[opencl]')"
        )
    if spec is None:
        spec = os.environ.get("PYOPENCL_CTX") or None
    if spec is None:
        for _, _, info in found:
            if info.kind in ("GPU", "accelerator"):
                return info
        return found[0][2]
    if isinstance(spec, int) or (isinstance(spec, str) and spec.strip().isdigit()):
        n = int(spec)
        if isinstance(spec, str):  # "P": a platform index, as PYOPENCL_CTX has it
            for p, _, info in found:
                if p == n:
                    return info
        elif 0 <= n < len(found):
            return found[n][2]
    elif ":" in spec and all(part.strip().isdigit() for part in spec.split(":", 1)):
        p_want, d_want = (int(part) for part in spec.split(":", 1))
        for p, d, info in found:
            if (p, d) == (p_want, d_want):
                return info
    else:
        needle = spec.strip().lower()
        for _, _, info in found:
            if needle in info.search_text:
                return info
    raise BackendError(
        f"OpenCL device {spec!r} not found; the devices here are: {describe_devices(found)}"
    )
