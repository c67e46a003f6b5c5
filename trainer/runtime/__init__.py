"""Django-free glue between the engine (Learner, Syncer) and a blob store: the runtime protocol.

`keys` names every blob of a job, `codec` turns nested state dicts into safetensors bytes
(no pickle), `writer` is a FIFO background writer (a learner's contributions and checkpoints
land in the order they were made). `learner_loop` runs an engine Learner against the store
with a `Host` for liveness and control; `syncer_loop` runs an engine Syncer against the store
(scan, admit, fence, merge, commit, snapshot, resume) with a `SyncerHost` (`syncer_host`) for
the lease, the commit transaction and events. The Celery tasks in apps.coordinator are the
production hosts; tests/runtime/test_syncer_protocol.py runs the syncer's side against an
in-memory host too.
The simulator (`trainer.sim`) and `trainer.train.LocalRun` still drive the engine objects with
their own event loops, not these two loops (see docs/architecture.md).
"""
