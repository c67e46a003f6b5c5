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
    out = tmp_path / "all.json"
    assert main(["all", "--quick", "--seed", "3", "--json", str(out), "--plot-dir", str(tmp_path)]) == 0
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


def test_single_scenario_and_bad_arguments(tmp_path, capsys):
    out, png = tmp_path / "s.json", tmp_path / "s.png"
    assert main(["scale", "--quick", "--json", str(out), "--plot", str(png)]) == 0
    assert json.loads(out.read_text())["scenario"] == "scale" and png.stat().st_size > 0
    for argv in (
        ["nope"],
        ["chaos", "--seed", "-1"],
        ["all", "--plot", "x.png"],
        ["chaos", "--plot-dir", "d"],
    ):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2
