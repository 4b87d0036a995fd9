"""MLflow's own system-metrics monitor on a lowprec run: started by the Tracker once the run
exists in a real SQLite store, sampling `system/*`, stopped by `finish`."""

import time

from lowprec.tracking.tracker import Tracker


def test_the_tracker_starts_and_stops_mlflows_system_metrics(tmp_path, sqlite_store):
    uri = sqlite_store(tmp_path)
    tracker = Tracker(uri, "lowprec-tests", "system-metrics", buffer_dir=tmp_path / "run", flush_interval_s=0.1,
                      system_metrics_s=0.5)
    tracker.log_metrics(0, {"train/loss": 2.0})
    from mlflow.tracking import MlflowClient
    client = MlflowClient(uri)
    deadline = time.monotonic() + 60   # the monitor samples every 0.5 s; under load its thread runs late
    while time.monotonic() < deadline and (tracker.system_metrics.monitor is None or len(
            client.get_metric_history(tracker.run_id, "system/cpu_utilization_percentage")) < 2):
        time.sleep(0.2)
    tracker.finish("FINISHED", timeout=10, report=False)
    assert tracker.system_metrics.monitor is None
    run = client.get_run(tracker.run_id)
    assert run.info.status == "FINISHED"
    cpu = client.get_metric_history(tracker.run_id, "system/cpu_utilization_percentage")
    assert len(cpu) >= 2 and all(0 <= m.value <= 100 * 64 for m in cpu)
    assert "system/system_memory_usage_megabytes" in run.data.metrics


def test_no_system_metrics_unless_asked(tmp_path, sqlite_store):
    uri = sqlite_store(tmp_path)
    tracker = Tracker(uri, "lowprec-tests", "no-system-metrics", buffer_dir=tmp_path / "run", flush_interval_s=0.1)
    tracker.log_metrics(0, {"train/loss": 2.0})
    time.sleep(1.0)
    tracker.finish("FINISHED", timeout=10, report=False)
    from mlflow.tracking import MlflowClient
    assert not [k for k in MlflowClient(uri).get_run(tracker.run_id).data.metrics if k.startswith("system/")]
