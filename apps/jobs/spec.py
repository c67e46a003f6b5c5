"""Platform-side spec validation: the shared schema plus checks that need settings.

Two fields of a spec could make the platform run code or read files: `model` (a
`module:function` factory is imported and called by the coordinator and the workers) and
`dataset` (paths read by the workers). Both are held to what the operator allowed:
factories from `settings.MODEL_FACTORIES` only, files inside `settings.DATA_ROOTS` only.
"""
from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

from django.conf import settings
from pydantic import ValidationError

from trainer.data import inside_roots, split_source
from trainer.spec import MODEL_PRESETS, JobSpec, short, spec_errors

_GLOB_CHARS = "*?["


class SpecError(ValueError):
    """A spec that does not validate; `errors` maps field paths to messages."""

    def __init__(self, errors: dict[str, list[str]]):
        super().__init__("; ".join(f"{k}: {', '.join(v)}" for k, v in errors.items()))
        self.errors = errors


def model_allowed(model: str) -> bool:
    """A preset, or a factory the operator listed in settings.MODEL_FACTORIES."""
    return model in MODEL_PRESETS or model in set(getattr(settings, "MODEL_FACTORIES", []) or [])


def _part_allowed(part: str, roots: list[Path]) -> bool:
    if part == "stdlib":
        return True
    if not Path(part).is_absolute() or ".." in Path(part).parts:
        return False
    # a glob is checked on its fixed prefix here (its '**' count by JobSpec); the files it matches
    # are checked again, symlinks resolved, when the worker reads them within the selection's
    # bounds (trainer.data.resolve_files(roots=...): files, directory entries, time)
    fixed = Path(part)
    while any(ch in fixed.name for ch in _GLOB_CHARS):
        fixed = fixed.parent
    return inside_roots(fixed, roots)


def dataset_problem(dataset: str) -> str | None:
    """Why `dataset` may not be read, or None. Split exactly as the engine splits it."""
    parts = split_source(dataset)
    if not parts:
        return "must name at least one source"
    roots = [Path(r).resolve() for r in settings.DATA_ROOTS]
    for part in parts:
        if any(ord(ch) < 32 for ch in part):
            return f"{short(part)}: control characters are not allowed in a path"
        if not _part_allowed(part, roots):
            where = ", ".join(str(r) for r in roots) or "none configured"
            return (f"{short(part)} is not 'stdlib' or an absolute path inside a data root ({where}); "
                    "'..' is not allowed")
    return None


@functools.lru_cache(maxsize=8)
def preset_tensors(model: str) -> int:
    """Parameter tensors of a model preset (what fragments split: trainer.fragments.make_fragments),
    counted on a model built on the meta device (no memory, no initialisation cost)."""
    import torch

    from trainer.models import build_model

    with torch.device("meta"):
        return sum(1 for _ in build_model(model, seq_len=8).named_parameters())


def fragments_problem(spec: JobSpec) -> str | None:
    """Why `spec`'s fragments cannot split its model (more fragments than tensors), or None. A factory's
    model is not built here; the syncer refuses it at start (make_fragments) if it has too few."""
    if spec.model not in MODEL_PRESETS or spec.fragments is None:
        return None
    tensors = preset_tensors(spec.model)
    if spec.fragments <= tensors:
        return None
    return f"must not exceed the model's parameter tensors ({spec.model}: {tensors})"


def largest_node(pools: list[str]) -> tuple[int, str]:
    """(devices of the largest node, its pool) among `pools` (all active pools when empty): a node's
    registered device slots, or its pool's declared devices while no node of it has registered."""
    from apps.inventory.models import Node, Pool

    qs = Pool.objects.filter(slug__in=pools) if pools else Pool.objects.filter(state=Pool.State.ACTIVE)
    best = (0, "")
    for pool in qs:
        counts = list(Node.objects.filter(pool=pool).exclude(state=Node.State.LOST)
                      .values_list("device_count", flat=True))
        devices = max(counts) if counts else pool.device_count
        best = max(best, (devices, pool.slug))
    return best


def nodes_with(pools: list[str], devices: int) -> tuple[int, str]:
    """(most registered, not lost nodes of one pool with at least `devices` slots each, that pool)
    among `pools` (all active pools when empty)."""
    from apps.inventory.models import Node, Pool

    qs = Pool.objects.filter(slug__in=pools) if pools else Pool.objects.filter(state=Pool.State.ACTIVE)
    best = (0, "")
    for pool in qs:
        n = Node.objects.filter(pool=pool, device_count__gte=devices).exclude(state=Node.State.LOST).count()
        best = max(best, (n, pool.slug))
    return best


def nodes_problem(spec: JobSpec) -> str | None:
    """Why a learner island over `nodes_per_learner` nodes finds no pool with that many nodes, or None."""
    if spec.nodes_per_learner <= 1:
        return None
    per_node = spec.devices_per_learner // spec.nodes_per_learner
    n, slug = nodes_with(spec.pools, per_node)
    if n >= spec.nodes_per_learner:
        return None
    where = f"pool {slug} has {n}" if slug else "no pool has one"
    return (f"a learner needs {spec.nodes_per_learner} nodes of one pool with {per_node} device(s) each; "
            f"{where}")


def island_problem(spec: JobSpec) -> str | None:
    """Why a learner of `spec` fits on no node (an island on one node spans that node's devices), or None."""
    if spec.devices_per_learner <= 1 or spec.nodes_per_learner > 1:
        return None
    devices, slug = largest_node(spec.pools)
    if devices >= spec.devices_per_learner:
        return None
    where = f"the largest node (pool {slug}) has {devices}" if slug else "no pool has a node"
    return f"a learner needs {spec.devices_per_learner} devices on one node; {where}"


def syncer_shards_problem(shards: int) -> str | None:
    """Why a job of `shards` syncer shards can never run here, or None. Each shard holds one of
    the coordinator's settings.SYNCER_SLOTS syncer threads while the job runs
    (apps.coordinator.capacity counts them at placement; this is the submission's side)."""
    slots = max(1, int(getattr(settings, "SYNCER_SLOTS", 8) or 1))
    if shards <= slots:
        return None
    return (f"{shards} syncer shards exceed the coordinator's {slots} syncer slots (SYNCER_SLOTS); "
            f"ask for at most {slots}")


MAX_UNKNOWN_NAMED = 10


def unknown_keys_refused(data: dict) -> None:
    """Many unknown keys are refused before pydantic builds one error per key (40,000 of them cost
    seconds of CPU): the first few are named, the rest counted. A few go on to pydantic's errors."""
    fields = JobSpec.model_fields
    known = set(fields) | {f.alias for f in fields.values() if f.alias}
    unknown = [k for k in data if k not in known]
    if len(unknown) <= MAX_UNKNOWN_NAMED:
        return
    named = sorted(str(k)[:100] for k in unknown[:1000])[:MAX_UNKNOWN_NAMED]
    errors = dict.fromkeys(named, ["Extra inputs are not permitted"])
    errors["non_field_errors"] = [f"... and {len(unknown) - len(named)} more unknown fields."]
    raise SpecError({k: list(v) for k, v in errors.items()})


def validate_spec(data: Any, *, fleet: bool = True) -> JobSpec:
    """Validate a job spec (dict) or raise SpecError with field-level messages. `fleet`: also check
    what depends on today's inventory (a learner's devices fit on one node); a running job's spec,
    validated again at every use, is not held to a fleet that changed under it."""
    if not isinstance(data, dict):
        raise SpecError({"non_field_errors": ["the spec must be a JSON object"]})
    unknown_keys_refused(data)
    try:
        spec = JobSpec.model_validate(data)
    except ValidationError as exc:
        raise SpecError(spec_errors(exc)) from None
    errors: dict[str, list[str]] = {}
    if not model_allowed(spec.model):
        errors["model"] = [f"{spec.model!r} is not allowed here: use a preset ({', '.join(MODEL_PRESETS)}) "
                           "or a factory the operator lists in MODEL_FACTORIES"]
    problem = dataset_problem(spec.dataset)
    if problem:
        errors["dataset"] = [problem]
    problem = fragments_problem(spec)
    if problem:
        errors["fragments"] = [problem]
    island = island_problem(spec) if fleet else None
    if island:
        errors["devices_per_learner"] = [island]
    nodes = nodes_problem(spec) if fleet else None
    if nodes:
        errors["nodes_per_learner"] = [nodes]
    shards = syncer_shards_problem(spec.syncer_shards) if fleet else None
    if shards:  # more than the coordinator can ever hold
        errors["syncer_shards"] = [shards]
    if errors:
        raise SpecError(errors)
    return spec
