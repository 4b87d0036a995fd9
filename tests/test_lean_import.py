"""`import lowprec` stays light: no MLflow, lm-eval or datasets, and no CUDA initialisation.

Run in a fresh interpreter so that nothing imported by other tests counts. CUDA is
checked twice: `torch.cuda.is_initialized()` after the import, and a tripwire on
`torch.cuda._lazy_init` (the function every CUDA initialisation path goes through) that
fails even on a CPU-only build of PyTorch, where is_initialized() is always False.

The list of modules imported is explicit (the numerics core); heavy modules such as the
MLflow tracking or the CLI are expected to import their dependencies themselves.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

LIGHT_MODULES = ["lowprec", "lowprec.numerics.formats", "lowprec.numerics.quantize", "lowprec.numerics.hadamard"]
HEAVY = ["mlflow", "lm_eval", "datasets", "transformer_engine", "transformers", "torchao"]

PROBE = textwrap.dedent("""
    import importlib, json, sys
    import torch
    calls = []
    def _tripwire(*args, **kwargs):
        calls.append("torch.cuda._lazy_init")
        raise RuntimeError("lowprec initialised CUDA at import")
    torch.cuda._lazy_init = _tripwire
    before = set(sys.modules)
    for name in MODULES:
        importlib.import_module(name)
    print(json.dumps({
        "cuda_initialized": torch.cuda.is_initialized(),
        "lazy_init_calls": calls,
        "heavy": sorted(m for m in HEAVY if m in sys.modules),
        "new": sorted(m.split(".")[0] for m in set(sys.modules) - before),
    }))
""")


def _probe(modules: list[str], heavy: list[str] = HEAVY, then: str = "") -> dict:
    code = f"MODULES = {modules!r}\nHEAVY = {heavy!r}\n{PROBE}"
    code = code.replace("print(json.dumps(", then + "\nprint(json.dumps(")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_import_lowprec_is_lean():
    out = _probe(LIGHT_MODULES)
    assert out["lazy_init_calls"] == []
    assert out["cuda_initialized"] is False
    assert out["heavy"] == [], f"importing lowprec pulled in {out['heavy']}"
    assert "lowprec" in out["new"] and "torch" not in out["heavy"]


def test_probe_can_fail():
    """The probe reports a heavy module when one is imported, and trips on CUDA init."""
    out = _probe(["imaplib"], heavy=["imaplib", "ftplib"], then="try:\n    torch.cuda.init()\nexcept Exception:\n    pass")
    assert out["heavy"] == ["imaplib"]         # imported; ftplib was not
    assert out["lazy_init_calls"] == ["torch.cuda._lazy_init"]


def test_the_front_door_is_small_lazy_and_documented():
    """`lowprec` exports what a user starts from, about ten names, each imported when first used
    (nothing of the runtime or the config is imported by `import lowprec`), each documented;
    the numerics are in `lowprec.numerics`."""
    out = _probe(["lowprec"], heavy=["lowprec.runtime.session.session", "lowprec.config", "lowprec.sites.precision_state",
                                     "lowprec.numerics.quantize"],
                 then="calls.append('before:' + ','.join(m for m in HEAVY if m in sys.modules))\n"
                      "import lowprec\nnames = list(lowprec.__all__)\n"
                      "undocumented = [n for n in names if not (getattr(lowprec, n).__doc__ or '').strip()]\n"
                      "calls.extend(['names:' + ','.join(names), 'undocumented:' + ','.join(undocumented)])")
    said = {c.split(":")[0]: c.split(":", 1)[1] for c in out["lazy_init_calls"]}
    assert said["before"] == "", said["before"]   # `import lowprec` imported none of them
    names = said["names"].split(",")
    assert 8 <= len(names) <= 12 and {"prepare", "PrecisionPlan", "LowprecConfig", "Session", "Format"} <= set(names)
    assert said["undocumented"] == "", said["undocumented"]
    assert len(out["heavy"]) == 4   # each imported when its name was used
    import lowprec.numerics
    assert {"quantize", "E4M3", "get_format"} <= set(lowprec.numerics.__all__)
