"""Django-free glue between the engine (Learner, Syncer) and a blob store: the runtime protocol.

`keys` names every blob of a job, `codec` turns nested state dicts into safetensors bytes
(no pickle; the one state codec), `writer` is a FIFO background writer (a learner's
contributions and checkpoints land in the order they were made; `InlineWriter` writes at once,
for drivers that own time). `learner_loop` runs an engine Learner against the store with a
`Host` for liveness and control; `syncer_loop` runs an engine Syncer against the store (scan,
admit, fence, merge, commit, snapshot, resume) with a `SyncerHost` (`syncer_host`) for the
lease, the commit transaction and events. The Celery tasks in apps.coordinator are the
production hosts; `memory_host` is an in-memory `SyncerHost`, used by the protocol tests
(tests/runtime/test_syncer_protocol.py) and by the simulator (`trainer/sim/diloco.py`), which
steps both loops on a virtual clock. `trainer.train.LocalRun` (the CLI) still drives the engine
objects with its own event loop (see docs/architecture.md).
"""
