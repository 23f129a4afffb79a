"""Measurements inside one process: the timed window, resident memory, cProfile, the float32
matmul peak, the device and the machine."""

from __future__ import annotations

import os
import platform
import resource
import statistics
import time
from pathlib import Path
from typing import Any


def peak_rss_mb() -> float:
    """Peak resident memory of this process (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def rss_mb() -> float:
    """Current resident memory of this process."""
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


class Marks:
    """(round, wall, cpu) at every cloud-round record; the timed window is first -> last."""

    def __init__(self) -> None:
        self.marks: list[tuple[int, float, float]] = []

    def mark(self, cloud_round: int) -> None:
        self.marks.append((cloud_round, time.perf_counter(), time.process_time()))

    def window(self) -> dict[str, float]:
        (_, w0, c0), (_, w1, c1) = self.marks[0], self.marks[-1]
        return {"wall": w1 - w0, "cpu": c1 - c0}


def instrument_recorder(marks: Marks) -> None:
    """Mark every record the engines write through RunRecorder (benchmark-only patch)."""
    from fedhier.runs.recorder import RunRecorder

    original = RunRecorder.record_round

    def record_round(self: Any, record: dict[str, Any]) -> None:
        original(self, record)
        marks.mark(int(record["round"]))

    RunRecorder.record_round = record_round  # type: ignore[method-assign]


def device_name(device: str) -> str:
    """The device ``--device`` resolves to here, with the GPU's name for CUDA."""
    import torch

    from fedhier.local.train import resolve_device

    resolved = resolve_device(device)
    if resolved.type == "cuda":
        return f"{resolved} ({torch.cuda.get_device_name(resolved)})"
    return str(resolved)


def profiled(run: Any, out: dict[str, Any]) -> float:
    """Run under cProfile; keep the top functions by own time in ``out['profile']``."""
    import cProfile
    import io
    import pstats

    profile = cProfile.Profile()
    accuracy = profile.runcall(run)
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(15)
    out["profile"] = text.getvalue()
    return float(accuracy)


def matmul_peak(threads: int, size: int = 2048, repeats: int = 7) -> dict[str, Any]:
    """float32 matmul throughput of square size x size matrices (median of ``repeats``)."""
    import torch

    a, b = torch.randn(size, size), torch.randn(size, size)
    torch.matmul(a, b)
    times, cpu_times = [], []
    for _ in range(repeats):
        start, cpu_start = time.perf_counter(), time.process_time()
        torch.matmul(a, b)
        times.append(time.perf_counter() - start)
        cpu_times.append(time.process_time() - cpu_start)
    return {"matmul_size": size, "matmul_gflops": 2 * size**3 / statistics.median(times) / 1e9,
            "matmul_best_gflops": 2 * size**3 / min(times) / 1e9,
            "matmul_cpu_gflops": 2 * size**3 / statistics.median(cpu_times) / 1e9}


def machine() -> dict[str, Any]:
    """CPU model, cores, GPU, Python and torch versions, and the load average now."""
    import torch

    model = "unknown"
    if Path("/proc/cpuinfo").exists():
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    return {"cpu": model, "cores": os.cpu_count(), "gpu": torch.cuda.is_available(),
            "python": platform.python_version(), "torch": torch.__version__,
            "load_average_at_start": os.getloadavg()}

