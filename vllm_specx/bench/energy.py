"""GPU energy through NVML, guarded: no ``pynvml``, no driver or no GPU gives ``None``.

``nvmlDeviceGetTotalEnergyConsumption`` is a millijoule counter since the driver loaded
(Volta and newer); the difference over a timed run is the energy the GPU spent on it,
idle power of that interval included.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any


def _nvml() -> Any | None:
    try:
        import pynvml  # shipped as nvidia-ml-py with vLLM's CUDA wheels
    except Exception:  # noqa: BLE001 - absent or broken bindings both mean "no energy"
        return None
    try:
        pynvml.nvmlInit()
    except Exception:  # noqa: BLE001 - no driver / no GPU
        return None
    return pynvml


def visible_gpu_index() -> int:
    """NVML index of the GPU the engine uses (single-GPU runs: the first visible one).

    ``CUDA_VISIBLE_DEVICES`` may name GPUs by index; UUIDs and MIG names fall back to 0.
    """
    first = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
    return int(first) if first.isdigit() else 0


class EnergyMeter:
    """``start()`` then ``stop()`` -> joules spent by the GPU in between, or None."""

    def __init__(self, index: int | None = None) -> None:
        self._nvml = _nvml()
        self._handle: Any = None
        self._start_mj: int | None = None
        self.device_name: str | None = None
        if self._nvml is None:
            return
        try:
            self._handle = self._nvml.nvmlDeviceGetHandleByIndex(
                visible_gpu_index() if index is None else index
            )
            name = self._nvml.nvmlDeviceGetName(self._handle)
            self.device_name = name.decode() if isinstance(name, bytes) else str(name)
        except Exception:  # noqa: BLE001
            self._handle = None

    @property
    def available(self) -> bool:
        return self._handle is not None

    def _read_mj(self) -> int | None:
        if self._handle is None:
            return None
        try:
            return int(self._nvml.nvmlDeviceGetTotalEnergyConsumption(self._handle))
        except Exception:  # noqa: BLE001 - not supported on this GPU
            return None

    def start(self) -> None:
        self._start_mj = self._read_mj()

    def stop(self) -> float | None:
        end = self._read_mj()
        if end is None or self._start_mj is None:
            return None
        return (end - self._start_mj) / 1000.0

    def close(self) -> None:
        if self._nvml is not None:
            with contextlib.suppress(Exception):
                self._nvml.nvmlShutdown()
            self._nvml = None
            self._handle = None
