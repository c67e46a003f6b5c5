"""`make wan`: the WAN advantage measured on real processes. Three sites behind uplinks shaped at
B Mbit/s; the same model and token budget trained three ways at each B:

  decoupled      one learner per site, the platform's defaults
  diloco         the same learners, every merge waits for all three (quorum = M)
  data-parallel  one learner island over three nodes, one per site (the harness's spanning pool),
                 every inner step's gradients all-reduced over the shaped uplinks; M = 1, its
                 outer step a plain copy (outer lr 1, no momentum) every `DP_H` steps so the
                 syncer can evaluate it

Per run: time from the first step to the data-parallel run's final loss x 1.01 (`time_to_target_s`,
None when a run ends above it), bytes through the three uplinks from the interfaces' own counters,
tokens, final loss, and `tokens_per_s` (whole run). Written to bench/results/wan-real.json (+ .md,
.png). WAN_QUICK=1: two rates and half the budget.
"""
from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path

from .sites import Sites, SitesError, SiteSpec

SITES = ("s1", "s2", "s3")
SPAN = "dp"
DP_H = 32
TERMINAL = ("completed", "failed", "cancelled")


def specs(steps: int, seed: int) -> dict[str, dict]:
    base = {"model": "tiny", "batch_size": 8, "seq_len": 32, "warmup_steps": 4, "steps": steps,
            "eval_interval": 2, "checkpoint_interval": 100, "seed": seed, "grace_cap_s": 0.5}
    return {
        "data-parallel": {**base, "name": "wan data-parallel", "learners": 1, "quorum": 1, "batch_size": 24,
                          "devices_per_learner": 3, "nodes_per_learner": 3, "pools": [SPAN],
                          "inner_steps": DP_H, "outer_lr": 1.0, "outer_momentum": 0.0, "rda": False,
                          "final_average": False},
        "decoupled": {**base, "name": "wan decoupled", "learners": 3, "pools": list(SITES)},
        "diloco": {**base, "name": "wan diloco", "learners": 3, "quorum": 3, "pools": list(SITES)},
    }


class Wan:
    def __init__(self, tmp: Path | str, *, bandwidths: tuple[float, ...], steps: int, seed: int = 11,
                 log=print):
        self.tmp, self.bandwidths, self.steps, self.seed, self.log = Path(tmp), bandwidths, steps, seed, log
        self.runs: list[dict] = []

    def bytes(self, sites: Sites) -> int:
        return sum(c["tx_bytes"] + c["rx_bytes"] for c in (sites.uplink_bytes(s) for s in SITES))

    def run_one(self, sites: Sites, strategy: str, spec: dict, mbit: float, target: float | None) -> dict:
        before = self.bytes(sites)
        job = sites.submit(spec)
        deadline = time.monotonic() + 1800
        while sites.sql("select status from jobs_job where id=%s", [job])[0][0] not in TERMINAL:
            if time.monotonic() > deadline:
                raise SitesError(f"{strategy} at {mbit} Mbit/s did not finish in 30 min")
            time.sleep(1)
        used = self.bytes(sites) - before
        status, reason, final, tokens, start, end = sites.sql(
            "select status, status_reason, final_val_loss, tokens_contributed, "
            "extract(epoch from started_at), extract(epoch from finished_at) from jobs_job where id=%s",
            [job])[0]
        first = sites.sql("select extract(epoch from min(time)) from jobs_metricpoint where job_id=%s "
                          "and name = 'tokens_per_s'", [job])[0][0]
        t0 = float(first or start)  # from the first reported step (placement and imports excluded)
        curve = [(float(t) - t0, float(v)) for t, v in sites.sql(
            "select extract(epoch from time), value from jobs_metricpoint where job_id=%s "
            "and name='val_loss' and learner_id is null order by time", [job])]
        learner_tok_s = sites.sql("select avg(value) from jobs_metricpoint where job_id=%s "
                                  "and name = 'tokens_per_s' and learner_id is not null", [job])[0][0]
        goal = target if target is not None else (final * 1.01 if final else None)
        reached = next((t for t, v in curve if goal is not None and v <= goal), None)
        wall = float(end) - t0 if end else None
        row = {"strategy": strategy, "bandwidth_mbit": mbit, "job": job, "status": status,
               "time_to_target_s": round(reached, 2) if reached is not None else None,
               "target_loss": round(goal, 4) if goal else None, "wall_s": round(wall, 2) if wall else None,
               "uplink_bytes": used, "tokens": int(tokens or 0),
               "bytes_per_token": round(used / tokens, 1) if tokens else None,
               "tokens_per_s": round(tokens / wall, 1) if tokens and wall else None,
               "learner_tokens_per_s": round(float(learner_tok_s), 1) if learner_tok_s else None,
               "final_loss": final, "val_loss_curve": [(round(t, 2), round(v, 4)) for t, v in curve]}
        if status != "completed":
            row["reason"] = reason
        self.log(f"  {strategy:14s} {mbit:>6} Mbit/s: {row['wall_s']} s, target at "
                 f"{row['time_to_target_s']} s, {used / 1e6:.1f} MB through the uplinks, final loss {final}")
        return row

    def run(self) -> list[dict]:
        sites_spec = [SiteSpec(s, self.bandwidths[0], 1, 1) for s in SITES]
        with Sites(self.tmp, sites_spec, spanning_pool=SPAN) as sites:
            for mbit in self.bandwidths:
                for s in SITES:
                    sites.shape(s, mbit)
                self.log(f"{mbit} Mbit/s per site:")
                runs = specs(self.steps, self.seed)
                dp = self.run_one(sites, "data-parallel", runs.pop("data-parallel"), mbit, None)
                target = dp["target_loss"]
                self.runs.append(dp)
                for name, spec in runs.items():
                    self.runs.append(self.run_one(sites, name, spec, mbit, target))
        return self.runs


def add_simulated(runs: list[dict], steps: int, seed: int, log=print) -> None:
    """Beside each measured row, the simulator's time to target for the same fleet (devices at the
    step time decoupled's learners measured at that bandwidth, links at the shaped rate)."""
    from .wan_sim import simulate

    names = {"data-parallel": "ddp", "diloco": "diloco", "decoupled": "decoupled"}
    for mbit in sorted({r["bandwidth_mbit"] for r in runs}, reverse=True):
        at = {r["strategy"]: r for r in runs if r["bandwidth_mbit"] == mbit}
        tok_s = (at.get("decoupled") or {}).get("learner_tokens_per_s")
        if not tok_s:
            continue
        step = 8 * 32 / tok_s
        sim = simulate(mbit, step, steps, seed)
        for name, row in at.items():
            got = sim.get(names[name], {})
            row["simulated"] = {**got, "step_time_s": round(step, 4), "label": "model-based estimate"}
            t_sim, t_real = got.get("time_to_target_s"), row.get("time_to_target_s")
            row["simulated"]["difference"] = round(t_sim / t_real - 1, 3) if t_sim and t_real else None
        log(f"  simulated at {mbit} Mbit/s (step {step * 1000:.0f} ms): "
            + ", ".join(f"{k} {v['time_to_target_s']}" for k, v in sim.items()))


def speedups(runs: list[dict]) -> list[dict]:
    """Per bandwidth: data-parallel's time to its target over each strategy's, and bytes per token ratio."""
    out = []
    for mbit in sorted({r["bandwidth_mbit"] for r in runs}, reverse=True):
        at = {r["strategy"]: r for r in runs if r["bandwidth_mbit"] == mbit}
        dp = at.get("data-parallel")
        for name in ("decoupled", "diloco"):
            r = at.get(name)
            if not (dp and r):
                continue
            out.append({"bandwidth_mbit": mbit, "strategy": name,
                        "sooner_x": round(dp["time_to_target_s"] / r["time_to_target_s"], 2)
                        if dp["time_to_target_s"] and r["time_to_target_s"] else None,
                        "fewer_bytes_per_token_x": round(dp["bytes_per_token"] / r["bytes_per_token"], 1)
                        if dp["bytes_per_token"] and r["bytes_per_token"] else None})
    return out


def markdown(runs: list[dict], ratios: list[dict]) -> str:
    lines = ["| strategy | Mbit/s per site | time to target (s) | simulated (s, estimate) | wall (s) | "
             "uplink MB | bytes/token | final loss |", "|---|---|---|---|---|---|---|---|"]
    for r in runs:
        head = f"| {r['strategy']} | {r['bandwidth_mbit']:g} |"
        if r["final_loss"] is None:
            lines.append(f"{head} - | - | - | - | - | {r['status']} |")
            continue
        sim = (r.get("simulated") or {}).get("time_to_target_s")
        sim = f"{sim:.1f}" if sim is not None else "-"
        lines.append(f"{head} {r['time_to_target_s']} | {sim} | {r['wall_s']} | "
                     f"{r['uplink_bytes'] / 1e6:.1f} | {r['bytes_per_token']} | {r['final_loss']:.4f} |")
    lines += ["", "| Mbit/s | strategy | reaches data-parallel's target ... x sooner | "
                  "... x fewer bytes per token |", "|---|---|---|---|"]
    lines += [f"| {x['bandwidth_mbit']:g} | {x['strategy']} | {x['sooner_x']} | "
              f"{x['fewer_bytes_per_token_x']} |" for x in ratios]
    return "\n".join(lines) + "\n"


def plot(runs: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name in ("data-parallel", "diloco", "decoupled"):
        pts = sorted((r["bandwidth_mbit"], r["time_to_target_s"]) for r in runs
                     if r["strategy"] == name and r["time_to_target_s"] is not None)
        if pts:
            ax.plot(*zip(*pts, strict=True), marker="o", label=name)
    ax.set_xscale("log")
    ax.set_xlabel("uplink per site (Mbit/s, tc tbf)")
    ax.set_ylabel("time to data-parallel's final loss x 1.01 (s)")
    ax.set_title("tiny model, 3 sites, measured")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    quick = bool(os.environ.get("WAN_QUICK"))
    bandwidths = (100.0, 20.0) if quick else (1000.0, 100.0, 20.0)
    steps = 60 if quick else 120
    out = Path(os.environ.get("WAN_OUT", "bench/results"))
    out.mkdir(parents=True, exist_ok=True)
    wan = Wan(tempfile.mkdtemp(prefix="wan-"), bandwidths=bandwidths, steps=steps,
              log=lambda m: print(m, flush=True))
    runs = wan.run()
    if not os.environ.get("WAN_NO_SIM"):
        add_simulated(runs, steps, wan.seed, log=lambda m: print(m, flush=True))
    ratios = speedups(runs)
    report = {"quick": quick, "steps_per_learner": steps, "model": "tiny", "sites": list(SITES),
              "note": "measured on one machine's 2 CPU cores shared by every site; links shaped with tc tbf "
                      "(rate only, no added latency)", "runs": runs, "speedups": ratios}
    (out / "wan-real.json").write_text(json.dumps(report, indent=2))
    table = markdown(runs, ratios)
    (out / "wan-real.md").write_text(table)
    plot(runs, out / "wan-real.png")
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
