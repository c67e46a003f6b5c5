"""`make perf`: every performance figure of issue 19 in one table (JSON + markdown).

Runs, each as its own process so their figures do not disturb one another:

1. the engine: `python -m trainer.perf --json` (learner step against the bare loop, syncer
   merge/submit/encode/decode bandwidth); every number it reports becomes a row;
2. the in-process runner: `python -m trainer train` ddp, diloco and decoupled on the tiny model,
   M=4, the same steps (so the same tokens), wall time and the ratio to ddp (target <= 1.3x);
3. the API: `manage.py api_bench` (1 and 20 clients: p50/p95/p99, req/s) when a database is
   configured (DATABASE_URL), else the row says it was skipped.

PERF_QUICK=1 (or --quick) shortens every part (200 runner steps instead of 1600, fewer API
requests) for a smoke run. Writes bench/results/perf.json and perf.md and prints the table.
Figures are printed, never asserted: a target missed shows "no" in the `met` column.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
RUNNER_TARGET = 1.3  # decoupled/diloco wall time <= 1.3x ddp's (issue 19)
STRATEGIES = ("ddp", "diloco", "decoupled")
API_FIGURES = (("p50_ms", "ms"), ("p95_ms", "ms"), ("p99_ms", "ms"), ("throughput_rps", "req/s"),
               ("server_cpu_ms_per_request", "ms/request"), ("client_cpu_ms_per_request", "ms/request"))


def _run(cmd: list[str], timeout: float, env: dict[str, str] | None = None) -> tuple[int, str, float]:
    """Run `cmd` from the repository root: (exit code, output tail, wall seconds)."""
    t0 = time.perf_counter()
    try:
        one_thread = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                              env={**os.environ, **one_thread, **(env or {})})
    except subprocess.TimeoutExpired:
        return 124, f"timed out after {timeout:.0f} s", time.perf_counter() - t0
    return proc.returncode, (proc.stdout + proc.stderr)[-3000:], time.perf_counter() - t0


def _row(section: str, measure: str, value, unit: str = "", target: str = "",
         met: bool | None = None) -> dict:
    return {"section": section, "measure": measure, "value": value, "unit": unit, "target": target,
            "met": met}


def _flatten(prefix: str, doc) -> list[tuple[str, float]]:
    """Every number under `doc` as (dotted.path, value); lists of dicts keyed by their `model`."""
    if isinstance(doc, bool):
        return []
    if isinstance(doc, int | float):
        return [(prefix, doc)]
    out: list[tuple[str, float]] = []
    if isinstance(doc, dict):
        for k, v in doc.items():
            out += _flatten(f"{prefix}.{k}" if prefix else str(k), v)
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            key = v.get("model", i) if isinstance(v, dict) else i
            out += _flatten(f"{prefix}[{key}]", v)
    return out


def engine(quick: bool) -> tuple[list[dict], dict]:
    """`python -m trainer.perf` with its own defaults (fewer steps and repeats when quick)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "perf.json"
        cmd = [sys.executable, "-m", "trainer.perf", "--json", str(path)]
        if quick:
            cmd += ["--steps", "10", "--repeats", "2"]
        code, tail, wall = _run(cmd, timeout=3600)
        if code or not path.exists():
            return [_row("engine", "trainer.perf", f"failed ({code})", target=tail[-300:])], {"error": tail}
        doc = json.loads(path.read_text())
    doc.pop("learner", None)  # the first of "learners", listed there already
    rows = [_row("engine", name, value) for name, value in _flatten("", doc)]
    rows.append(_row("engine", "trainer.perf wall time", round(wall, 1), "s"))
    return rows, doc


def runner(quick: bool, steps: int | None = None) -> tuple[list[dict], dict]:
    """Wall time of the in-process runner per strategy, tiny model, M=4, the same tokens."""
    steps = steps or (200 if quick else 1600)
    runs: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for strategy in STRATEGIES:
            path = Path(tmp) / f"{strategy}.json"
            code, tail, wall = _run([sys.executable, "-m", "trainer", "train", "--strategy", strategy,
                                     "--model", "tiny", "-M", "4", "--steps", str(steps), "--threads", "1",
                                     "--quiet", "--json", str(path)], timeout=7200)
            if code or not path.exists():
                runs[strategy] = {"error": tail[-300:], "exit": code}
                continue
            report = json.loads(path.read_text())
            runs[strategy] = {k: report.get(k) for k in ("wall_s", "tokens", "final_val_loss")}
            runs[strategy]["process_wall_s"] = wall
    rows = []
    base = runs.get("ddp", {}).get("wall_s")
    for strategy, r in runs.items():
        label = f"train {strategy} (tiny, M=4, {steps} steps)"
        if "error" in r:
            rows.append(_row("runner", label, f"failed ({r['exit']})", target=r["error"]))
            continue
        rows.append(_row("runner", f"{label} wall time", round(r["wall_s"], 1), "s"))
        rows.append(_row("runner", f"{label} tokens", r["tokens"]))
        if strategy != "ddp" and base:
            ratio = r["wall_s"] / base
            rows.append(_row("runner", f"{strategy} / ddp wall time", round(ratio, 2), "x",
                             f"<= {RUNNER_TARGET}", ratio <= RUNNER_TARGET))
    return rows, {"steps": steps, "runs": runs}


def api(quick: bool) -> tuple[list[dict], dict]:
    """`manage.py api_bench` against the production web process (needs DATABASE_URL)."""
    if not os.environ.get("DATABASE_URL"):
        return [_row("api", "api_bench", "skipped: set DATABASE_URL (PostgreSQL) and REDIS_URL")], {}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "api.json"
        cmd = [sys.executable, "manage.py", "api_bench", "--json", str(path)]
        if quick:
            cmd += ["--requests", "10"]
        code, tail, _ = _run(cmd, timeout=1800)
        if code or not path.exists():
            return [_row("api", "api_bench", f"failed ({code})", target=tail[-300:])], {"error": tail}
        doc = json.loads(path.read_text())
    rows = []
    for level, results in doc["runs"].items():
        for name, r in results.items():
            for key, unit in API_FIGURES:
                if r.get(key) is not None:
                    label = key.split("_")[0] + (" CPU" if key.endswith("cpu_ms_per_request") else "")
                    rows.append(_row("api", f"{level} client(s), {name}: {label}", round(r[key], 2), unit))
    rows += [_row("api", "target", t["value"], target=t["target"], met=t["met"]) for t in doc["targets"]]
    rows.append(_row("api", "server", doc["server"]))
    return rows, doc


def markdown(rows: list[dict], header: str) -> str:
    lines = [header, "", "| section | measure | value | unit | target | met |", "|---|---|---|---|---|---|"]
    for r in rows:
        value = f"{r['value']:.4g}" if isinstance(r["value"], float) else str(r["value"])
        met = "" if r["met"] is None else ("yes" if r["met"] else "no")
        target = str(r["target"]).replace("|", "/").replace("\n", " ")
        lines.append(f"| {r['section']} | {r['measure']} | {value} | {r['unit']} | {target} | {met} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python bench/perf_report.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", default=os.environ.get("PERF_QUICK") == "1",
                   help="shorter runs (also PERF_QUICK=1)")
    p.add_argument("--only", default="engine,runner,api", help="parts to run, comma-separated")
    p.add_argument("--runner-steps", type=int, default=None, help="inner steps of the runner part")
    p.add_argument("--out", default=str(RESULTS), help="folder for perf.json and perf.md")
    a = p.parse_args(argv)
    parts = {"engine": lambda: engine(a.quick), "runner": lambda: runner(a.quick, a.runner_steps),
             "api": lambda: api(a.quick)}
    rows: list[dict] = []
    raw: dict = {}
    for name in a.only.split(","):
        if name not in parts:
            p.error(f"--only: unknown part {name!r} (engine, runner, api)")
        t0 = time.perf_counter()
        print(f"perf: {name} ...", file=sys.stderr, flush=True)
        part_rows, raw[name] = parts[name]()
        rows += part_rows
        print(f"perf: {name} done in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    header = (f"Performance figures ({'quick' if a.quick else 'full'} run, {os.cpu_count()} CPUs, "
              f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())})")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    doc = {"quick": a.quick, "cpu_count": os.cpu_count(), "rows": rows, "raw": raw}
    (out / "perf.json").write_text(json.dumps(doc, indent=2))
    text = markdown(rows, header)
    (out / "perf.md").write_text(text)
    print(text)
    print(f"wrote {out / 'perf.json'} and {out / 'perf.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
