"""The ranks of a learner island on one of its other nodes (an island over several nodes).

Rank 0's task (apps.coordinator.learner) hosts the rendezvous and sends this task to the own
queue of every other node dispatch reserved for the island. It starts that node's ranks
(trainer.runtime.island_rank.start_node: the same follower processes as on rank 0's node) and
holds the worker slot while they run, so the node's slots are what the island really uses.
The ranks exit on their own: told to stop by rank 0, or failing on a collective's error (rank 0
or a peer gone) or timeout (ISLAND_TIMEOUT_S: a partition). As a last guard, ranks still
running a while after their learner moved on to another incarnation are killed here.
"""
from __future__ import annotations

import time

from django.db import DatabaseError, close_old_connections

from apps.jobs.models import Learner

from .common import hb_timeout, log

POLL_S = 0.5
CHECK_S = 5.0  # how often the learner's row is read while the ranks run
LIVE = (Learner.State.STARTING, Learner.State.RUNNING)


def current(job_id: int, index: int, incarnation: int) -> bool:
    """Whether incarnation `incarnation` of the learner is still the one starting or running."""
    close_old_connections()
    return Learner.objects.filter(job_id=job_id, index=index, incarnation=incarnation,
                                  state__in=LIVE).exists()


def _watch(followers, job_id: int, index: int, incarnation: int) -> str:
    """Wait for the ranks; kill them once their learner has been superseded for a grace period."""
    checked, gone_since = time.monotonic(), None
    while followers.running():
        time.sleep(POLL_S)
        t = time.monotonic()
        if t - checked < CHECK_S:
            continue
        checked = t
        try:
            alive = current(job_id, index, incarnation)
        except DatabaseError:  # the database away: the collectives still bound the ranks' life
            log.debug("island ranks: learner check failed", exc_info=True)
            continue
        gone_since = None if alive else (gone_since or t)
        if gone_since is not None and t - gone_since > max(10.0, 4 * hb_timeout()):
            log.warning("learner %s.%s of job %s superseded: killing its ranks on this node", index,
                        incarnation, job_id)
            followers.kill()
            return "killed: superseded"
    failed = followers.failed()
    return f"ranks failed: {failed}" if failed else "ranks stopped"


def run_island_ranks_body(job_id: int, index: int, incarnation: int, node: int, host: str, port: int,
                          payload: str) -> str:
    """Start node `node`'s ranks of the island of learner `index`.`incarnation`, rendezvous at
    host:port, and wait for them (their outcome is the result)."""
    from trainer.runtime.island_rank import IslandSpec, start_node

    if not current(job_id, index, incarnation):
        return "fenced: not the current incarnation"
    spec = IslandSpec.from_payload(payload)
    followers = start_node(spec, node, host, port)
    log.info("learner %s.%s of job %s: node %s of its island runs ranks %s (pids %s), rendezvous %s:%s",
             index, incarnation, job_id, node, spec.node_ranks(node), followers.pids, host, port)
    try:
        outcome = _watch(followers, job_id, index, incarnation)
    finally:
        followers.kill()  # nothing outlives the task (a no-op for ranks that exited)
    log.info("learner %s.%s of job %s: node %s of its island: %s", index, incarnation, job_id, node, outcome)
    return outcome
