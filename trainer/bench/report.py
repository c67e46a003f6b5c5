"""Running a scenario's rows, the printed table, the JSON document and the PNG plot."""

from __future__ import annotations

import json
import math
import time

from trainer.bench.scenarios import TARGET_SLACK, TO_TARGET_CAP, Scenario

COLUMNS = [
    ("strategy", "strategy", "{}"),
    ("goodput", "goodput", "{:.1%}"),
    ("uptime", "uptime", "{:.1%}"),
    ("global_downtime_s", "downtime s", "{:,.0f}"),
    ("time_to_target_s", "to target s", "{:,.0f}"),
    ("final_val_loss", "final loss", "{:.4f}"),
    ("utilisation", "util", "{:.1%}"),
    ("tokens", "tokens", "{:.3g}"),
    ("time_s", "time s", "{:,.0f}"),
    ("energy_j", "energy J", "{:.3g}"),
    ("j_per_token", "J/token", "{:.3g}"),
    ("bytes_sent", "bytes", "{:.3g}"),
]

KEEP = (
    "strategy",
    "goodput",
    "uptime",
    "global_downtime_s",
    "time_to_target_s",
    "tokens_trained",
    "time_trained_s",
    "final_val_loss",
    "utilisation",
    "utilisation_by_class",
    "utilisation_by_pool",
    "tokens",
    "proxy_tokens",
    "time_s",
    "energy_j",
    "j_per_token",
    "bytes_sent",
    "bytes_up",
    "bytes_per_token",
    "bytes_up_per_token",
    "bytes_by_link",
    "failures",
    "lost_per_failure_s",
    "restarts",
    "merges",
    "refused",
    "moves",
    "curve",
    "marks",
    "wall_s",
    "wall_limited",
    "stuck",
    "skipped_sends",
)


def time_to(curve: list[dict], target: float | None) -> float | None:
    """First virtual time the validation loss reaches `target` (linear between evaluations)."""
    if target is None:
        return None
    prev = None
    for c in curve:
        if c["val_loss"] <= target:
            if prev is None or prev["val_loss"] <= c["val_loss"]:
                return c["t"]
            f = (prev["val_loss"] - target) / (prev["val_loss"] - c["val_loss"])
            return prev["t"] + f * (c["t"] - prev["t"])
        prev = c
    return None


def run_scenario(scn: Scenario, seed: int, quick: bool, progress=print) -> dict:
    from dataclasses import replace

    from trainer.learner import load_corpus
    from trainer.sim.runner import run_strategy

    corpus = load_corpus(scn.rows[0].spec.train)
    t0 = time.perf_counter()
    results: dict[str, dict] = {}
    target = None
    order = sorted(scn.rows, key=lambda r: r.label != scn.reference)
    for row in order:
        spec = replace(row.spec, target_loss=target)
        w = time.perf_counter()
        res = run_strategy(spec, row.strategy, corpus)
        end = res["curve"][-1] if res["curve"] else None
        if spec.max_overrun > 1 and end is not None and res["time_s"] < end["t"]:
            # it trained on past its budget towards the target: the table scores it at its budget
            # (equal tokens), from the same deterministic run stopped there
            trained = {"time_to_target_s": res["time_to_target_s"], "curve": res["curve"],
                       "marks": res["marks"], "tokens_trained": end["tokens"], "time_trained_s": end["t"]}
            res = run_strategy(replace(spec, max_overrun=1.0), row.strategy, corpus)
            res.update(trained)
        res["strategy"] = row.label
        if row.label == scn.reference and res["final_val_loss"] is not None:
            target = res["final_val_loss"] * (1 + TARGET_SLACK)
        results[row.label] = res
        progress(f"  {scn.name}: {row.label:<36} {time.perf_counter() - w:6.1f} s wall")
    for res in results.values():
        res["time_to_target_s"] = time_to(res["curve"], target)
    rows = [{k: results[r.label].get(k) for k in KEEP} for r in scn.rows]
    doc = {
        "scenario": scn.name,
        "seed": seed,
        "quick": quick,
        "description": scn.description,
        "target_loss": target,
        "target_rule": f"final loss of '{scn.reference}' x (1 + {TARGET_SLACK}); each strategy trains on "
                       f"until it reaches it, '-' = not within {TO_TARGET_CAP:g}x its budget",
        "results": rows,
        "settings": scn.settings,
    }
    doc["estimate"] = estimate(scn, results)
    if scn.checks:
        doc["checks"] = scn.checks(results, scn)
    if scn.summary:
        doc.update(scn.summary(results, scn))
    doc["wall_s"] = time.perf_counter() - t0
    return _clean(doc)


ESTIMATE_CAP = TO_TARGET_CAP  # "not within 3x": more than 3x the reference's tokens


def estimate(scn: Scenario, results: dict[str, dict]) -> dict | None:
    """Time to target for the *declared* model, from the loss model (trainer.bench.loss_model),
    each strategy at the effective token rate it sustained in this run (goodput included).

    Never mixed with the measured proxy rows: the target is the loss model's loss of the
    reference strategy after its tokens, x (1 + TARGET_SLACK); data-parallel has no DiLoCo
    penalty, diloco and decoupled that of their M learners at the declared size.
    """
    from trainer.bench import loss_model as lm

    ref = results.get(scn.reference)
    if not ref or not ref.get("tokens") or not ref.get("time_s"):
        return None
    row_by_label = {r.label: r for r in scn.rows}
    model = scn.rows[0].spec.model

    def learners(label: str) -> int:
        row = row_by_label[label]
        return 0 if row.strategy in ("ddp", "elastic-ddp") else row.spec.learners

    target = lm.loss(model.params, ref["tokens"], learners(scn.reference)) * (1 + TARGET_SLACK)
    rows = []
    for r in scn.rows:
        res = results[r.label]
        rate = res["tokens"] / res["time_s"] if res.get("time_s") else 0.0
        m = learners(r.label)
        t = lm.time_to_target(model.params, target, m, rate, cap_tokens=ESTIMATE_CAP * ref["tokens"])
        rows.append({"strategy": r.label, "learners": m, "penalty": lm.penalty(model.params, m),
                     "extrapolated": m > 0 and lm.penalty_is_extrapolated(model.params, m),
                     "tokens_per_s": rate, "time_to_target_s": t})
    t_ref = next(x["time_to_target_s"] for x in rows if x["strategy"] == scn.reference)
    for x in rows:
        x["vs_reference"] = t_ref / x["time_to_target_s"] if t_ref and x["time_to_target_s"] else None
    return {"model": model.name, "params": model.params, "target_loss": target,
            "rule": f"loss model L(N, D) of '{scn.reference}' after its tokens x (1 + {TARGET_SLACK}); "
                    f"'-' = not within {ESTIMATE_CAP:g}x its tokens", "rows": rows}


def estimate_text(doc: dict, markdown: bool = False) -> str:
    """The estimate as its own, labelled table."""
    est = doc.get("estimate")
    if not est:
        return ""
    head = ["strategy", "M", "penalty", "tokens/s", "to target s", "vs reference"]
    body = [[x["strategy"], str(x["learners"] or "dp"),
             f"{x['penalty']:+.2%}" + (" (extrapolated)" if x["extrapolated"] else ""),
             _fmt(x["tokens_per_s"], "{:.3g}"), _fmt(x["time_to_target_s"], "{:,.0f}"),
             _fmt(x["vs_reference"], "{:.2f}x")] for x in est["rows"]]
    title = (f"ESTIMATE for the declared {est['model']} ({est['params']:.3g} parameters), not measured: "
             f"target {est['target_loss']:.4f} ({est['rule']})")
    if markdown:
        return "\n".join([f"*{title}*", "", *_md_rows(head, body)])
    widths = [max(len(h), *(len(b[i]) for b in body)) for i, h in enumerate(head)]
    lines = [title, "  ".join(h.ljust(w) for h, w in zip(head, widths, strict=True))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(b, widths, strict=True)) for b in body]
    return "\n".join(lines)


def _clean(x):
    """JSON-safe: NaN/inf become null, tuples lists, dict keys strings."""
    if isinstance(x, float):
        return None if math.isnan(x) or math.isinf(x) else x
    if isinstance(x, dict):
        return {str(k): _clean(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_clean(v) for v in x]
    return x


def _fmt(v, spec: str) -> str:
    if v is None:
        return "-"
    try:
        return spec.format(v)
    except (ValueError, TypeError):
        return str(v)


def table(doc: dict, markdown: bool = False) -> str:
    head = [h for _, h, _ in COLUMNS]
    body = [[_fmt(r.get(k), f) for k, _, f in COLUMNS] for r in doc["results"]]
    if markdown:
        lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
        lines += ["| " + " | ".join(row) + " |" for row in body]
        return "\n".join(lines)
    widths = [max(len(h), *(len(row[i]) for row in body)) for i, h in enumerate(head)]
    out = [
        "  ".join(
            h.ljust(w) if i == 0 else h.rjust(w) for i, (h, w) in enumerate(zip(head, widths, strict=True))
        )
    ]
    for row in body:
        out.append(
            "  ".join(
                c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True))
            )
        )
    return "\n".join(out)


def checks_text(doc: dict) -> str:
    lines = []
    for c in doc.get("checks", []):
        v = c["value"]
        vs = f"{v:.4g}" if isinstance(v, float) else str(v)
        met = {True: "met", False: "MISSED", None: "-"}[c["met"]]
        lines.append(
            f"  {c['check']}: {vs} (target {c['target']}) {met}" + (f"  [{c['note']}]" if c["note"] else "")
        )
    cal = doc.get("calibration")
    if cal:
        lines.append(
            f"  calibration: lambda={cal['lambda_per_s']:.4f}/s R={cal['R_s']:.0f}s "
            f"W={cal['W_s_measured']:.1f}s S={cal['S_s']:.0f}s D={cal['D_s']:.0f}s; formula ddp "
            f"{cal['formula_ddp']:.1%}, elastic {cal['formula_elastic']:.1%}, decoupled "
            f"{cal['formula_decoupled']:.1%}"
        )
    return "\n".join(lines)


def _md_rows(head: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|",
            *("| " + " | ".join(r) + " |" for r in rows)]


def markdown(doc: dict, image_dir: str = "../bench/results") -> str:
    """One scenario as the section docs/benchmarks.md shows, so the doc is pasted, not retyped."""
    out = [f"#### {doc['scenario']}", "", doc["description"][:1].upper() + doc["description"][1:] + ".", ""]
    if doc["scenario"] == "scale":
        rows = [[r["strategy"], f"{r['goodput']:.1%}", f"{r['global_downtime_s']:,.0f}"]
                for r in doc["results"]]
        out += _md_rows(["strategy", "goodput", "global downtime s"], rows)
    else:
        out.append(table(doc, markdown=True))
    if doc.get("target_loss"):
        out += ["", f"Target loss {doc['target_loss']:.4f} ({doc['target_rule']})."]
    if doc.get("estimate"):
        out += ["", estimate_text(doc, markdown=True)]
    if doc.get("checks"):
        rows = []
        for c in doc["checks"]:
            v = c["value"]
            met = {True: "yes", False: "**no**", None: "-"}[c["met"]]
            rows.append([c["check"], "-" if v is None else f"{v:.3g}" if isinstance(v, float) else str(v),
                         str(c["target"]), met])
        out += ["", *_md_rows(["check", "value", "target", "met"], rows)]
    out += ["", f"![{doc['scenario']}]({image_dir}/{doc['scenario']}.png)", "",
            f"Wall time: {doc['wall_s']:.0f} s.", ""]
    return "\n".join(out)


def plot(doc: dict, path: str) -> None:
    """Validation loss against virtual time per strategy; below it, one row of failure marks per
    strategy (the same schedule, met at different times since each strategy runs its own course)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = doc["results"]
    fig, (ax, axf) = plt.subplots(2, 1, figsize=(9, 6), sharex=True, gridspec_kw={"height_ratios": [4, 1.3]})
    spans = []
    for i, r in enumerate(rows):
        curve = r.get("curve") or []
        color = f"C{i % 10}"
        if curve:
            ts = [c["t"] for c in curve]
            spans.append(max(ts))
            ax.plot(ts, [c["val_loss"] for c in curve], marker="o", ms=3, color=color, label=r["strategy"])
        fails = [m["t"] for m in r.get("marks") or [] if m.get("kind") in ("failure", "pool failure")]
        axf.plot(fails, [i] * len(fails), "|", color=color, ms=8)
    if doc.get("target_loss"):
        ax.axhline(doc["target_loss"], color="grey", ls="--", lw=0.8, label="target loss")
    if spans and max(spans) / max(min(spans), 1e-9) > 20:
        ax.set_xscale("log")
    axf.set_yticks(range(len(rows)), [r["strategy"] for r in rows], fontsize=7)
    axf.set_ylim(-0.7, len(rows) - 0.3)
    axf.set_xlabel("virtual time (s)")
    axf.set_title("failures", fontsize=8, loc="left")
    ax.set_ylabel("validation loss (nats/byte, proxy)")
    ax.set_title(f"{doc['scenario']}: loss vs virtual time")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    axf.grid(alpha=0.3, axis="x")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_scale(doc: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    names = [r["strategy"] for r in doc["results"]]
    ax.bar(names, [r["goodput"] for r in doc["results"]], color=["#c44", "#e93", "#393"])
    ax.set_ylim(0, 1)
    ax.set_ylabel("goodput")
    ax.set_title(doc["description"], fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_json(doc, path: str) -> None:
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
