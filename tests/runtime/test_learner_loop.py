"""The learner loop against a real engine Learner/Syncer and an in-memory blob store (no Django)."""
from __future__ import annotations

import time

import pytest
import torch

from trainer.clock import ManualClock
from trainer.config import TrainConfig
from trainer.learner import Learner
from trainer.protocol import Contribution
from trainer.runtime import keys
from trainer.runtime.learner_loop import Control, Fenced, LearnerLoop
from trainer.syncer import Syncer
from trainer.transport import MemoryStore


class Host:
    def __init__(self, stop_after: int | None = None, fence_after: int | None = None):
        self.beats, self.points = 0, []
        self.stop_after, self.fence_after = stop_after, fence_after

    def heartbeat(self, stats):
        self.beats += 1
        if self.fence_after is not None and self.beats > self.fence_after:
            raise Fenced("superseded")
        return Control(stop=self.stop_after is not None and stats["step"] >= self.stop_after, reason="test")

    def resumed(self, point):
        self.points.append(point)

    def telemetry(self, msg):
        pass


@pytest.fixture(scope="module")
def corpus():
    from trainer.data import Corpus

    return Corpus.load("stdlib", cache_dir="var/cache")


def cfg(**kw):
    base = {"model": "tiny", "learners": 1, "quorum": 1, "inner_steps": 4, "fragments": 1, "steps": 24,
            "batch_size": 4, "seq_len": 16, "warmup_steps": 2, "cache_dir": "var/cache"}
    return TrainConfig(**{**base, **kw})


def ranges(store, job):
    return sorted((r.start, r.end, r.incarnation) for r in
                  (keys.parse_contrib_key(k) for k in store.list(keys.contrib_prefix(job))))


def loop_for(store, corpus, inc, host, **kw):
    torch.set_num_threads(1)
    eng = Learner(cfg(**kw), 0, incarnation=inc, corpus=corpus, job="j")
    return LearnerLoop(eng, store, job="j", index=0, incarnation=inc, host=host, heartbeat_interval=0.01,
                       poll_interval=0.01, checkpoint_interval=0.0, final_wait=0.0)


def test_resume_continues_exactly_after_the_last_checkpointed_contribution(corpus):
    store = MemoryStore()
    first = loop_for(store, corpus, 1, Host(stop_after=10))
    first.resume()
    out = first.run()
    assert out.outcome == "stopped"
    before = ranges(store, "j")
    assert before and before[0][0] == 0
    second = loop_for(store, corpus, 2, Host())
    point = second.resume()
    assert point["from_incarnation"] == 1 and point["tokens"] == out.tokens
    assert int(point["frag_pos"][0]) == before[-1][1]  # resumes right after its last contribution
    assert second.learner.tokens == out.tokens


def test_zombie_stops_and_writes_nothing_more(corpus):
    store = MemoryStore()
    loop = loop_for(store, corpus, 1, Host(fence_after=1), steps=10_000)
    loop.resume()
    out = loop.run(max_seconds=30)
    assert out.outcome == "fenced"


def test_refused_contribution_does_not_block_the_learner(corpus):
    """The syncer refuses (deletes) a contribution and no newer version comes: after the stall
    time the learner re-adopts the committed version and sends again."""
    store = MemoryStore()
    c = cfg(steps=10_000)
    syncer = Syncer(c, Learner(c, 0, corpus=corpus, job="j").model, ManualClock(), job="j")
    loop = loop_for(store, corpus, 1, Host(), steps=10_000)
    loop.stall_after = 0.05
    # a committed version 1 exists (merged from the learner's first contribution)
    loop.resume()
    for _ in range(4):
        loop.learner.step()
    loop.push_due()
    loop.writer.flush(5)
    key = store.list(keys.contrib_prefix("j"))[0]
    contrib = Contribution.from_bytes(store.get(key))
    assert syncer.submit(contrib).accepted
    merged = syncer.merge(0, force=True)
    store.put(keys.global_key("j", 0, merged.version, 1), merged.global_fragment.to_bytes())
    store.put(keys.head_key("j"), keys.head_blob({0: merged.version}, {0: 1}))
    store.delete(key)
    assert loop.poll_globals() == 1  # adopted v1: the answer to its first send
    for _ in range(4):
        loop.learner.step()
    assert loop.push_due() == 1
    loop.writer.flush(5)
    refused = [k for k in store.list(keys.contrib_prefix("j")) if k != key][0]
    store.delete(refused)  # refused by the syncer
    for _ in range(4):
        loop.learner.step()
    assert loop.push_due() == 0  # blocked: the engine waits for an answer
    time.sleep(0.1)
    loop.poll_globals()
    assert loop.refused == 1
    for _ in range(4):
        loop.learner.step()
    assert loop.push_due() == 1  # sending again
    loop.writer.close()


def _send_and_checkpoint(store, corpus):
    """Incarnation 1 trains one cycle, sends fragment 0 and checkpoints right behind the send."""
    loop = loop_for(store, corpus, 1, Host(), steps=10_000)
    loop.resume()
    for _ in range(4):
        loop.learner.step()
    assert loop.push_due() == 1
    loop.checkpoint()
    loop.writer.flush(5)
    (key,) = store.list(keys.contrib_prefix("j"))
    return loop, key


def _merge_and_publish(store, corpus, key):
    c = cfg(steps=10_000)
    syncer = Syncer(c, Learner(c, 0, corpus=corpus, job="j").model, ManualClock(), job="j")
    assert syncer.submit(Contribution.from_bytes(store.get(key))).accepted
    merged = syncer.merge(0, force=True)
    store.put(keys.global_key("j", 0, merged.version, 1), merged.global_fragment.to_bytes())
    store.put(keys.head_key("j"), keys.head_blob({0: merged.version}, {0: 1}))
    store.delete(key)  # as the runtime syncer does after its commit
    return merged.global_fragment.tensors


def test_successor_does_not_reapply_progress_the_syncer_already_merged(corpus):
    """The checkpoint's send was merged before the successor starts: the successor's weights are
    the merged global (no progress after the send), not the global plus that progress again."""
    store = MemoryStore()
    first, key = _send_and_checkpoint(store, corpus)
    merged = _merge_and_publish(store, corpus, key)
    second = loop_for(store, corpus, 2, Host(), steps=10_000)
    second.resume()
    assert second.learner.incarnation == 2
    assert second.learner.adopted_versions[0] == 1 and not second.learner.outstanding(0)
    for n, t in merged.items():
        torch.testing.assert_close(second.learner.params[n].detach().float(), t, rtol=0, atol=1e-5)
    # and its next contribution carries only its own new progress, under its own incarnation
    for _ in range(4):
        second.learner.step()
    assert second.push_due() == 1
    second.writer.flush(5)
    (k2,) = store.list(keys.contrib_prefix("j"))
    c2 = Contribution.from_bytes(store.get(k2))
    assert c2.incarnation == 2 and c2.base_version == 1 and c2.inner_steps == 4


def test_successor_waits_for_a_pending_send_and_resends_a_refused_one(corpus):
    store = MemoryStore()
    first, key = _send_and_checkpoint(store, corpus)
    # still pending at the syncer: the successor waits for its answer, watching the blob
    second = loop_for(store, corpus, 2, Host(), steps=10_000)
    second.resume()
    assert second.learner.outstanding(0) and second.outstanding[0][0] == key
    merged = _merge_and_publish(store, corpus, key)
    assert second.poll_globals() == 1 and not second.learner.outstanding(0)
    for n, t in merged.items():
        torch.testing.assert_close(second.learner.params[n].detach().float(), t, rtol=0, atol=1e-5)
    # refused (blob gone, no newer version): that progress is sent again by the next successor
    store2 = MemoryStore()
    _first, key2 = _send_and_checkpoint(store2, corpus)
    store2.delete(key2)
    third = loop_for(store2, corpus, 2, Host(), steps=10_000)
    third.resume()
    assert not third.learner.outstanding(0)
    assert third.learner.flush()[0].inner_steps == 4  # the refused cycle goes out whole


def test_learner_one_version_behind_fetches_the_compressed_update(corpus):
    """global_compression: the syncer publishes each version whole and as a compressed update;
    a learner holding v - 1 downloads the update (a quarter of the bytes for int8) and ends up
    holding the published weights bit for bit."""
    store = MemoryStore()
    loop = loop_for(store, corpus, 1, Host(), steps=10_000, global_compression="int8")
    loop.resume()
    for _ in range(4):
        loop.learner.step()
    assert loop.push_due() == 1
    loop.writer.flush(5)
    (key,) = store.list(keys.contrib_prefix("j"))
    c = cfg(steps=10_000, global_compression="int8")
    syncer = Syncer(c, Learner(c, 0, corpus=corpus, job="j").model, ManualClock(), job="j")
    assert syncer.submit(Contribution.from_bytes(store.get(key))).accepted
    merged = syncer.merge(0, force=True)
    update, whole = syncer.global_update(0), merged.global_fragment.to_bytes()
    store.put(keys.update_key("j", 0, 1, 1), update)
    store.put(keys.global_key("j", 0, 1, 1), whole)
    store.put(keys.head_key("j"), keys.head_blob({0: 1}, {0: 1}))
    assert loop.poll_globals() == 1
    assert loop.bytes_received == len(update) < len(whole) / 3
    assert loop.updates_received == 1
    assert loop.learner.adopted_versions[0] == 1
    for n in loop.learner.fragments[0]:
        assert torch.equal(loop.learner.base[0][n].cpu(), syncer.published[n])


def test_learner_several_versions_behind_fetches_the_chain_of_updates(corpus):
    """A learner three versions behind downloads the three int4 updates (less than the whole fp32
    fragment) and holds the published bits; with a link missing (written under an earlier syncer
    epoch) it downloads the whole fragment instead."""
    c = cfg(steps=10_000, global_compression="int4", max_staleness=8)
    other = Learner(c, 0, corpus=corpus, job="j")  # another incarnation's progress, merged 3 times
    syncer = Syncer(c, Learner(c, 0, corpus=corpus, job="j").model, ManualClock(), job="j")
    for _round in range(3):
        for _ in range(4):
            other.step()
        for contribution in other.due_contributions():
            assert syncer.submit(contribution).accepted
        merged = syncer.merge(0, force=True)
        other.adopt(merged.global_fragment)
    chain = syncer.global_updates(0, 0)
    whole = syncer.global_fragment(0).to_bytes()
    for missing in (None, 2):
        store = MemoryStore()
        for v, blob in enumerate(chain, start=1):
            if v != missing:
                store.put(keys.update_key("j", 0, v, 1), blob)
        store.put(keys.global_key("j", 0, 3, 1), whole)
        store.put(keys.head_key("j"), keys.head_blob({0: 3}, {0: 1}))
        loop = loop_for(store, corpus, 0, Host(), steps=10_000, global_compression="int4", max_staleness=8)
        loop.resume()
        assert loop.learner.adopted_versions[0] == 3
        if missing is None:
            assert loop.updates_received == 3
            assert loop.bytes_received == sum(map(len, chain)) < len(whole) / 2
        else:
            assert loop.updates_received == 0 and loop.bytes_received == len(whole)
        for n in loop.learner.fragments[0]:
            assert torch.equal(loop.learner.base[0][n].cpu(), syncer.published[n])


def test_learner_reads_the_head_of_every_syncer_shard(corpus):
    """syncer_shards=2: fragment 0's versions are in `head`, fragment 1's in `head-s01`."""
    store = MemoryStore()
    loop = loop_for(store, corpus, 1, Host(), steps=10_000, fragments=2)
    loop.syncer_shards = 2
    c = cfg(steps=10_000, fragments=2)
    syncer = Syncer(c, Learner(c, 0, corpus=corpus, job="j").model, ManualClock(), job="j")
    for p in (0, 1):
        syncer.versions[p] = 1
        store.put(keys.global_key("j", p, 1, 1), syncer.global_fragment(p).to_bytes())
    store.put(keys.head_key("j", 1), keys.head_blob({1: 1}, {1: 1}))
    assert loop.poll_globals() == 1 and loop.learner.adopted_versions == {0: 0, 1: 1}
    store.put(keys.head_key("j"), keys.head_blob({0: 1}, {0: 1}))
    assert loop.poll_globals() == 1 and loop.learner.adopted_versions == {0: 1, 1: 1}
    loop.syncer_shards = 1  # a one-shard job never looks at head-s01
    store.put(keys.head_key("j", 1), keys.head_blob({1: 2}, {1: 1}))
    assert loop.poll_globals() == 0
