"""A verl platform for CPU cores, so that verl's own workers train in tests and on CPU-only nodes.

verl 0.9.1 ships platforms for CUDA, ROCm and NPU only. Selected with ``VERL_PLATFORM=inharness-cpu``
(the verl engine sets it in its Ray workers when the run has no GPUs); registering it changes nothing
for a GPU run. What it does, each pinned by tests/trainer/test_verl_cpu_platform.py so that a verl
upgrade that moves these seams fails loudly:

- the device is ``cpu``; the device module is `torch.cpu` plus the memory statistics verl reads
  (zeros: CPU memory is not the accelerator memory they describe) and a device name ``CPU``;
- the collective backend is gloo, and verl's ``cpu:gloo,cpu:gloo`` (CPU part and device part both
  gloo) reaches `torch.distributed.init_process_group` as plain ``gloo``;
- Ray resources: none per worker (verl asks for 0 accelerators through ``ray_resource_options``).
"""

from __future__ import annotations

import contextlib
import functools
import sys
import types
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed
from verl.plugin.platform.platform_base import PlatformBase
from verl.plugin.platform.platform_manager import PlatformRegistry

NAME = "inharness-cpu"
"""The ``VERL_PLATFORM`` value that selects this platform."""


def _zero(*_args: Any, **_kwargs: Any) -> int:
    return 0


def _nothing(*_args: Any, **_kwargs: Any) -> None:
    return None


def _mem_get_info(*_args: Any) -> tuple[int, int]:
    import psutil

    memory = psutil.virtual_memory()
    return memory.available, memory.total


def _device_module() -> types.ModuleType:
    """`torch.cpu` with the CUDA-style calls verl makes on its device module."""
    module = types.ModuleType("inharness_cpu_device")
    for name in ("memory_allocated", "max_memory_allocated", "memory_reserved", "max_memory_reserved"):
        setattr(module, name, _zero)
    for name in ("empty_cache", "reset_peak_memory_stats", "set_device", "ipc_collect"):
        setattr(module, name, _nothing)
    module.mem_get_info = _mem_get_info
    module.get_device_name = lambda *_args: "CPU"
    module.is_available = lambda: True
    module.device_count = lambda: 1
    module.current_device = lambda: "cpu"
    module.manual_seed = torch.manual_seed
    module.manual_seed_all = torch.manual_seed
    module.synchronize = torch.cpu.synchronize
    module.get_rng_state = torch.get_rng_state  # checkpoints save the "device" RNG beside the CPU's
    module.set_rng_state = torch.set_rng_state
    module.__getattr__ = functools.partial(getattr, torch.cpu)  # anything else: torch.cpu's own
    return module


_DEVICE = _device_module()


@PlatformRegistry.register(platform=NAME)
class PlatformCPU(PlatformBase):
    @property
    def device_name(self) -> str:
        return "cpu"

    @property
    def vendor_name(self) -> str:
        return "cpu"

    @property
    def device_module(self) -> types.ModuleType:
        return _DEVICE

    def is_available(self) -> bool:
        return True

    def is_platform_available(self, use_smi_check: bool = False) -> bool:
        return False  # never auto-detected: only VERL_PLATFORM selects it

    def current_device(self) -> Any:
        return "cpu"

    def device_count(self) -> int:
        return 1

    def set_device(self, device_index: int) -> None:
        return None

    def synchronize(self, device_index: int | None = None) -> None:
        return None

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings: str) -> None:
        return None

    def empty_cache(self) -> None:
        return None

    def get_device_capability(self, device_index: int = 0) -> tuple[int | None, int | None]:
        return None, None

    def communication_backend_name(self) -> str:
        return "gloo"

    def visible_devices_envvar(self) -> str:
        return "INHARNESS_CPU_VISIBLE_DEVICES"

    @contextlib.contextmanager
    def nvtx_range(self, msg: str) -> Iterator[None]:
        yield

    def profiler_start(self) -> None:
        return None

    def profiler_stop(self) -> None:
        return None

    def ray_resource_name(self) -> str:
        return "CPU"

    def ray_resource_options(self, num_gpus: float) -> dict[str, Any]:
        return {}

    def ray_noset_envvars(self) -> list[str]:
        return []

    def is_ipc_supported(self) -> bool:
        return False

    def cudart(self) -> Any:
        return None


def gloo_backend(backend: str | None) -> str | None:
    """``cpu:gloo,cpu:gloo`` -> ``gloo``: torch refuses a device named twice in a backend string."""
    if backend is None or "," not in backend:
        return backend
    parts = {part.strip() for part in backend.split(",")}
    return "gloo" if parts == {"cpu:gloo"} else backend


def _patch_init_process_group() -> None:
    original = torch.distributed.init_process_group
    if getattr(original, "_inharness_cpu", False):
        return

    @functools.wraps(original)
    def init_process_group(*args: Any, **kwargs: Any) -> Any:
        if args:
            args = (gloo_backend(args[0]), *args[1:])
        elif "backend" in kwargs:
            kwargs["backend"] = gloo_backend(kwargs["backend"])
        return original(*args, **kwargs)

    init_process_group._inharness_cpu = True  # type: ignore[attr-defined]
    torch.distributed.init_process_group = init_process_group


_patch_init_process_group()
sys.modules.setdefault("inharness_cpu_device", _DEVICE)
