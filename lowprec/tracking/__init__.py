"""Tracking a rollout in MLflow, and what is drawn and sent from it.

    tracker.py         Tracker: rank 0 records a run in MLflow without ever blocking training
    records.py         the record shapes and naming rules (metric keys, eval names, params)
    outbox.py          the on-disk journal and the sender that empties it into MLflow
    report.py          render_report: the rollout pictures (PNG) of a run
    report_sources.py  ReportData, read from MLflow or from a tracker's buffer dir
    report_timeline.py the precision timeline figure and the styles the pictures share
    cli.py             `lowprec report | ui | sync` (registered by lowprec.cli)
    energy.py          open_meter: joules of a run from NVML's GPU counter or codecarbon (telemetry extra)
    peaks.py           GEMM FLOPs per token by format, device peaks per GEMM class, MFU

Import the submodule you need (`from lowprec.tracking.tracker import Tracker`). This file
imports nothing: `import lowprec.tracking` loads neither MLflow nor matplotlib, and the
numerics, plan, layers, state, monitor and controller never import this package
(tests/test_import_direction.py holds them to that).

May import: lowprec.state, lowprec.policy, lowprec.sites, lowprec.numerics, lowprec.base.
"""
