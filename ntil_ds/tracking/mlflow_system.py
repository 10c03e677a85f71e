"""System metrics (CPU, memory, disk, network; GPU when NVML answers) for the MLflow tracker.

MLflow's own samplers, without MLflow's logging thread: that one stops at the first failed request,
while these values go through the journal like every other metric. :meth:`SystemSampler.sample`
samples every ``interval_s`` and returns the samples' mean for a training step, once per step; the
caller journals it (``system/<name>`` at that step).
"""

from __future__ import annotations

import contextlib
import math
import time

from mlflow.system_metrics.metrics.base_metrics_monitor import BaseMetricsMonitor
from mlflow.system_metrics.metrics.cpu_monitor import CPUMonitor
from mlflow.system_metrics.metrics.disk_monitor import DiskMonitor
from mlflow.system_metrics.metrics.gpu_monitor import GPUMonitor
from mlflow.system_metrics.metrics.network_monitor import NetworkMonitor

SAMPLE_INTERVAL_S = 10.0


def _monitors() -> list[BaseMetricsMonitor]:
    monitors: list[BaseMetricsMonitor] = [CPUMonitor(), DiskMonitor(), NetworkMonitor()]
    with contextlib.suppress(ImportError, RuntimeError):  # no NVIDIA GPU or no pynvml
        monitors.append(GPUMonitor())
    return monitors


class SystemSampler:
    """Samples the machine every ``interval_s``; one mean per training step."""

    def __init__(self, interval_s: float = SAMPLE_INTERVAL_S) -> None:
        self.interval_s = interval_s
        self._monitors = _monitors()
        self._sampled_at = -math.inf
        self._step: int | None = None  # the training step of the last mean returned

    def sample(self, step: int | None, final: bool) -> dict[str, float] | None:
        """Take a sample if ``interval_s`` passed (or ``final``); return ``{"system/<name>": mean}`` of
        the samples since the last mean if ``step`` (the newest training step logged) is a new one,
        else None."""
        now = time.monotonic()
        if final or now - self._sampled_at >= self.interval_s:
            for monitor in self._monitors:
                monitor.collect_metrics()
            self._sampled_at = now
        if step is None or (self._step is not None and step <= self._step):
            return None
        values = {}
        for monitor in self._monitors:
            values.update(
                {f"system/{k}": v for k, v in monitor.aggregate_metrics().items() if math.isfinite(v)}
            )
            monitor.clear_metrics()
        if not values:
            return None
        self._step = step
        return values
