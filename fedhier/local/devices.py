"""``--device``: which names are valid, which devices this machine has, and the one a run uses.

Two checks, at two moments:

- :func:`check_device_name` (syntax, no torch call) runs in
:class:`fedhier.settings.run_config.RunConfig`
  validation, so a TOML file or a Flower run_config with ``device = "gpu"`` is refused like any
  other bad value, on any machine;
- :func:`resolve_device` (availability) runs before any work starts (``fedhier run`` checks it
  before the run folder is created) and wherever a model is placed; a device this machine does
  not have is a one-line :class:`~fedhier.common.errors.ConfigError` naming what it does have.

``auto`` picks the best available device: CUDA (the current CUDA device), else Apple's MPS,
else the CPU.
"""

from __future__ import annotations

import difflib
import re
from typing import Any

from fedhier.common.errors import ConfigError

#: The device names --device accepts besides cuda:N (fedhier.settings.run_config.DEVICES repeats
#: them for readers of the configuration; a test keeps the two equal; no import: config imports us).
DEVICE_KINDS = ("cpu", "cuda", "mps", "auto")
DEVICE_HELP = "cpu, cuda, cuda:N, mps or auto (the best available: cuda, then mps, then cpu)"

_CUDA_INDEX = re.compile(r"cuda:(\d{1,4})")


def check_device_name(name: Any) -> None:
    """Raise a one-line ConfigError unless ``name`` is cpu, cuda, cuda:N, mps or auto."""
    if isinstance(name, str) and (name in DEVICE_KINDS or _CUDA_INDEX.fullmatch(name)):
        return
    close = difflib.get_close_matches(str(name).lower(), [*DEVICE_KINDS, "cuda:0"], n=1)
    hint = f" (did you mean '{close[0]}'?)" if close else ""
    raise ConfigError(f"unknown device '{name}'{hint}; choose {DEVICE_HELP}")


def _torch() -> Any:
    import torch

    return torch


def cuda_count() -> int:
    """CUDA devices torch can use here (0 on a CPU build of torch)."""
    torch = _torch()
    try:
        return int(torch.cuda.device_count()) if torch.cuda.is_available() else 0
    except (RuntimeError, AssertionError):  # a broken driver reads as "no CUDA"
        return 0


def mps_available() -> bool:
    torch = _torch()
    backend = getattr(torch.backends, "mps", None)
    return bool(backend is not None and backend.is_available())


def available_devices() -> list[str]:
    """Every device a run may name here, best first: cuda:0 ... cuda:K-1, mps, cpu."""
    names = [f"cuda:{i}" for i in range(cuda_count())]
    if mps_available():
        names.append("mps")
    return [*names, "cpu"]


def _unavailable(name: str, what: str) -> ConfigError:
    torch = _torch()
    return ConfigError(f"--device {name}: {what} (torch {torch.__version__}); available: "
                       f"{', '.join(available_devices())}")


def resolve_device(name: str) -> Any:
    """The ``torch.device`` that ``--device name`` means on this machine.

    Raises:
        ConfigError: ``name`` is not a device name, or this machine does not have it (the
            message lists the devices it has).
    """
    check_device_name(name)
    torch = _torch()
    count = cuda_count()
    if name == "auto":
        if count:
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("mps" if mps_available() else "cpu")
    if name == "cpu":
        return torch.device("cpu")
    if name == "mps":
        if not mps_available():
            raise _unavailable(name, "this machine has no Apple MPS device")
        return torch.device("mps")
    if not count:
        raise _unavailable(name, "this machine has no CUDA device")
    if name == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    index = int(name.split(":", 1)[1])
    if index >= count:
        plural = "s" if count > 1 else ""
        raise _unavailable(name, f"this machine has {count} CUDA device{plural} "
                                 f"(cuda:0..cuda:{count - 1})")
    return torch.device("cuda", index)

