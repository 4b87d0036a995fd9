"""Shared by the tracking and report tests: a short, real rollout driven into a Tracker, an
MLflow server the tests start and stop, a migrated SQLite store, and REST/PNG helpers
(conftest.py makes the server and the store fixtures).

The rollout is a small GPT prepared with lowprec and trained on text bytes; the promotion,
fallback and gate events are constructed here (the controller gets wired in later), with
the fallback's evidence taken from the site's real quantization statistics.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import torch

from experiments.model import build_gpt
from lowprec import prepare
from lowprec.policy.events import Event, EventKind
from lowprec.sites.plan import PrecisionPlan
from small_gpt import batches, corpus_bytes

# `python -m mlflow`: this interpreter's MLflow (and its database drivers), whatever the
# `mlflow` script's shebang says (a copied virtual environment keeps the original's)
MLFLOW = [sys.executable, "-m", "mlflow"]
MODEL = dict(vocab_size=256, block_size=32, n_layer=2, n_head=2, d_model=32)
CONFIG = {
    "model": {"factory": "experiments.model:build_gpt", "args": MODEL},
    "precision": {
        "backend": "emulated", "default": "bf16", "keep_high_precision": [{"fqns": ["lm_head"]}],
        "rules": [{"name": "attn_fp8", "select": {"glob": "blocks.*.attn.*"}, "format": "fp8_tensorwise",
                   "ladder": ["fp8_tensorwise", "bf16"]},
                  {"name": "mlp_fp4", "select": {"glob": "blocks.*.mlp.*"}, "format": "nvfp4",
                   "ladder": ["nvfp4", "fp8_tensorwise", "bf16"]}]},
    "rollout": {"check_every": 2, "thresholds": {"max_saturated_frac": 1.0e-3, "max_underflow_frac": 0.01,
                                                 "site_patience": 1}},
    "train": {"lr": 3e-3, "batch_size": 4, "seq_len": 32},
}
FALLBACK_SITE = "blocks.1.mlp.fc"


@dataclass
class Rollout:
    steps: int
    events: list[Event] = field(default_factory=list)
    losses: dict[int, float] = field(default_factory=dict)
    log_seconds: list[float] = field(default_factory=list)  # time spent in tracker calls, per step


def run_rollout(tracker, steps: int = 10, on_step=None) -> Rollout:
    """Train `steps` steps, logging everything a rollout logs; `on_step(step)` runs before each."""
    r = Rollout(steps)
    torch.manual_seed(0)
    model = build_gpt(**MODEL)
    state = prepare(model, PrecisionPlan.from_dict(CONFIG["precision"]))
    target = state.formats()
    state.set_format(list(state.sites), "bf16")  # the rollout starts in high precision
    opt = torch.optim.AdamW(model.parameters(), lr=CONFIG["train"]["lr"])
    tokens = corpus_bytes()
    held_x, held_y = next(batches(tokens, 1, batch=16, seed=99))

    def timed(fn, *a):
        t = time.perf_counter()
        fn(*a)
        r.log_seconds.append(time.perf_counter() - t)

    timed(tracker.log_config, CONFIG)
    timed(tracker.log_precision, 0, state.formats(), state.flops_share())
    stages = {2: ("attn_fp8", [s for s in state.sites if ".attn." in s]), 4: ("mlp_fp4", [s for s in state.sites if ".mlp." in s])}
    for step, (x, y) in enumerate(batches(tokens, steps, batch=CONFIG["train"]["batch_size"])):
        if on_step:
            on_step(step)
        events = []
        if step in stages:
            name, sites = stages[step]
            events.append(Event(step, EventKind.PROMOTE, tuple(sites), {s: "bf16" for s in sites},
                                {s: target[s] for s in sites}, "stable for 2 steps", {"min_steps": 2}, name))
        opt.zero_grad()
        _, loss = model(x, y)
        loss.backward()
        gn = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)
        opt.step()
        stats = state.stats()  # before the baseline forward: switching formats clears them
        with torch.no_grad(), state.high_precision():
            base = model(x, y)[1].item()
        r.losses[step] = loss.item()
        timed(tracker.log_metrics, step, {"train/loss": loss.item(), "train/grad_norm": gn.item(),
                                          "train/baseline_loss": base})
        if step % 2 == 1:
            timed(tracker.log_signals, step, stats)
            if step == 5 and FALLBACK_SITE in stats:  # evidence from the site's real statistics
                d = stats[FALLBACK_SITE]["input"].to_dict()
                events.append(Event(step, EventKind.FALLBACK, (FALLBACK_SITE,), {FALLBACK_SITE: "nvfp4"},
                                    {FALLBACK_SITE: "fp8_tensorwise"}, "site thresholds crossed for 1 checks",
                                    {"input/underflow_frac": d["underflow_frac"]}, "mlp_fp4"))
        if step == 7:
            events.append(Event(step, EventKind.GATE, (), reason="gate before next stage: pass",
                                evidence={"verdict": "pass", "detail": "next-byte acc within interval"}, stage="mlp_fp4"))
        for e in events:
            for s, f in e.to_format.items():
                state.set_format(s, f)
        if events:
            r.events += events
            timed(tracker.log_events, events)
            timed(tracker.log_precision, step, state.formats(), state.flops_share())
        if step in (3, steps - 1):
            with torch.no_grad():
                pred = model(held_x).argmax(-1)
            acc = (pred == held_y).float().mean().item()
            n = held_y.numel()
            timed(tracker.log_eval, step, {"next_byte": {"acc,none": acc, "acc_stderr,none": (acc * (1 - acc) / n) ** 0.5}})
    return r


class Recorder:
    """Keeps a tracker's calls, grouped by training step, and passes them on to `target`."""

    def __init__(self, target=None):
        self.calls: list[tuple[int, str, tuple]] = []
        self.step, self.target = 0, target

    def __getattr__(self, name):
        def call(*args):
            self.calls.append((self.step, name, args))
            if self.target is not None:
                getattr(self.target, name)(*args)
        return call


_RECORDED: dict[int, tuple[Rollout, Recorder]] = {}


def run_and_record(tracker, steps: int = 10) -> Rollout:
    """`run_rollout` into `tracker` (may be None), kept so that `replay` can feed other trackers;
    a process that trained once already replays that training instead of training again."""
    if steps in _RECORDED:
        return replay(tracker, steps) if tracker is not None else _RECORDED[steps][0]
    rec = Recorder(tracker)

    def on_step(step):
        rec.step = step
    r = run_rollout(rec, steps, on_step=on_step)
    _RECORDED[steps] = (r, rec)
    return r


def recorded_rollout(steps: int = 10) -> tuple[Rollout, Recorder]:
    """One real rollout per test process (trained here unless a test already ran one)."""
    if steps not in _RECORDED:
        run_and_record(None, steps)
    return _RECORDED[steps]


def replay(tracker, steps: int = 10, on_step=None, step_seconds: float = 0.0) -> Rollout:
    """The recorded rollout's tracker calls, step by step, into `tracker` (timed like
    run_rollout); `step_seconds` stands for the training compute between steps."""
    rollout, rec = recorded_rollout(steps)
    out = Rollout(steps, list(rollout.events), dict(rollout.losses))
    current = None
    for step, name, args in rec.calls:
        if step != current and step > 0:
            time.sleep(step_seconds)
            if on_step is not None:
                on_step(step)
        current = step
        t = time.perf_counter()
        getattr(tracker, name)(*args)
        out.log_seconds.append(time.perf_counter() - t)
    return out


# ------------------------------------------------------------------ MLflow server and stores
class SqliteTemplate:
    """An empty SQLite store with MLflow's tables, created in the background (10-20 s) in
    `dir`; `copy_to(dir)` waits for it and returns a migrated store's URI."""

    def __init__(self, dir: Path):
        self.path = dir / "mlflow.db"
        code = f"from mlflow.tracking import MlflowClient; MlflowClient('sqlite:///{self.path}').search_experiments()"
        self.proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

    def copy_to(self, dir: Path) -> str:
        """A SQLite store URI in `dir`, from the migrated template."""
        if self.proc.wait(timeout=300) != 0:
            raise RuntimeError(f"creating the MLflow SQLite store failed: {self.proc.stderr.read().decode()[-2000:]}")
        dir.mkdir(parents=True, exist_ok=True)
        shutil.copy(self.path, dir / "mlflow.db")
        return f"sqlite:///{dir}/mlflow.db"

    def close(self) -> None:
        self.proc.wait(timeout=300)
        self.proc.stderr.close()


class MlflowServer:
    """`mlflow server` on 127.0.0.1 (SQLite backend unless `backend_store_uri` names another,
    e.g. postgresql://; proxied artifacts), stoppable and restartable."""

    def __init__(self, root: Path, port: int, backend_store_uri: str | None = None):
        self.root, self.port = root, port
        self.backend_store_uri = backend_store_uri or f"sqlite:///{root}/mlflow.db"
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        root.mkdir(parents=True, exist_ok=True)

    def start(self, timeout: float = 90.0, wait: bool = True) -> None:
        """Launch the server (it creates its store the first time); `wait` until it answers."""
        env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
        cmd = [*MLFLOW, "server", "--backend-store-uri", self.backend_store_uri,
               "--artifacts-destination", f"file://{self.root}/artifacts", "--host", "127.0.0.1",
               "--port", str(self.port), "--workers", "1"]
        self.log = open(self.root / "server.log", "ab")
        self.proc = subprocess.Popen(cmd, env=env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        if wait:
            self.wait(timeout)

    def wait(self, timeout: float = 90.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"mlflow server exited: {(self.root / 'server.log').read_text()[-2000:]}")
            if self.answers():
                return
            time.sleep(0.2)
        self.stop()
        raise TimeoutError(f"mlflow server did not answer in {timeout} s")

    def answers(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=1) as r:
                return r.status == 200
        except OSError:
            return False

    def stop(self) -> None:
        """Stop the server and its children (its own process group, by id); idempotent."""
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)
        except ProcessLookupError:
            pass
        self.proc, _ = None, self.log.close()

    # REST helpers (plain HTTP, no MLflow client)
    def get(self, endpoint: str, **params) -> dict:
        return json.loads(self.raw(endpoint, **params))

    def raw(self, endpoint: str, **params) -> bytes:
        with urllib.request.urlopen(f"{self.url}{endpoint}?{urllib.parse.urlencode(params)}", timeout=10) as r:
            return r.read()

    def history(self, run_id: str, key: str) -> list[dict]:
        out, token = [], None
        while True:
            page = self.get("/api/2.0/mlflow/metrics/get-history", run_id=run_id, metric_key=key,
                            **({"page_token": token} if token else {}))
            out += page.get("metrics", [])
            token = page.get("next_page_token")
            if not token:
                return out


def check_run_over_rest(server: MlflowServer, run_id: str, steps: list[int], events, report: bool = False) -> dict:
    """A run logged from the recorded rollout, read back over REST: params, every metric step
    once, its events once (in order), artifacts, tags; returns the run."""
    run = server.get("/api/2.0/mlflow/runs/get", run_id=run_id)["run"]
    params = {p["key"]: p["value"] for p in run["data"].get("params", [])}
    tags = {t["key"]: t["value"] for t in run["data"].get("tags", [])}
    metrics = {m["key"] for m in run["data"].get("metrics", [])}
    assert params["precision.rules.0.format"] == "fp8_tensorwise" and params["train.lr"] == "0.003"
    for key in ("train/loss", "train/grad_norm", "train/baseline_loss"):
        hist = server.history(run_id, key)
        assert sorted(m["step"] for m in hist) == steps, key  # every step, each once
    assert {f"signal/{FALLBACK_SITE}/input/saturated_frac", "precision/flops_share/nvfp4",
            "eval/next_byte/acc"} <= metrics
    lines = server.raw("/get-artifact", path="events.jsonl", run_uuid=run_id).decode().splitlines()
    assert [json.loads(x)["kind"] for x in lines] == [e.kind for e in events]
    table = json.loads(server.raw("/get-artifact", path="events.json", run_uuid=run_id))
    assert table["columns"][:3] == ["step", "kind", "stage"] and len(table["data"]) == len(events)
    files = {f["path"] for f in server.get("/api/2.0/mlflow/artifacts/list", run_id=run_id)["files"]}
    assert {"config.yaml", "events.jsonl", "events.json", "precision_map.json"} <= files
    assert ("report" in files) == report
    assert tags["lowprec.fallbacks"] == "1" and tags["lowprec.quarantined"] == "none"
    return run


# ------------------------------------------------------------------ PNG
def png_colors(data: bytes) -> tuple[int, int, int]:
    """(width, height, number of distinct pixel colours) of a PNG, decoded by matplotlib."""
    import io

    import matplotlib.image
    import numpy as np
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    img = matplotlib.image.imread(io.BytesIO(data), format="png")
    rgb = (np.asarray(img)[..., :3] * 255).round().astype(np.uint32)
    packed = (rgb[..., 0] << 16) | (rgb[..., 1] << 8) | rgb[..., 2]
    return img.shape[1], img.shape[0], len(np.unique(packed))
