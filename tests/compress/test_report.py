"""report.json / report.md / report.png from a run summary."""

from __future__ import annotations

import json

import pytest

from slimserve.compress.report import write_report


def summary(passed: bool) -> dict:
    return {
        "model": "recipes/demo-model",
        "dataset": "stdlib",
        "seq_len": 512,
        "tokens": 40_000,
        "recipe": "recipes/demo-w4a16-gptq.yaml",
        "baseline": {"ppl": 10.0, "size_bytes": 18_000_000},
        "stages": [
            {"name": "awq", "ppl": 10.2, "seconds": 3.5, "size_bytes": 18_000_000},
            {
                "name": "gptq",
                "ppl": 10.6 if passed else 12.5,
                "seconds": 12.0,
                "size_bytes": 5_000_000,
            },
        ],
        "final": {"ppl": 10.6 if passed else 12.5, "size_bytes": 5_000_000},
        "gate": {
            "max_ppl_increase": 0.10,
            "ppl_increase": 0.06 if passed else 0.25,
            "passed": passed,
        },
    }


def test_writes_three_files(tmp_path):
    paths = write_report(tmp_path / "out", summary(True))
    assert set(paths) == {"json", "md", "png"}
    assert all(p.is_file() and p.stat().st_size > 0 for p in paths.values())
    text = paths["json"].read_text()
    assert json.loads(text) == summary(True)
    assert text == json.dumps(summary(True), indent=2, sort_keys=True) + "\n"
    md = paths["md"].read_text()
    assert "PASSED" in md and "FAILED" not in md
    assert "| gptq | 10.600 | +6.00 | 5.00 | 12.0 |" in md
    assert "| baseline | 10.000 | +0.00 | 18.00 | — |" in md


def test_failed_gate_says_failed(tmp_path):
    paths = write_report(tmp_path, summary(False))
    md = paths["md"].read_text()
    assert md.splitlines()[0] == "# Compression report: FAILED"
    assert "+25.00 %" in md and "gate ≤ +10.00 %" in md


def test_png_is_valid(tmp_path):
    png = write_report(tmp_path, summary(True))["png"].read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    assert png[12:16] == b"IHDR"
    width, height = int.from_bytes(png[16:20], "big"), int.from_bytes(png[20:24], "big")
    assert (width, height) == (1100, 400)


def test_missing_key_is_named(tmp_path):
    bad = summary(True)
    del bad["gate"]
    with pytest.raises(ValueError, match="lacks gate"):
        write_report(tmp_path, bad)
