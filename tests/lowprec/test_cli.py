"""`lowprec plan CONFIG`: the table on a real config, and clear failures with exit code 2.

The `lowprec` processes are forked from the session's pre-imported server (`lowprec_forks`,
tests/cli_forks.py)."""

import json
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DEFAULT = ROOT / "experiments" / "configs" / "default.yaml"


@pytest.fixture
def run_plan(lowprec_forks):
    """`run_plan(config)`: `lowprec plan CONFIG` run in the repository's root."""
    return lambda config: lowprec_forks.run(["plan", str(config)], ROOT, timeout=120)


def test_plan_prints_every_linear_layer_with_format_ladder_and_reason(tmp_path, run_plan):
    out = run_plan(_variant(tmp_path, lambda cfg: None))
    assert out.returncode == 0, out.stderr
    table, stages = out.stdout.split("\n\n")[:2]   # then the runtime inputs still missing, if any
    assert "mlp_fp8: 8 sites -> fp8_tensorwise" in stages and "middle_mlp_nvfp4: 4 sites -> nvfp4" in stages
    lines = table.splitlines()
    assert lines[0].split() == ["FQN", "shape", "(out", "x", "in)", "format", "ladder", "why"]
    rows = {line.split()[0]: line for line in lines[2:]}
    assert len(rows) == 4 * 4 + 1  # 4 blocks x (qkv, proj, fc, proj) + lm_head
    assert "nvfp4 -> fp8_tensorwise -> bf16" in rows["blocks.1.mlp.fc"]
    assert "rule middle_mlp" in rows["blocks.2.mlp.proj"]
    assert "rule blocks" in rows["blocks.0.mlp.fc"] and "fp8_tensorwise -> bf16" in rows["blocks.0.mlp.fc"]
    assert rows["blocks.0.mlp.fc"].split()[4] == "bf16"  # starts in bf16; the rollout promotes it
    assert "keep_high_precision" in rows["lm_head"] and "bf16" in rows["lm_head"]
    assert "384 x 128" in rows["blocks.3.attn.qkv"]
    assert "GEMM FLOPs by kind: dense 100.0%" in out.stdout and "GEMM FLOPs by format: bf16 100.0%" in out.stdout


def _variant(tmp_path, mutate) -> Path:
    """The default config changed by `mutate`, its loss-gap baseline a losses file (the
    default names an MLflow run that the main job trains first)."""
    cfg = yaml.safe_load(DEFAULT.read_text())
    (tmp_path / "bf16_losses.json").write_text(json.dumps([2.5] * 300))
    cfg["rollout"]["baseline"] = {"losses": "bf16_losses.json"}
    mutate(cfg)
    p = tmp_path / "cfg.yaml"
    p.write_text(yaml.safe_dump(cfg))
    return p


def test_rule_matching_nothing_fails_with_nearest_fqns(tmp_path, run_plan):
    def bad(cfg):
        cfg["precision"]["rules"][0]["select"] = {"fqns": ["blocks.0.mlp.fcc"]}
    out = run_plan(_variant(tmp_path, bad))
    assert out.returncode == 2
    assert "precision.rules[0]" in out.stderr and "blocks.0.mlp.fc" in out.stderr


def test_format_the_backend_cannot_run_fails(tmp_path, run_plan):
    def bad(cfg):
        cfg["precision"]["backend"] = "torch"
    out = run_plan(_variant(tmp_path, bad))
    assert out.returncode == 2
    assert "nvfp4" in out.stderr and "emulated" in out.stderr


def test_shape_not_divisible_by_block_fails(tmp_path, run_plan):
    def bad(cfg):
        cfg["model"]["args"]["d_model"] = 80  # not a multiple of the MX block of 32
        cfg["model"]["args"]["n_head"] = 4
        cfg["precision"]["rules"][0]["format"] = "mxfp8"
        cfg["precision"]["rules"][0]["ladder"] = ["mxfp8", "bf16"]
        cfg["precision"]["rules"] = cfg["precision"]["rules"][:1]
    out = run_plan(_variant(tmp_path, bad))
    assert out.returncode == 2
    assert "blocks.0." in out.stderr and "32" in out.stderr and "80" in out.stderr


def test_unknown_format_lists_known_ones(tmp_path, run_plan):
    def bad(cfg):
        cfg["precision"]["rules"][0]["format"] = "fp8_tensorwse"
    out = run_plan(_variant(tmp_path, bad))
    assert out.returncode == 2
    assert "fp8_tensorwise" in out.stderr and "nvfp4" in out.stderr


def test_help_lists_builtin_and_entry_point_commands(lowprec_forks):
    out = lowprec_forks.run(["--help"], ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    for command in ("plan", "report", "ui", "sync", "gate"):  # gate: gates' `lowprec.commands` entry point
        assert f"\n    {command} " in out.stdout, out.stdout


def test_a_broken_or_clashing_entry_point_is_left_out_with_a_warning(monkeypatch, capsys):
    from importlib.metadata import EntryPoint

    import lowprec.cli as cli

    eps = [EntryPoint("broken", "no_such_module_for_lowprec_tests:register", cli.ENTRY_POINT_GROUP),
           EntryPoint("plan", "lowprec.gates.cli:register", cli.ENTRY_POINT_GROUP)]
    monkeypatch.setattr(cli, "entry_points", lambda group: [e for e in eps if e.group == group])
    parser = cli.build_parser()
    err = capsys.readouterr().err
    assert "cannot load the `broken` command" in err and "no_such_module_for_lowprec_tests" in err
    assert "`plan` is already a lowprec command" in err
    assert "broken" not in parser._subparsers._group_actions[0].choices
    assert cli.main(["plan", str(ROOT / "no-such.yaml")]) == 2  # the built-in still works
