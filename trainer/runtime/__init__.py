"""Django-free glue between the engine (Learner, Syncer) and a blob store.

`keys` names every blob of a job, `codec` turns nested state dicts into safetensors bytes
(no pickle), `writer` is a FIFO background writer (a learner's contributions and checkpoints
land in the order they were made), `learner_loop` runs an engine Learner against the store
with a host callback for liveness and control. The Celery tasks in apps.coordinator are the
host; the benchmarks run the same loop with a trivial host.
"""
