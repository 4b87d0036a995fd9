"""The table, CSV and picture of a hand-built profile, non-finite entries included."""

from __future__ import annotations

import csv
import math

import pytest

from lowprec.profile.measure import Profile, SiteCost
from lowprec.profile.planner import choose_formats, order_stages
from lowprec.profile.report import draw, plan_lines, ranked_table, write_csv


def _profile():
    entries = [SiteCost("a", "fp8_tensorwise", 0.5, 0.0001, 0.9999, 0.9999, {"input": 30.0}),
               SiteCost("a", "nvfp4", 0.5, math.nan, math.nan, math.nan, {"input": -math.inf}),
               SiteCost("b", "fp8_tensorwise", 0.5, -0.001, 1.0, 1.0, {}),          # sensitivity 0
               SiteCost("b", "nvfp4", 0.5, 0.002, 0.999, 0.99, {"input": 18.0}, estimated_from="a")]
    return Profile(entries, 3.0, 2, 64, 10, 1, 0.1)


def test_table_csv_and_picture(tmp_path):
    prof = _profile()
    ch = choose_formats(prof, {"a": ["nvfp4", "fp8_tensorwise", "bf16"], "b": ["nvfp4", "fp8_tensorwise", "bf16"]},
                        budget=0.05)
    assert (ch["a"].format, ch["b"].format) == ("fp8_tensorwise", "nvfp4")
    table = ranked_table(prof, ch).splitlines()
    body = table[2:]
    assert len(body) == 4
    assert body[0].startswith("a") and "nvfp4" in body[0] and " inf " in body[0]   # most sensitive first
    assert body[-1].startswith("b") and "fp8_tensorwise" in body[-1]
    assert "~a" in next(line for line in body if line.startswith("b") and "nvfp4" in line)
    assert sum("<- final" in line for line in body) == 2
    short = ranked_table(prof, ch, limit=2).splitlines()
    assert len(short) == 2 + 2 + 1 and "2 more in profile.csv" in short[-1]
    write_csv(prof, tmp_path / "p.csv")
    rows = list(csv.DictReader(open(tmp_path / "p.csv")))
    assert [(r["site"], r["format"]) for r in rows] == [(e.fqn, e.format) for e in prof.ranked()]
    assert rows[0]["sensitivity"] == "inf" and float(rows[-1]["sensitivity"]) == 0.0
    b4 = next(r for r in rows if (r["site"], r["format"]) == ("b", "nvfp4"))
    assert float(b4["forward_noise"]) == pytest.approx(10 ** -1.8, rel=1e-5)   # input at 18 dB, no weight SQNR
    assert float(b4["sensitivity"]) == pytest.approx(10 ** -1.8 + 0.002 + 0.01, rel=1e-5)
    for budget in (0.05, 0.0):
        out = draw(prof, ch, tmp_path / f"p{budget}.png", budget)
        assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    lines = plan_lines(ch, order_stages(ch, prof, 2), 0.05)
    assert lines[0].startswith("plan (sensitivity budget 0.05): final GEMM FLOPs nvfp4 50%, fp8_tensorwise 50%")
