"""The sites drill: a decoupled job across three sites, fault-free, then the same job through a
partition of one site and the loss of another; then a job whose busiest site's uplink is cut to
a tenth (a job of its own: a slower link is meant to change the schedule, so its loss is not
compared); then an island over two nodes with one node cut. Measured from the control plane's rows.

    report = SitesDrill(tmp, quick=True).run()      # python manage.py sites_drill --quick --json r.json

Report: `incidents` (kind, pool, time_to_detect_s, time_to_heal_s, tokens_lost), `faults` (what
was done when, and what the platform did), `max_outer_step_gap_s`, `duplicates_applied`,
`fenced_applied` (a lost incarnation's contribution applied after detection over tokens a newer
incarnation contributed), `tokens_lost`, `status`, `val_loss_rel_diff` against the fault-free
run on the same sites, `slow_site_job` and `island`.
"""
from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

from .sites import Sites, SitesError, SiteSpec

# Two slots a site (room to move a lost learner), the job on s1-s3; s4 (three one-slot nodes) for
# the island, which needs two nodes and a third to move to.
SITES = [SiteSpec("s1", 1000, nodes=1, slots=2), SiteSpec("s2", 100, nodes=1, slots=2),
         SiteSpec("s3", 20, nodes=1, slots=2), SiteSpec("s4", 1000, nodes=3, slots=1)]
SPEC = {
    "name": "sites drill", "model": "tiny", "learners": 3, "quorum": 1, "inner_steps": 8, "fragments": 1,
    "steps": 2000, "batch_size": 8, "seq_len": 32, "warmup_steps": 4, "eval_interval": 8,
    "checkpoint_interval": 16, "grace_cap_s": 0.5, "seed": 5, "pools": ["s1", "s2", "s3"],
}
QUICK_STEPS = 800
# The full run's 2000 steps give the rebalancer time to move a learner to the 20 Mbit/s site, whose
# uplink cannot carry uncompressed contributions of this job (3.3 MB every 8 steps, ~0.7 s): its
# heartbeats then queue past the timeout and the "fault-free" run loses a learner (seen: 21% of its
# tokens, a 90 s gap). int4 both ways (8x fewer bytes) is what an operator would set for such a fleet.
FULL_SPEC = {**SPEC, "compression": "int4", "global_compression": "int4"}
ISLAND_SPEC = {**SPEC, "name": "sites drill (island)", "learners": 1, "devices_per_learner": 2,
               "nodes_per_learner": 2, "steps": 120, "pools": ["s4"]}
TERMINAL = ("completed", "failed", "cancelled")


class SitesDrill:
    def __init__(self, tmp: Path | str, *, quick: bool = True, log: Callable[[str], object] = print,
                 sites: list[SiteSpec] | None = None, spec: dict | None = None,
                 partition_s: float | None = None,
                 faults: tuple[str, ...] = ("partition", "site_loss", "slow_site", "island_node"),
                 least_privilege: bool = True, baseline: bool = True):
        self.least_privilege = least_privilege
        self.with_baseline = baseline
        self.tmp = Path(tmp)
        self.quick = quick
        self.log = log
        self.site_specs = sites or [SiteSpec(s.name, s.mbit, s.nodes, s.slots) for s in SITES]
        self.spec = dict(spec or (FULL_SPEC if not quick else {**SPEC, "steps": QUICK_STEPS}))
        self.partition_s = partition_s if partition_s is not None else (20.0 if quick else 60.0)
        self.faults = faults
        self.report: dict = {"quick": quick, "spec": self.spec, "faults": [], "incidents": [],
                             "sites": {s.name: {"mbit": s.mbit, "nodes": s.nodes, "slots": s.slots}
                                       for s in self.site_specs}}

    # ------------------------------------------------------------------ reading the control plane
    def job(self, sites: Sites, job: int) -> dict:
        row = sites.sql("select status, outer_steps, initial_val_loss, final_val_loss, tokens_computed, "
                        "tokens_contributed, tokens_lost, status_reason from jobs_job where id=%s", [job])[0]
        keys = ("status", "outer_steps", "initial_val_loss", "final_val_loss", "tokens_computed",
                "tokens_contributed", "tokens_lost", "status_reason")
        return dict(zip(keys, row, strict=True))

    def learners(self, sites: Sites, job: int) -> list[dict]:
        rows = sites.sql("select l.index, l.incarnation, l.state, p.slug from jobs_learner l "
                         "left join inventory_pool p on p.id = l.pool_id where l.job_id=%s "
                         "order by l.index", [job])
        return [{"index": i, "incarnation": inc, "state": s, "pool": p} for i, inc, s, p in rows]

    def incidents(self, sites: Sites, job: int) -> list[dict]:
        rows = sites.sql(
            "select i.kind, p.slug, l.index, i.details, extract(epoch from i.detected_at - i.failed_at), "
            "extract(epoch from i.healed_at - i.detected_at), i.tokens_lost, "
            "extract(epoch from i.detected_at) from jobs_incident i "
            "left join inventory_pool p on p.id = i.pool_id left join jobs_learner l on l.id = i.learner_id "
            "where i.job_id=%s order by i.detected_at", [job])
        return [{"kind": k, "pool": p, "learner": idx, "incarnation": (d or {}).get("incarnation"),
                 "time_to_detect_s": _r(det), "time_to_heal_s": _r(heal), "tokens_lost": lost,
                 "detected_at": float(at)} for k, p, idx, d, det, heal, lost, at in rows]

    def outer_steps(self, sites: Sites, job: int) -> list[tuple[float, int, list]]:
        rows = sites.sql("select extract(epoch from created_at), fragment, contributors from jobs_outerstep "
                         "where job_id=%s order by created_at", [job])
        return [(float(t), f, c) for t, f, c in rows]

    def wait(self, sites: Sites, predicate: Callable[[], object], timeout: float, what: str):
        deadline = time.monotonic() + timeout
        while True:
            value = predicate()
            if value:
                return value
            if time.monotonic() > deadline:
                raise SitesError(f"timed out after {timeout:.0f}s waiting for {what}\n{sites.dump_logs(20)}")
            time.sleep(0.5)

    def wait_end(self, sites: Sites, job: int, timeout: float) -> dict:
        self.wait(sites, lambda: self.job(sites, job)["status"] in TERMINAL, timeout, f"job {job} to end")
        return self.job(sites, job)

    # ------------------------------------------------------------------ the drill
    def run(self) -> dict:
        with Sites(self.tmp, self.site_specs, least_privilege=self.least_privilege) as sites:
            shown = ", ".join(f"{s.name} {s.mbit} Mbit/s x{s.nodes}" for s in self.site_specs)
            self.log(f"sites up: {shown}")
            if {"partition", "site_loss"} & set(self.faults):
                base = self.baseline(sites) if self.with_baseline else {}
                self.faulty(sites, base)
            if "slow_site" in self.faults:
                self.slow(sites)
            if "island_node" in self.faults:
                self.report["island"] = self.island(sites)
        return self.report

    def baseline(self, sites: Sites) -> dict:
        self.log("fault-free run ...")
        t0 = time.time()
        job = sites.submit({**self.spec, "name": "sites drill (fault-free)"})
        row = self.wait_end(sites, job, 900)
        self.report["baseline"] = {"job": job, "seconds": round(time.time() - t0, 1), **row,
                                   **gaps(self.outer_steps(sites, job))}
        self.log(f"  {row['status']} in {time.time() - t0:.0f}s, val loss {row['final_val_loss']}")
        return row

    def faulty(self, sites: Sites, base: dict) -> None:
        self.log("faulty run ...")
        t_start = time.time()
        job = sites.submit(self.spec)
        self.wait(sites, lambda: self.job(sites, job)["outer_steps"] >= 2, 180, "outer steps")
        # the site loss first: both faults then fall while every learner still has steps to run,
        # so the gaps measure the platform's recovery, not learners that have finished
        if "site_loss" in self.faults:
            self.site_loss(sites, job, self.victim_site(sites, job, avoid={"s1"}))
        if "partition" in self.faults and self.job(sites, job)["status"] == "running":
            self.partition(sites, job, self.victim_site(sites, job, avoid={"s1"}))
        row = self.wait_end(sites, job, 1200)
        self.summarise(sites, job, row, base, time.time() - t_start)

    def slow(self, sites: Sites) -> None:
        """A job of its own: a slower uplink is meant to change the schedule (work sizes, moves), so
        its loss is not compared with the fault-free run's."""
        self.log("slow-site run ...")
        job = sites.submit({**self.spec, "name": "sites drill (slow site)", "steps": QUICK_STEPS})
        self.wait(sites, lambda: self.job(sites, job)["outer_steps"] >= 2, 180, "outer steps")
        self.slow_site(sites, job)
        row = self.wait_end(sites, job, 1200)
        steps = self.outer_steps(sites, job)
        self.report["slow_site_job"] = {"job": job, **row, "duplicates_applied": len(duplicates(steps)),
                                        **gaps(steps)}

    def _fault(self, name: str, t0: float, **extra) -> None:
        entry = {"fault": name, "at_s": round(t0, 3), **extra}
        self.report["faults"].append(entry)
        self.log(f"  {name}: " + " ".join(f"{k}={v}" for k, v in extra.items()))

    def _incidents_for(self, sites: Sites, job: int, pool: str, since: float) -> list[dict]:
        return [i for i in self.incidents(sites, job) if i["pool"] == pool and i["detected_at"] >= since]

    def victim_site(self, sites: Sites, job: int, avoid: set[str]) -> str:
        """A site running learners of the job, outside `avoid` when one is (else the last site)."""
        busy = [lr["pool"] for lr in self.learners(sites, job) if lr["pool"] and lr["state"] == "running"]
        return next((s for s in busy if s not in avoid), busy[-1] if busy else list(sites.sites)[-1])

    def partition(self, sites: Sites, job: int, site: str) -> None:
        """The site's uplink down for partition_s, then up: lost, moved, fenced, back."""
        on_site = [lr["index"] for lr in self.learners(sites, job) if lr["pool"] == site]
        t0 = time.time()
        sites.partition(site)
        detected = self.wait(sites, lambda: on_site and self._incidents_for(sites, job, site, t0 - 1),
                             60, f"the learners of {site} declared lost") if on_site else []
        time.sleep(max(0.0, self.partition_s - (time.time() - t0)))
        sites.heal(site)
        t_heal = time.time()
        self.wait(sites, lambda: sites.sql(
            "select count(*) from inventory_node n join inventory_pool p on p.id = n.pool_id where p.slug=%s "
            "and n.state='online' and n.last_seen > to_timestamp(%s)", [site, t_heal])[0][0] >= 1,
            120, f"the nodes of {site} back online")
        self._fault("partition", t0, site=site, seconds=round(t_heal - t0, 1), learners_on_site=on_site,
                    detected_after_s=[i["time_to_detect_s"] for i in detected],
                    nodes_back_after_s=round(time.time() - t_heal, 1),
                    learners_now=self.learners(sites, job))

    def site_loss(self, sites: Sites, job: int, site: str) -> None:
        """Every process of the site killed at once; the job goes on elsewhere; the site comes back."""
        on_site = [lr["index"] for lr in self.learners(sites, job) if lr["pool"] == site]
        t0 = time.time()
        sites.kill_site(site)
        healed = []
        if on_site:
            healed = self.wait(sites, lambda: [i for i in self._incidents_for(sites, job, site, t0 - 1)
                                               if i["time_to_heal_s"] is not None]
                               or self.job(sites, job)["status"] in TERMINAL, 180, f"{site}'s work moved")
        sites.start_site(site)
        self._fault("site_loss", t0, site=site, learners_on_site=on_site,
                    healed_after_s=[i["time_to_heal_s"] for i in healed]
                    if isinstance(healed, list) else None,
                    learners_now=self.learners(sites, job))

    def slow_site(self, sites: Sites, job: int) -> None:
        """The busiest site's uplink cut to a tenth; what the rebalancer did about it."""
        counts: dict[str, int] = {}
        for lr in self.learners(sites, job):
            if lr["pool"] and lr["state"] in ("running", "starting"):
                counts[lr["pool"]] = counts.get(lr["pool"], 0) + 1
        if not counts:
            return
        site = max(counts, key=counts.get)
        before = sites.sites[site].mbit or 10_000
        t0 = time.time()
        sites.shape(site, before / 10)
        time.sleep(20 if self.quick else 45)
        events = sites.sql("select kind, message from jobs_event where job_id=%s and time > to_timestamp(%s) "
                           "and kind in ('rebalanced', 'reassigned') order by time", [job, t0])
        sites.shape(site, before)
        why = None if events else (
            "the rebalancer moves and resizes by measured compute throughput (tokens/s of inner steps); "
            "a slower uplink delays a learner's contributions, not its steps, so nothing crossed its "
            "thresholds (DyLU resize >= 25%, moves need a pool measured faster or cheaper)")
        self._fault("slow_site", t0, site=site, mbit=[before, before / 10], events=[m for _, m in events],
                    why_nothing=why)

    def island(self, sites: Sites) -> dict:
        """An island over two nodes of s4; one node partitioned: the island is re-placed whole."""
        status, data = sites.api("POST", "/api/v1/jobs/", {"spec": ISLAND_SPEC})
        if status != 201:
            return {"skipped": f"island spec refused ({status}): {data}"}
        job = int(data["id"])
        self.wait(sites, lambda: self.job(sites, job)["outer_steps"] >= 2, 240, "island outer steps")
        nodes = sites.sql("select n.worker_name from jobs_learner l "
                          "join inventory_node n on n.id = l.node_id where l.job_id=%s", [job])
        rank0 = nodes[0][0].split("@")[0] if nodes else None
        site = ISLAND_SPEC["pools"][0]
        others = [j for j in range(1, sites.sites[site].nodes + 1) if sites.worker_name(site, j) != rank0]
        victim = others[0] if others else 2
        before = self.learners(sites, job)[0]["incarnation"]
        t0 = time.time()
        sites.partition_node(site, victim)
        self.wait(sites, lambda: self.learners(sites, job)[0]["incarnation"] > before
                  and self.learners(sites, job)[0]["state"] == "running", 300, "the island placed again")
        replaced_after = time.time() - t0
        sites.partition_node(site, victim, cut=False)
        row = self.wait_end(sites, job, 900)
        steps = self.outer_steps(sites, job)
        return {"job": job, "status": row["status"], "partitioned_node": sites.worker_name(site, victim),
                "replaced_after_s": round(replaced_after, 1), "incidents": self.incidents(sites, job),
                "duplicates_applied": len(duplicates(steps)), "final_val_loss": row["final_val_loss"]}

    def summarise(self, sites: Sites, job: int, row: dict, base: dict, seconds: float) -> None:
        steps = self.outer_steps(sites, job)
        incidents = self.incidents(sites, job)
        rel = None
        if row["final_val_loss"] is not None and base.get("final_val_loss"):
            rel = (row["final_val_loss"] - base["final_val_loss"]) / base["final_val_loss"]
        self.report.update({
            "job": job, "seconds": round(seconds, 1), **row, "incidents": incidents,
            "every_incident_healed": all(i["time_to_heal_s"] is not None for i in incidents),
            "duplicates_applied": len(duplicates(steps)), "duplicate_details": duplicates(steps)[:10],
            "fenced_applied": (fenced := fenced_applied(steps, incidents))["violations"],
            "predecessor_applied_after_detection": fenced["late"],
            "zombies_refused": _zombies(sites, job),
            "baseline_val_loss": base.get("final_val_loss"),
            "val_loss_rel_diff": _r(rel, 4), **gaps(steps),
            "uplink_bytes": {s: sites.uplink_bytes(s) for s in sites.sites},
        })


def gaps(steps: list[tuple[float, int, list]]) -> dict:
    """The longest stretch without an outer step (every site here stays partly alive)."""
    times = sorted(t for t, _, _ in steps)
    spans = [b - a for a, b in zip(times, times[1:], strict=False)]
    return {"outer_step_records": len(times), "max_outer_step_gap_s": _r(max(spans)) if spans else None}


def applied_ranges(steps: list[tuple[float, int, list]]) -> dict[tuple[int, int], list[tuple[int, int, int]]]:
    """(learner, fragment) -> the token ranges applied, each with its incarnation."""
    ranges: dict[tuple[int, int], list[tuple[int, int, int]]] = {}
    for _, fragment, contributors in steps:
        for c in contributors:
            for r in c.get("ranges", []):
                ranges.setdefault((c["learner"], fragment), []).append(
                    (int(r[0]), int(r[1]), c.get("incarnation") or 0))
    return ranges


def duplicates(steps: list[tuple[float, int, list]]) -> list[dict]:
    """Applied contributions whose token range overlaps one applied before (same learner, fragment)."""
    out = []
    for (learner, fragment), rs in applied_ranges(steps).items():
        rs.sort()
        out += [{"learner": learner, "fragment": fragment, "first": a, "second": b}
                for a, b in zip(rs, rs[1:], strict=False) if b[0] < a[1]]
    return out


def fenced_applied(steps: list[tuple[float, int, list]], incidents: list[dict]) -> dict:
    """Contributions of a lost incarnation applied after its loss was detected.

    The syncer's fencing rule (trainer.runtime.syncer_loop): a predecessor's contribution still
    counts when its token range ends at or before where the successor resumed (those tokens are
    not computed again), and is refused as a zombie otherwise. So `late` may be above 0; `violations`
    (such a contribution overlapping a range a newer incarnation of the learner contributed) must be 0.
    """
    newer = applied_ranges(steps)
    late = violations = 0
    for inc in incidents:
        if inc["learner"] is None or inc["incarnation"] is None:
            continue
        for t, fragment, contributors in steps:
            if t <= inc["detected_at"]:
                continue
            for c in contributors:
                if c["learner"] != inc["learner"] or (c.get("incarnation") or 0) > inc["incarnation"]:
                    continue
                late += 1
                for r in c.get("ranges", []):
                    violations += any(s0 < int(r[1]) and int(r[0]) < e0 and i0 > inc["incarnation"]
                                      for s0, e0, i0 in newer.get((c["learner"], fragment), []))
    return {"late": late, "violations": violations}


def _zombies(sites: Sites, job: int) -> int | None:
    """Contributions the syncer refused as zombies (an old incarnation's recomputed tokens)."""
    rows = sites.sql("select coalesce(sum(zombies_refused), 0) from coordinator_syncerlease "
                     "where job_id=%s", [job])
    return int(rows[0][0]) if rows else None


def _r(x, nd: int = 3):
    return None if x is None else round(float(x), nd)


def run_sites_drill(tmp: Path | str, *, quick: bool = True, json_path: str | None = None, log=print) -> dict:
    report = SitesDrill(tmp, quick=quick, log=log).run()
    if json_path:
        Path(json_path).write_text(json.dumps(report, indent=2, default=str))
    return report
