"""Devices: ``check_device_name`` (syntax only: a study file may be read on a driver without a Ray cluster's
GPUs), ``resolve_device`` (availability: ``cuda`` without CUDA is a ConfigError, never a silent CPU run; None
is CUDA when available), and how executors place runs on GPUs (docs/tuning.md, "Executors and GPUs")."""

from __future__ import annotations

import os
import re
from typing import Any

import torch

from dptune.errors import ConfigError

_NAME = re.compile(r"^(cpu|cuda|mps)(?::(\d+))?$")
_CHOICES = "cpu, cuda, cuda:N or mps"


def check_device_name(device: Any, where: str = "device") -> str:
    """The canonical device string of ``device`` (a str or ``torch.device``); refuses unknown names."""
    if isinstance(device, torch.device):
        device = str(device)
    if not isinstance(device, str) or not (m := _NAME.match(device.strip().lower())):
        raise ConfigError(f"{where}: unknown device {device!r}. Fix: use {_CHOICES}.")
    kind, index = m.group(1), m.group(2)
    if kind != "cuda":  # there is one CPU / MPS device (torch calls an MPS tensor's device 'mps:0')
        if index is not None and int(index) != 0:
            raise ConfigError(f"{where}: {device!r}: there is one {kind} device. Fix: use {kind!r}.")
        return kind
    return kind if index is None else f"{kind}:{int(index)}"


def uses_cuda(device: Any) -> bool:
    return device is not None and check_device_name(device).startswith("cuda")


def resolve_device(device: Any = None, where: str = "device") -> torch.device:
    """The ``torch.device`` to train on; a named device must exist here (clear error otherwise)."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    name = check_device_name(device, where)
    if name.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ConfigError(
                f"{where}: {name!r} asked for, but CUDA is not available here "
                f"(torch {torch.__version__}, CUDA build: {torch.version.cuda or 'no'}). "
                "Fix: use device 'cpu', or install a CUDA build of torch on a machine with an NVIDIA GPU."
            )
        n = torch.cuda.device_count()
        if ":" in name and int(name.split(":")[1]) >= n:
            raise ConfigError(
                f"{where}: {name!r} asked for, but only {n} CUDA device(s) are visible "
                f"(cuda:0..cuda:{n - 1}). Fix: pick one of them, or 'cuda'."
            )
    elif name == "mps":
        mps = getattr(torch.backends, "mps", None)
        if mps is None or not mps.is_available():
            raise ConfigError(
                f"{where}: 'mps' asked for, but Apple's MPS backend is not available here. Fix: use device 'cpu'."
            )
    return torch.device(name)


def gpus_per_task(device: Any, gpus_per_run: float | None) -> float:
    """Ray's ``num_gpus`` of one task (a run or a vectorised group): 0 on CPU/MPS; on CUDA
    ``gpus_per_run`` (default 1: one run per GPU; e.g. 0.25 packs four small runs on a GPU)."""
    ok = gpus_per_run is None or (
        isinstance(gpus_per_run, int | float)
        and not isinstance(gpus_per_run, bool)
        and gpus_per_run > 0
        and (gpus_per_run <= 1 or float(gpus_per_run).is_integer())
    )
    if not ok:
        raise ConfigError(
            f"gpus_per_run must be a fraction in (0, 1] or a whole number of GPUs, got "
            f"{gpus_per_run!r}. Fix: e.g. gpus_per_run = 0.25 to share a GPU among four runs."
        )
    if not uses_cuda(device):
        if gpus_per_run is not None:
            raise ConfigError(
                f"gpus_per_run = {gpus_per_run} needs runs on CUDA, but the device is "
                f"{device!r}. Fix: set device = 'cuda', or drop gpus_per_run."
            )
        return 0.0
    return 1.0 if gpus_per_run is None else float(gpus_per_run)


def process_gpu_plan(device: Any, workers: int | None) -> tuple[int | None, list[str] | None]:
    """How the process executor places CUDA runs: ``(workers, per-worker GPU masks)`` (CPU: ``(workers, None)``).

    ``cuda``: one worker per visible GPU unless ``workers`` is given; worker k sees only GPU ``k mod n``
    (``CUDA_VISIBLE_DEVICES``), so several GPUs are all used and each worker's ``cuda`` is its own GPU. On one GPU the
    default is one worker: runs do not contend for its memory and kernels (a CUDA context per extra worker: ~0.5 GB);
    ``workers`` > 1 opts in to sharing it. ``cuda:N`` pins every worker to that GPU (default one worker)."""
    if not uses_cuda(device):
        return workers, None
    name = check_device_name(device)
    mask = os.environ.get("CUDA_VISIBLE_DEVICES")  # this process's GPUs by their names there (a mask is respected)
    names = mask.split(",") if mask is not None else [str(i) for i in range(torch.cuda.device_count())]
    gpus = [g.strip() for g in names if g.strip()]
    if not gpus:
        raise ConfigError(
            f"device {name!r}: no CUDA device is visible (CUDA_VISIBLE_DEVICES={mask!r}). "
            "Fix: use device 'cpu', or expose a GPU."
        )
    if ":" in name:  # an explicit index refers to this process's numbering: keep the mask as is
        return workers or 1, None
    n_workers = workers or len(gpus)
    return n_workers, [gpus[k % len(gpus)] for k in range(n_workers)]
