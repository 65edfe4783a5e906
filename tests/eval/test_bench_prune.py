"""The pruning benchmark's pure parts: the recipes it runs, recovery, its table and verdicts."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from slimserve.compress.recipe import parse_recipe
from slimserve.eval.bench_prune import (
    CONFIGS,
    Row,
    bench_recipe,
    check_bars,
    format_table,
    recovery,
    row_from_report,
)

REPO = Path(__file__).resolve().parents[2]


def test_recovery():
    assert recovery(10.0, 12.0, 11.0) == 0.5
    assert recovery(10.0, 12.0, 10.0) == 1.0
    assert recovery(10.0, 12.0, 12.5) == -0.25
    assert recovery(10.0, 12.0, None) is None
    assert recovery(10.0, 9.0, 9.5) is None  # pruning lost nothing: no share to recover


def test_bench_recipes_are_the_shipped_ones_and_validate(tmp_path):
    for cfg in CONFIGS:
        d = bench_recipe(cfg, quick=True, out=tmp_path / "o")
        r = parse_recipe(yaml.safe_dump(d), tmp_path / "r.yaml")
        assert r.output == (tmp_path / "o").resolve() and r.eval.max_windows == 40
        names = [s.name for s in r.stages]
        assert names[0] == "prune"
        for s in r.stages:
            if s.name == "distill":
                shipped = yaml.safe_load((REPO / "recipes" / cfg.recipe).read_text())
                full = next(st["distill"]["steps"] for st in shipped["stages"] if "distill" in st)
                assert s.config.steps == max(2, full // 10)  # --quick: a tenth of the steps
                assert s.config.warmup_steps <= s.config.steps // 2
    control = bench_recipe(CONFIGS[1], quick=False, out=tmp_path / "o")
    main = bench_recipe(CONFIGS[0], quick=False, out=tmp_path / "o")
    assert [list(s) for s in control["stages"]] == [["prune"]]
    assert control["stages"][0]["prune"] == {**main["stages"][0]["prune"], "method": "magnitude"}
    assert "max_windows" not in main["eval"]


def _report(prune_ppl, distill_ppl=None) -> dict:
    stages = [
        {
            "name": "prune",
            "ppl": prune_ppl,
            "seconds": 3.0,
            "details": {"dims_after": {"intermediate_size": 704}, "method": "activation"},
        }
    ]
    if distill_ppl is not None:
        stages.append({"name": "distill", "ppl": distill_ppl, "seconds": 400.0, "details": {}})
    final = distill_ppl if distill_ppl is not None else prune_ppl
    return {
        "baseline": {"ppl": 13.0},
        "final": {"ppl": final, "size_bytes": 16e6, "params": 7.97e6},
        "gate": {"passed": True},
        "tokens": 1000,
        "stages": stages,
    }


def test_table_and_bars():
    main = row_from_report(Row(CONFIGS[0].label, CONFIGS[0].recipe), _report(15.0, 13.8))
    control = row_from_report(Row(CONFIGS[1].label, CONFIGS[1].recipe, control=True), _report(16.0))
    failed = Row(CONFIGS[2].label, CONFIGS[2].recipe, status="failed", note="exit 2: boom")
    assert (
        main.recovered == pytest.approx(0.6)
        and control.ppl_distill is None
        and main.distill_s == 400.0
    )
    meta = {
        "hardware": {"cpu": "cpu", "cores": 2, "gpu": "none", "torch": "x", "python": "3"},
        "model": {"name": "demo-model", "params": 9.44e6, "dtype": "bfloat16", "path": "p"},
        "workload": {"quick": False, "tokens": 1000},
    }
    text = format_table(meta, [main, control, failed])
    assert (
        "60%" in text and "failed: exit 2: boom" in text and "15.000" in text and "control" in text
    )
    bars = check_bars([main, control])
    assert bars[0].startswith("bar 1 PASS") and bars[1].startswith("bar 2 PASS")
    slow = row_from_report(Row(CONFIGS[0].label, CONFIGS[0].recipe), _report(15.0, 14.5))
    worse = row_from_report(Row(CONFIGS[1].label, CONFIGS[1].recipe), _report(14.0))
    bars = check_bars([slow, worse])
    assert bars[0].startswith("bar 1 FAIL") and bars[1].startswith("bar 2 FAIL")
