"""`python -m trainer.bench all --quick`: every scenario runs and writes valid JSON and PNGs."""

from __future__ import annotations

import json

import jsonschema
import pytest

from trainer.bench.__main__ import main

pytestmark = pytest.mark.slow

NUM = {"type": ["number", "null"]}
SCHEMA = {
    "type": "object",
    "required": ["scenario", "seed", "results"],
    "properties": {
        "scenario": {"type": "string"},
        "seed": {"type": "integer"},
        "results": {
            "type": "array",
            "minItems": 2,
            "items": {
                "type": "object",
                "required": [
                    "strategy",
                    "goodput",
                    "global_downtime_s",
                    "time_to_target_s",
                    "final_val_loss",
                    "utilisation",
                    "tokens",
                    "energy_j",
                    "bytes_sent",
                ],
                "properties": {
                    "strategy": {"type": "string"},
                    "goodput": {"type": "number", "minimum": 0, "maximum": 1.0000001},
                    "global_downtime_s": {"type": "number", "minimum": 0},
                    "time_to_target_s": NUM,
                    "final_val_loss": NUM,
                    "utilisation": NUM,
                    "tokens": NUM,
                    "energy_j": NUM,
                    "bytes_sent": NUM,
                },
            },
        },
    },
}


def test_all_quick_scenarios_write_json_and_png(tmp_path, capsys):
    out, md = tmp_path / "all.json", tmp_path / "all.md"
    assert main(["all", "--quick", "--seed", "3", "--json", str(out), "--plot-dir", str(tmp_path),
                 "--markdown", str(md)]) == 0
    doc = json.loads(out.read_text())
    names = [d["scenario"] for d in doc["scenarios"]]
    assert names == ["chaos", "mixed-fleet", "wan", "energy", "scale"]
    for d in doc["scenarios"]:
        jsonschema.validate(d, SCHEMA)
        assert d["seed"] == 3
        png = tmp_path / f"{d['scenario']}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        if d["scenario"] != "scale":
            assert all(r["final_val_loss"] for r in d["results"])
            assert all(r["tokens"] > 0 and r["energy_j"] > 0 for r in d["results"])
    chaos = doc["scenarios"][0]
    strategies = [r["strategy"] for r in chaos["results"]]
    assert {"ddp", "elastic-ddp", "diloco", "decoupled", "decoupled+rebalance"} <= set(strategies)
    assert "calibration" in chaos and chaos["calibration"]["R_s"] > 0
    printed = capsys.readouterr().out
    assert "goodput" in printed and "== wan (quick)" in printed
    # the docs' per-scenario sections, one per scenario, each with its table, checks and plot
    text = md.read_text()
    assert [line[5:] for line in text.splitlines() if line.startswith("#### ")] == names
    assert text.count("| strategy | goodput |") == 5 and text.count("| check | value | target | met |") == 5
    assert "![wan](../bench/results/wan.png)" in text and "| ddp | " in text


def test_single_scenario_and_bad_arguments(tmp_path, capsys):
    out, png, md = tmp_path / "s.json", tmp_path / "s.png", tmp_path / "s.md"
    assert main(["scale", "--quick", "--json", str(out), "--plot", str(png), "--markdown", str(md)]) == 0
    assert json.loads(out.read_text())["scenario"] == "scale" and png.stat().st_size > 0
    assert md.read_text().startswith("#### scale\n\nFailure process of")
    for argv in (
        ["nope"],
        ["chaos", "--seed", "-1"],
        ["all", "--plot", "x.png"],
        ["chaos", "--plot-dir", "d"],
    ):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2
