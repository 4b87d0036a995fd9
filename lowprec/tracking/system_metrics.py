"""MLflow's system metrics on a lowprec run: CPU, memory, disk, network and, through NVML, GPUs.

    system = SystemMetrics("sqlite:///mlflow.db", every_s=10)
    system.start(run_id)     # from the tracker's sender thread, once the run exists
    system.stop()            # at the run's end; never starts again

The sampling is MLflow's own (`mlflow.system_metrics.SystemMetricsMonitor`, `system/*`
metrics at its own steps), not a hand-written one. It logs straight to MLflow from its own
thread, so unlike every other record of a run it is not journaled: while the server is away
it stops, and the run goes on without it. MLflow is imported by `start`.
"""

from __future__ import annotations

import logging
import threading

__all__ = ["SystemMetrics"]

log = logging.getLogger("lowprec.tracking")


class SystemMetrics:
    """Starts MLflow's monitor once per run and stops it for good (thread-safe)."""

    def __init__(self, tracking_uri: str, every_s: float, *, resume: bool = False):
        self.tracking_uri, self.every_s, self.resume = tracking_uri, every_s, resume
        self.monitor = None
        self._done = False
        self._lock = threading.Lock()

    def start(self, run_id: str) -> None:
        """Start sampling `run_id` (once; a no-op after `stop` or a failed start)."""
        if self._done or self.monitor is not None:
            return
        with self._lock:
            if self._done or self.monitor is not None:
                return
            try:
                from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor
                mon = SystemMetricsMonitor(run_id, sampling_interval=self.every_s, tracking_uri=self.tracking_uri,
                                           resume_logging=self.resume)
                mon.start()
                self.monitor = mon
            except Exception as e:  # noqa: BLE001 - e.g. psutil missing: the run goes on without them
                self._done = True
                log.warning("lowprec tracking: MLflow system metrics could not start (%s: %s)", type(e).__name__, e)

    def stop(self) -> None:
        with self._lock:
            self._done = True
            mon, self.monitor = self.monitor, None
        if mon is not None:
            try:
                mon.finish()
            except Exception as e:  # noqa: BLE001
                log.warning("lowprec tracking: MLflow system metrics did not stop cleanly (%s)", e)
