"""Learner islands over several nodes of a pool (`nodes_per_learner`): the placement rule, the spec's
bounds, the accounting of every device, and on the live stack (three CPU worker processes of one
pool acting as three nodes, gloo over 127.0.0.1) the loss of a 2-nodes x 1-process island against
the same learner on one node, and a node's worker killed mid-run: the island is placed again whole,
every contribution applied once."""
from __future__ import annotations

from datetime import timedelta
from decimal import Decimal

import pytest
from django.utils import timezone

from apps.coordinator.chaos import island_follower_pids
from apps.jobs import state as st
from apps.jobs.models import Incident, Job, Learner
from apps.jobs.services import submit_job
from tests.support.stack import Stack
from trainer import placement
from trainer.placement import PlacementError, island_nodes, islands_that_fit, pool_from_catalogue
from trainer.spec import MAX_NODES_PER_LEARNER, JobSpec

from .conftest import TINY, needs_services
from .test_e2e import duplicates

# ------------------------------------------------------------------------- placement (pure)


def test_an_island_takes_the_fullest_distinct_nodes_and_never_one_twice():
    free = {"a": 1, "b": 3, "c": 2, "d": 0}
    assert island_nodes(free, 2, 1) == ["b", "c"]  # rank 0 on the fullest
    assert island_nodes(free, 2, 2) == ["b", "c"]
    assert island_nodes(free, 2, 3) is None  # only b has 3: an island never doubles up on a node
    assert island_nodes(free, 4, 1) is None
    assert islands_that_fit(free, 2, 1) == 3  # b+c, b+c|a, b+a ... greedy on the fullest first
    assert islands_that_fit({"a": 4}, 2, 1) == 0  # four slots of one node are not two nodes


def _pool(slug: str, nodes: dict[str, int]):
    return pool_from_catalogue(slug, "h100-sxm", sum(nodes.values()), 100.0, nodes_free=nodes)


def test_placement_reserves_each_islands_share_on_distinct_nodes():
    pools = [_pool("p", {"n1": 2, "n2": 1, "n3": 1})]
    kw = {"devices_per_learner": 2, "nodes_per_learner": 2}
    p = placement.place(2, pools, **kw)
    assert p.assignments == [(0, "p"), (1, "p")]
    assert p.nodes == {0: ["n1", "n2"], 1: ["n1", "n3"]}  # what dispatch picks, one learner after the other
    with pytest.raises(PlacementError, match="only 2 learner slot"):
        placement.place(3, pools, **kw)
    with pytest.raises(PlacementError, match="needs 2 live nodes with 2 free device"):
        placement.place(1, pools, devices_per_learner=4, nodes_per_learner=2)
    one_node = placement.place(1, [_pool("q", {"n1": 4})], devices_per_learner=2)  # as before: no node list
    assert one_node.nodes == {}
    with pytest.raises(PlacementError, match="must divide"):
        placement.place(1, pools, devices_per_learner=3, nodes_per_learner=2)


def test_place_spec_reads_the_islands_shape_from_the_spec():
    spec = JobSpec(learners=1, batch_size=8, devices_per_learner=4, nodes_per_learner=2)
    fig = placement.model_figures(1_000_000, 8, 64)
    plan = placement.place_spec(spec, fig, [_pool("p", {"a": 2, "b": 2, "c": 1})])
    assert plan.nodes == {0: ["a", "b"]} and plan.devices_per_learner == {"p": 4}


# ------------------------------------------------------------------------- spec bounds


@pytest.mark.parametrize(("over", "message"), [
    ({"devices_per_learner": 2, "nodes_per_learner": 3}, "must divide devices_per_learner"),
    ({"nodes_per_learner": 0}, "greater than or equal to 1"),
    ({"devices_per_learner": 32, "batch_size": 32, "nodes_per_learner": MAX_NODES_PER_LEARNER + 1},
     f"less than or equal to {MAX_NODES_PER_LEARNER}"),
])
def test_the_spec_bounds_nodes_per_learner(over, message):
    from trainer.spec import spec_errors

    with pytest.raises(Exception) as info:
        JobSpec.model_validate({**TINY, **over})
    errors = spec_errors(info.value)
    assert any(message in m for m in errors["nodes_per_learner"]), errors


@pytest.fixture
def two_nodes(db):
    """A pool of two registered CPU nodes of one slot each (addresses registered)."""
    from apps.inventory.models import AcceleratorType, Node, Pool

    acc = AcceleratorType.objects.create(slug="mn-cpu", vendor="Test", model="CPU", kind="cpu",
                                         generation="x86", year=2024, memory_gib=16, peak_bf16_tflops=2.0,
                                         tdp_watts=200)
    pool = Pool.objects.create(slug="mn", name="mn", region="r", accelerator=acc, device_count=2,
                               link_gbps=10)
    for i in range(2):
        Node.objects.create(pool=pool, hostname="h", worker_name=f"mn-{i}@h", device_count=1,
                            address="127.0.0.1")
    return pool


MULTI = {**TINY, "name": "multinode", "learners": 1, "quorum": 1, "devices_per_learner": 2,
         "nodes_per_learner": 2}


@pytest.mark.django_db
def test_an_island_over_more_nodes_than_a_pool_has_is_a_400_on_its_field(alice, two_nodes):
    from tests.api.conftest import client_for

    spec = {**MULTI, "devices_per_learner": 4, "batch_size": 8, "nodes_per_learner": 4}
    for path in ("/api/v1/jobs/dry-run/", "/api/v1/jobs/"):
        r = client_for(alice).post(path, {"spec": spec}, format="json")
        assert r.status_code == 400, r.content
        assert "needs 4 nodes of one pool with 1 device(s) each; pool mn has 2" in \
            r.json()["errors"]["spec.nodes_per_learner"][0], r.json()


@pytest.mark.django_db
def test_the_dry_run_shows_the_nodes_dispatch_reserves(alice, two_nodes):
    """The dry run and dispatch agree on the nodes; rank 0's task goes to its node's own queue and
    the island's slots are held on both nodes, so a second island finds no room."""
    from unittest import mock

    from apps.coordinator.dispatch import dispatch, nodes_free, place_job
    from apps.coordinator.models import LearnerRuntime
    from tests.api.conftest import client_for

    r = client_for(alice).post("/api/v1/jobs/dry-run/", {"spec": MULTI}, format="json")
    assert r.status_code == 200, r.content
    shown = r.json()["placement"]["learners"]
    assert [(lr["devices"], lr["nodes"]) for lr in shown] == [(2, ["mn-0@h", "mn-1@h"])]
    spec = JobSpec.model_validate(MULTI).model_dump(mode="json")
    job = Job.objects.create(owner=alice, name="mn", spec=spec, status=st.RUNNING)
    (learner,) = place_job(job)
    with mock.patch("diloco_platform.celery.send") as send, \
            mock.patch("django.db.transaction.on_commit", side_effect=lambda fn: fn()):
        dispatch(learner, two_nodes)
    assert send.call_args.kwargs["queue"] == "pool.mn.node.mn-0_h"
    assert LearnerRuntime.objects.get(learner=learner).island_nodes == ["mn-0@h", "mn-1@h"]
    assert nodes_free(["mn"]) == {"mn": {"mn-0@h": 0, "mn-1@h": 0}}
    assert nodes_free(["mn"], exclude_learner=learner) == {"mn": {"mn-0@h": 1, "mn-1@h": 1}}


# ------------------------------------------------------------------------- accounting


@pytest.mark.django_db
@pytest.mark.parametrize("devices", [1, 2, 4])
def test_energy_and_cost_count_every_device_of_an_island(owner, devices):
    """One learner busy for an hour on a 700 W, $2.5/h device pool: W devices draw W times that."""
    from apps.coordinator.models import LearnerRuntime
    from apps.coordinator.syncer import SyncerRun
    from apps.inventory.models import AcceleratorType, Pool

    acc = AcceleratorType.objects.create(slug="acct-gpu", vendor="x", model="g", kind="gpu", generation="g",
                                         year=2024, memory_gib=80, peak_bf16_tflops=100, tdp_watts=700)
    pool = Pool.objects.create(slug="acct", name="acct", region="r", accelerator=acc, device_count=8,
                               link_gbps=10, cost_per_device_hour=Decimal("2.5"))
    spec = {**TINY, "learners": 1, "quorum": 1, "devices_per_learner": devices,
            "nodes_per_learner": 2 if devices > 1 else 1}
    job = Job.objects.create(owner=owner, name="acct", spec=spec, status=st.RUNNING)
    t = timezone.now()
    lr = Learner.objects.create(job=job, index=0, incarnation=1, pool=pool, state=Learner.State.RUNNING,
                                started_at=t - timedelta(hours=2), last_heartbeat=t)
    LearnerRuntime.objects.create(learner=lr)
    run = SyncerRun(job.pk, epoch=1, worker="w")
    run.accounted_at = timezone.now() - timedelta(hours=1)
    run.account()
    job.refresh_from_db()
    assert job.energy_j == pytest.approx(700 * 3600 * devices, rel=1e-3)
    assert job.cost == pytest.approx(2.5 * devices, rel=1e-3)


# ------------------------------------------------------------------------- live stack

SLOTS = (2, 1, 1)  # three nodes: the first holds a one-node island of 2, any two hold one of 2 x 1
ADDRESS = {"DILOCO_NODE_ADDRESS": "127.0.0.1"}


def live(fn):
    for mark in (needs_services, pytest.mark.e2e, pytest.mark.slow, pytest.mark.django_db(transaction=True)):
        fn = mark(fn)
    return fn


@pytest.fixture
def node_stack(transactional_db, tmp_path):
    """One pool of three worker nodes (2, 1 and 1 slots), each registering 127.0.0.1 as its address."""
    with Stack(tmp_path, pools={"alpha": sum(SLOTS)}, workers_per_pool=0,
               extra_env={"ISLAND_TIMEOUT_S": "60"}) as s:
        for slots in SLOTS:
            s.start_worker("alpha", slots=slots, env=ADDRESS)
        from apps.inventory.models import Node

        s.wait_for(lambda: Node.objects.filter(pool__slug="alpha", address="127.0.0.1").count() == len(SLOTS),
                   timeout=60, what="three nodes registered with their address")
        yield s


def _run(stack, owner, spec: dict, timeout: float = 300) -> Job:
    job, _ = submit_job(owner, spec)
    stack.wait_for(lambda: Job.objects.get(pk=job.pk).status in st.TERMINAL, timeout=timeout, what="job end")
    job.refresh_from_db()
    assert job.status == st.COMPLETED, job.status_reason
    return job


def _ranks(stack, job_id: int) -> list[int]:
    """Follower ranks of learner 0 of job `job_id` started by this stack's workers (their environment
    names its web URL): other sessions' stacks on this machine run jobs of the same ids."""
    mine = f"DILOCO_WEB_URL={stack.web_url}".encode()
    out = []
    for pid in island_follower_pids(job_id, 0):
        try:
            with open(f"/proc/{pid}/environ", "rb") as fh:
                if mine in fh.read().split(b"\0"):
                    out.append(pid)
        except OSError:  # exited meanwhile
            continue
    return out


def _worker_process(stack, worker: str) -> str:
    return next(name for name in stack.pools["alpha"].workers if stack.worker_hostname(name) == worker)


EQUAL = {**TINY, "learners": 1, "quorum": 1, "steps": 48, "eval_interval": 2}


@live
def test_an_island_over_two_nodes_reaches_the_loss_of_one_node(node_stack, owner):
    """1 learner x 2 processes over two nodes reaches the loss of the same learner as 2 processes on
    one node, and of a one-process learner, at equal tokens. Not bit-equal on the live stack: the
    learner adopts each new global whenever its poll sees it, so runs of one spec differ by up to
    0.6% here (tests/trainer/test_island_nodes.py checks the island's steps against one process
    to 1e-4); the bound is the issue's 1%."""
    from apps.coordinator.models import LearnerRuntime

    two = _run(node_stack, owner, {**EQUAL, "name": "two nodes", "devices_per_learner": 2,
                                   "nodes_per_learner": 2})
    rt = LearnerRuntime.objects.get(learner__job=two)
    assert len(set(rt.island_nodes)) == 2
    one = _run(node_stack, owner, {**EQUAL, "name": "one node", "devices_per_learner": 2})
    plain = _run(node_stack, owner, {**EQUAL, "name": "one process"})
    tokens = {j.pk: Learner.objects.get(job=j).tokens for j in (two, one, plain)}
    assert len(set(tokens.values())) == 1, tokens
    losses = {"two nodes": two.final_val_loss, "one node": one.final_val_loss,
              "one process": plain.final_val_loss}
    print(f"\nfinal val loss at {tokens[two.pk]} tokens: {losses}")
    assert abs(two.final_val_loss - one.final_val_loss) <= 0.01 * one.final_val_loss, losses
    assert abs(two.final_val_loss - plain.final_val_loss) <= 0.01 * plain.final_val_loss, losses
    assert two.final_val_loss < two.initial_val_loss - 0.1


@live
@pytest.mark.parametrize("victim", [1, 0], ids=["second node", "rank 0's node"])
def test_a_killed_node_replaces_the_island_whole_with_each_contribution_once(node_stack, owner, victim):
    """The worker of one of the island's nodes is SIGKILLed mid-run. The second node: rank 0 sees
    its collective fail, the silent node is declared lost. Rank 0's node: the watchdog loses the
    learner (missed heartbeats) and the node, and the second node's ranks exit on their own (their
    leader's connections closed). Either way the island is placed again whole on two live nodes,
    every contribution applied once, and no old rank is left."""
    from apps.coordinator.models import LearnerRuntime

    job, _ = submit_job(owner, {**EQUAL, "name": "node killed", "steps": 160, "devices_per_learner": 2,
                                "nodes_per_learner": 2})
    node_stack.wait_for(lambda: Job.objects.get(pk=job.pk).outer_steps >= 2 and _ranks(node_stack, job.pk),
                        timeout=180, what="outer steps with the island up")
    first = Learner.objects.get(job=job, index=0)
    nodes = LearnerRuntime.objects.get(learner=first).island_nodes
    old_ranks = _ranks(node_stack, job.pk)
    node_stack.kill_worker(_worker_process(node_stack, nodes[victim]))
    kind = "island_rank_lost" if victim else "learner_lost"
    node_stack.wait_for(lambda: Incident.objects.filter(job=job, kind=kind).exists(),
                        timeout=ISLAND_DETECT_S, what=f"the {kind} incident")
    incident = Incident.objects.get(job=job, kind=kind)
    if victim:
        assert incident.details["nodes"] == nodes and incident.details["silent_nodes"] == [nodes[1]]
    else:  # the second node's ranks (started by its task, not by the dead rank 0) leave on their own
        node_stack.wait_for(lambda: not set(old_ranks) & set(_ranks(node_stack, job.pk)),
                            timeout=ISLAND_DETECT_S, what="the old ranks to exit")
    again = node_stack.wait_for(
        lambda: Learner.objects.filter(job=job, index=0, incarnation__gt=first.incarnation,
                                       state__in=(Learner.State.RUNNING, Learner.State.DONE)).first(),
        timeout=120, what="the island placed again")
    moved = LearnerRuntime.objects.get(learner=again).island_nodes
    assert len(set(moved)) == 2 and nodes[victim] not in moved, moved
    assert not set(old_ranks) & set(_ranks(node_stack, job.pk))  # the old ranks are gone
    node_stack.wait_for(lambda: Job.objects.get(pk=job.pk).status in st.TERMINAL, timeout=300, what="job end")
    job.refresh_from_db()
    assert job.status == st.COMPLETED, job.status_reason
    assert duplicates(job) == 0
    assert Learner.objects.get(job=job).tokens == 160 * EQUAL["batch_size"] * EQUAL["seq_len"]
    incident.refresh_from_db()
    assert incident.healed_at is not None
    node_stack.wait_for(lambda: not _ranks(node_stack, job.pk), timeout=30, what="the ranks to exit")


ISLAND_DETECT_S = 60  # a killed peer closes its connections: seen at the next collective


def test_the_cli_dry_run_shows_the_nodes_of_each_island(live_server, alice, two_nodes):
    from pathlib import Path

    from apps.api.models import ApiToken
    from tests.cli.conftest import Cli

    cli = Cli(live_server.url, ApiToken.issue(alice, "multinode")[1])
    example = Path(__file__).resolve().parents[2] / "examples" / "job.yaml"
    r = cli("jobs", "submit", example, "--dry-run", "--set", "learners=1", "--set", "quorum=1",
            "--devices-per-learner", "2", "--set", "nodes_per_learner=2")
    assert r.exit_code == 0, r.stdout + r.stderr
    assert "1 learners x 2 devices over 2 nodes" in r.stdout and "mn-0@h, mn-1@h" in r.stdout, r.stdout
