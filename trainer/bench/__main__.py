"""python -m trainer.bench SCENARIO [--quick] [--seed S] [--json PATH] [--plot PATH]
python -m trainer.bench all [--quick] [--seed S] [--json PATH] [--plot-dir DIR] [--markdown PATH]"""

from __future__ import annotations

import argparse
import os
import sys

from trainer.bench import report
from trainer.bench.scenarios import ALL, SCENARIOS, scale


def _one(name: str, quick: bool, seed: int) -> dict:
    if name == "scale":
        doc = scale(quick, seed)
    else:
        doc = report.run_scenario(SCENARIOS[name](quick, seed), seed, quick, progress=_err)
    print(f"\n== {name}{' (quick)' if quick else ''}, seed {seed}: {doc['description']}")
    print(report.table(doc))
    if doc.get("estimate"):
        print(report.estimate_text(doc))
    print(report.checks_text(doc))
    sys.stdout.flush()
    return doc


def _err(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m trainer.bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("scenario", choices=[*ALL, "all"])
    ap.add_argument("--quick", action="store_true", help="few inner steps: a smoke run (well under a minute)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", metavar="PATH", help="write the results as JSON")
    ap.add_argument("--plot", metavar="PATH", help="write a PNG: loss against virtual time, failures marked")
    ap.add_argument("--plot-dir", metavar="DIR", help="with 'all': one PNG per scenario in DIR")
    ap.add_argument("--markdown", metavar="PATH", help="write each scenario's section of docs/benchmarks.md")
    args = ap.parse_args(argv)
    if args.seed < 0:
        ap.error("--seed must be >= 0")
    import torch

    torch.set_num_threads(1)
    if args.scenario == "all":
        if args.plot:
            ap.error("--plot takes one scenario; use --plot-dir with 'all'")
        docs = []
        for name in ALL:
            doc = _one(name, args.quick, args.seed)
            docs.append(doc)
            if args.plot_dir:
                os.makedirs(args.plot_dir, exist_ok=True)
                path = os.path.join(args.plot_dir, f"{name}.png")
                (report.plot_scale if name == "scale" else report.plot)(doc, path)
        if args.json:
            report.write_json({"scenarios": docs, "seed": args.seed, "quick": args.quick}, args.json)
        if args.markdown:
            with open(args.markdown, "w") as fh:
                fh.write("\n".join(report.markdown(d) for d in docs))
        return 0
    if args.plot_dir:
        ap.error("--plot-dir goes with 'all'; use --plot PATH for one scenario")
    doc = _one(args.scenario, args.quick, args.seed)
    if args.json:
        report.write_json(doc, args.json)
    if args.markdown:
        with open(args.markdown, "w") as fh:
            fh.write(report.markdown(doc))
    if args.plot:
        (report.plot_scale if args.scenario == "scale" else report.plot)(doc, args.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
