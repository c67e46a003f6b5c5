"""Sparse pseudo-gradients against int4 and none: decoupled, equal tokens, several seeds.

    python -m bench.sparse_compare --seeds 0,1,2 --steps 200 --json bench/results/sparse.json

Each variant is (contribution compression, global compression, density); every run is the
in-process driver (`trainer.train.run_local`, decoupled) at the engine's defaults otherwise, so
every payload goes through its wire format and the bytes are the payloads' own lengths. Bytes
per token are bytes up + down over the job's tokens; data-parallel's figure is the ring
all-reduce `run_local('ddp')` counts, 2 (M - 1) x 4 x params per step over M x batch x seq tokens.
`--part i/n` runs every n-th run (for parallel processes); `--merge` joins their JSON files.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys

# How bench/results/sparse.json was made (docs/engine.md, "Sparse pseudo-gradients"): three parts in
# parallel, two more variants, then --merge.
RECIPE = [
    "for i in 0 1 2; do python -m bench.sparse_compare --seeds 0,1,2 --steps 200 --part $i/3 "
    "--rows /tmp/sparse/rows$i.json & done; wait",
    "python -m bench.sparse_compare --variants topk4-20% --seeds 0,1,2 --steps 200 "
    "--rows /tmp/sparse/rows3.json",
    "python -m bench.sparse_compare --variants topk2-10% --seeds 0,1,2 --steps 200 "
    "--rows /tmp/sparse/rows4.json",
    "python -m bench.sparse_compare --steps 200 --merge /tmp/sparse/rows{0,1,2,3,4}.json "
    "--json bench/results/sparse.json --markdown bench/results/sparse.md",
]
VARIANTS = {
    "none": ("none", "none", 0.02),
    "int4": ("int4", "int4", 0.02),
    "topk4-2%": ("topk4", "int4", 0.02),
    "topk2-2%": ("topk2", "int4", 0.02),
    "topk4-5%": ("topk4", "int4", 0.05),
    "topk2-10%": ("topk2", "int4", 0.1),
    "topk4-20%": ("topk4", "int4", 0.2),
    "topk4-2%/down": ("topk4", "topk4", 0.02),
}


def run(variants: list[str], seeds: list[int], steps: int, part: tuple[int, int]) -> list[dict]:
    import torch

    from trainer.config import TrainConfig
    from trainer.learner import load_corpus
    from trainer.train import run_local

    torch.set_num_threads(1)
    base = TrainConfig(model="tiny", learners=4, inner_steps=20, steps=steps, eval_batches=32, eval_every=1)
    corpus = load_corpus(base)
    jobs = [(seed, v) for seed in seeds for v in variants]
    rows = []
    for i, (seed, v) in enumerate(jobs):
        if i % part[1] != part[0]:
            continue
        comp, glob, density = VARIANTS[v]
        cfg = base.replace(seed=seed, compression=comp, global_compression=glob, compression_density=density)
        r = run_local(cfg, "decoupled", corpus=corpus)
        row = {"variant": v, "seed": seed, "compression": comp, "global_compression": glob,
               "compression_density": density, "final_val_loss": r["final_val_loss"], "tokens": r["tokens"],
               "bytes_up": r["bytes_up"], "bytes_down": r["bytes_down"], "params": r["params"],
               "wall_s": r["wall_s"]}
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def summarise(rows: list[dict], config: dict) -> dict:
    params = rows[0]["params"]
    M, B, S = config["learners"], config["batch_size"], config["seq_len"]
    ddp_per_token = 2 * (M - 1) * 4 * params / (M * B * S)
    none = {r["seed"]: r["final_val_loss"] for r in rows if r["variant"] == "none"}
    out = {}
    present = {r["variant"] for r in rows}
    for v in [v for v in VARIANTS if v in present]:
        rs = [r for r in rows if r["variant"] == v]
        losses = [r["final_val_loss"] for r in rs]
        per_tok = [(r["bytes_up"] + r["bytes_down"]) / r["tokens"] for r in rs]
        up = [r["bytes_up"] / r["tokens"] for r in rs]
        gaps = [r["final_val_loss"] / none[r["seed"]] - 1 for r in rs if r["seed"] in none]
        out[v] = {
            "mean_val_loss": statistics.fmean(losses),
            "sd_val_loss": statistics.stdev(losses) if len(losses) > 1 else 0.0,
            "min_val_loss": min(losses), "max_val_loss": max(losses),
            "mean_gap_vs_none": statistics.fmean(gaps) if gaps else None,
            "max_gap_vs_none": max(gaps) if gaps else None,
            "bytes_per_token": statistics.fmean(per_tok),
            "bytes_up_per_token": statistics.fmean(up),
            "fewer_bytes_than_ddp": ddp_per_token / statistics.fmean(per_tok),
            "seeds": sorted(r["seed"] for r in rs),
        }
    return {"ddp_bytes_per_token": ddp_per_token, "summary": out}


def table(doc: dict) -> str:
    lines = ["| variant (up / down, density) | final val loss mean +- sd (min-max) | vs none mean (worst) | "
             "bytes/token (up) | x fewer than ddp |", "|---|---|---|---|---|"]
    for v, s in doc["summary"].items():
        comp, glob, d = VARIANTS[v]
        gap = "-"
        if v != "none" and s["mean_gap_vs_none"] is not None:
            gap = f"{s['mean_gap_vs_none']:+.2%} ({s['max_gap_vs_none']:+.2%})"
        dens = f", {d:g}" if comp.startswith("topk") else ""
        lines.append(f"| {v} ({comp} / {glob}{dens}) | {s['mean_val_loss']:.4f} +- {s['sd_val_loss']:.4f} "
                     f"({s['min_val_loss']:.4f}-{s['max_val_loss']:.4f}) | {gap} | "
                     f"{s['bytes_per_token']:.1f} ({s['bytes_up_per_token']:.1f}) | "
                     f"{s['fewer_bytes_than_ddp']:.0f}x |")
    lines.append(f"\ndata-parallel (ring all-reduce, fp32): {doc['ddp_bytes_per_token']:.1f} bytes/token")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--part", default="0/1", help="i/n: run every n-th run starting at i")
    ap.add_argument("--rows", default=None, help="write this part's rows (JSON) here")
    ap.add_argument("--merge", nargs="*", default=None, help="row files to join instead of running")
    ap.add_argument("--json", default=None)
    ap.add_argument("--markdown", default=None)
    a = ap.parse_args(argv)
    from trainer.config import TrainConfig

    if a.merge:
        rows = []
        for path in a.merge:
            with open(path) as fh:
                rows += json.load(fh)
    else:
        i, n = (int(x) for x in a.part.split("/"))
        rows = run(a.variants.split(","), [int(s) for s in a.seeds.split(",")], a.steps, (i, n))
        if a.rows:
            with open(a.rows, "w") as fh:
                json.dump(rows, fh, indent=1)
        if n > 1:
            return 0
    config = TrainConfig(model="tiny", learners=4, inner_steps=20, steps=a.steps, eval_batches=32).to_dict()
    args = " ".join(argv if argv is not None else sys.argv[1:])
    variants = {v: list(VARIANTS[v]) for v in dict.fromkeys(r["variant"] for r in rows)}
    doc = {"command": f"python -m bench.sparse_compare {args}", "produced_by": RECIPE, "config": config,
           "variants": variants,
           **summarise(rows, config), "runs": rows}
    text = table(doc)
    print(text)
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(doc, fh, indent=2)
    if a.markdown:
        with open(a.markdown, "w") as fh:
            fh.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
