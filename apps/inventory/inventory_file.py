"""The inventory file: a YAML description of accelerator types and pools.

    version: 1
    accelerators:            # optional: types beyond the seeded catalogue (upserted by slug)
      - {slug: mi300x, vendor: AMD, model: MI300X, kind: gpu, generation: CDNA3, year: 2023,
         memory_gib: 192, peak_bf16_tflops: 1307, tdp_watts: 750}
    pools:                   # upserted by slug
      - slug: iad-h100
        name: IAD H100 rack
        region: us-east-1
        provider: aws        # onprem | aws | gcp | azure | other
        accelerator: h100-sxm
        device_count: 8
        cost_per_device_hour: 4.5
        link_gbps: 5
        latency_ms: 20       # optional, default 1
        speed_factor: 1.0    # optional, default 1
        state: active        # optional: active | draining | disabled
        notes: ""            # optional

`load()` validates everything and raises InventoryFileError with one message per problem,
each naming the line and the field; `apply()` writes in one transaction, so a bad file
changes nothing. `dump()` writes the current inventory in the same format (round-trips).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

import yaml
from django.db import transaction

from .models import AcceleratorType, Pool

FORMAT_VERSION = 1
MAX_BYTES = 2 * 1024 * 1024
MAX_ITEMS = 10_000
SLUG_RE = re.compile(r"^[a-z0-9][a-z0-9_-]{0,39}$")


class InventoryFileError(ValueError):
    """A file that cannot be imported; `errors` lists 'line N: path: message' strings."""

    def __init__(self, errors: list[str]):
        self.errors = errors
        super().__init__("\n".join(errors))


@dataclass
class Field:
    kind: str  # str | slug | int | number | choice
    required: bool = True
    default: Any = None
    max_length: int = 0
    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    choices: tuple[str, ...] = ()


ACCELERATOR_FIELDS: dict[str, Field] = {
    "slug": Field("slug"),
    "vendor": Field("str", max_length=40),
    "model": Field("str", max_length=80),
    "kind": Field("choice", choices=tuple(AcceleratorType.Kind.values)),
    "generation": Field("str", max_length=40),
    "year": Field("int", lo=1990, hi=2100),
    "memory_gib": Field("number", lo=0, lo_open=True, hi=1_000_000),
    "peak_bf16_tflops": Field("number", lo=0, lo_open=True, hi=1_000_000),
    "tdp_watts": Field("int", lo=1, hi=1_000_000),
    "source": Field("str", required=False, default="", max_length=300),
}

POOL_FIELDS: dict[str, Field] = {
    "slug": Field("slug"),
    "name": Field("str", required=False, max_length=100),
    "region": Field("str", max_length=60),
    "provider": Field(
        "choice", required=False, default=Pool.Provider.ONPREM.value, choices=tuple(Pool.Provider.values)
    ),
    "accelerator": Field("slug"),
    "device_count": Field("int", lo=0, hi=1_000_000),
    "cost_per_device_hour": Field("number", required=False, default=0.0, lo=0, hi=999_999),
    "link_gbps": Field("number", lo=0, lo_open=True, hi=1_000_000),
    "latency_ms": Field("number", required=False, default=1.0, lo=0, hi=1_000_000),
    "speed_factor": Field("number", required=False, default=1.0, lo=0, lo_open=True, hi=100),
    "state": Field(
        "choice", required=False, default=Pool.State.ACTIVE.value, choices=tuple(Pool.State.values)
    ),
    "notes": Field("str", required=False, default="", max_length=10_000),
}


@dataclass
class Inventory:
    accelerators: list[dict[str, Any]] = field(default_factory=list)
    pools: list[dict[str, Any]] = field(default_factory=list)


# --------------------------------------------------------------------------- parsing


def _lines(node: yaml.Node, path: str, out: dict[str, int], errors: list[str], budget: list[int]) -> None:
    """Record the (1-based) line of every path; report duplicate mapping keys."""
    budget[0] -= 1
    if budget[0] < 0:
        raise InventoryFileError(
            [f"line {node.start_mark.line + 1}: file has too many items (max {MAX_ITEMS})"]
        )
    out[path] = node.start_mark.line + 1
    if isinstance(node, yaml.MappingNode):
        seen: dict[Any, int] = {}
        for key, value in node.value:
            k = key.value if isinstance(key, yaml.ScalarNode) else None
            line = key.start_mark.line + 1
            if k in seen:
                errors.append(
                    f"line {line}: {path or 'top level'}: duplicate key {k!r} (first on line {seen[k]})"
                )
            seen[k] = line
            sub = f"{path}.{k}" if path else str(k)
            out[sub + ".__key__"] = line
            _lines(value, sub, out, errors, budget)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _lines(item, f"{path}[{i}]", out, errors, budget)


def _parse(text: str | bytes) -> tuple[Any, dict[str, int]]:
    if isinstance(text, bytes):
        if len(text) > MAX_BYTES:
            raise InventoryFileError([f"file is too large ({len(text)} bytes; max {MAX_BYTES})"])
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise InventoryFileError([f"file is not UTF-8 text (byte {exc.start})"]) from None
    if len(text) > MAX_BYTES:
        raise InventoryFileError([f"file is too large ({len(text)} characters; max {MAX_BYTES})"])
    try:
        for event in yaml.parse(text, Loader=yaml.SafeLoader):
            if isinstance(event, yaml.AliasEvent):
                raise InventoryFileError(
                    [f"line {event.start_mark.line + 1}: YAML aliases (*{event.anchor}) are not supported"]
                )
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise InventoryFileError([f"{where}not valid YAML: {problem}"]) from None
    if node is None:
        raise InventoryFileError(["the file is empty: expected a mapping with 'version' and 'pools'"])
    lines: dict[str, int] = {}
    errors: list[str] = []
    _lines(node, "", lines, errors, [MAX_ITEMS])
    if errors:
        raise InventoryFileError(errors)
    return data, lines


# --------------------------------------------------------------------------- validation


def _check(value: Any, spec: Field) -> tuple[Any, str | None]:
    """(clean value, None) or (None, message)."""
    if spec.kind in ("str", "slug", "choice"):
        if not isinstance(value, str):
            return None, f"must be a string, got {type(value).__name__}"
        value = value.strip()
        if spec.kind == "slug":
            if not SLUG_RE.match(value):
                return None, "must be a slug: 1-40 of a-z, 0-9, '-', '_', starting with a letter or digit"
        elif spec.kind == "choice":
            if value not in spec.choices:
                return None, f"must be one of {', '.join(spec.choices)}, got {value!r}"
        else:
            if spec.max_length and len(value) > spec.max_length:
                return None, f"is too long ({len(value)} characters; max {spec.max_length})"
            if "\x00" in value:
                return None, "must not contain NUL characters"
        return value, None
    if isinstance(value, bool) or not isinstance(value, int | float):
        want = "an integer" if spec.kind == "int" else "a number"
        return None, f"must be {want}, got {type(value).__name__} {str(value)[:40]!r}"
    if spec.kind == "int" and not isinstance(value, int):
        return None, f"must be an integer, got {value!r}"
    if isinstance(value, float) and not math.isfinite(value):
        return None, f"must be a finite number, got {value}"
    if spec.lo is not None and (value <= spec.lo if spec.lo_open else value < spec.lo):
        return None, f"must be {'greater than' if spec.lo_open else 'at least'} {spec.lo:g}, got {value}"
    if spec.hi is not None and value > spec.hi:
        return None, f"must be at most {spec.hi:g}, got {value}"
    return value, None


def _record(item: Any, path: str, spec: dict[str, Field], lines: dict[str, int], errors: list[str]) -> dict:
    line = lines.get(path, 0)
    if not isinstance(item, dict):
        errors.append(f"line {line}: {path}: must be a mapping of fields, got {type(item).__name__}")
        return {}
    clean: dict[str, Any] = {}
    for key in item:
        if key not in spec:
            kline = lines.get(f"{path}.{key}.__key__", line)
            errors.append(f"line {kline}: {path}.{key}: unknown field (known: {', '.join(spec)})")
    for name, fspec in spec.items():
        if name not in item or item[name] is None:
            if fspec.required:
                errors.append(f"line {line}: {path}.{name}: required field is missing")
            elif fspec.default is not None:
                clean[name] = fspec.default
            continue
        value, msg = _check(item[name], fspec)
        if msg:
            errors.append(f"line {lines.get(f'{path}.{name}', line)}: {path}.{name}: {msg}")
        else:
            clean[name] = value
    return clean


def _list(data: dict, key: str, lines: dict[str, int], errors: list[str]) -> list:
    value = data.get(key)
    if value is None:
        return []
    if not isinstance(value, list):
        errors.append(f"line {lines.get(key, 0)}: {key}: must be a list, got {type(value).__name__}")
        return []
    return value


def load(text: str | bytes) -> Inventory:
    """Parse and validate an inventory file; raise InventoryFileError listing every problem."""
    data, lines = _parse(text)
    if not isinstance(data, dict):
        raise InventoryFileError(
            [f"line 1: top level: must be a mapping with 'version' and 'pools', got {type(data).__name__}"]
        )
    errors: list[str] = []
    for key in data:
        if key not in ("version", "accelerators", "pools"):
            errors.append(
                f"line {lines.get(f'{key}.__key__', 1)}: {key}: unknown top-level key "
                "(known: version, accelerators, pools)"
            )
    version = data.get("version")
    if version is None:
        errors.append("line 1: version: required (this format is version 1)")
    elif isinstance(version, bool) or version != FORMAT_VERSION:
        errors.append(
            f"line {lines.get('version', 1)}: version: unsupported version {version!r} "
            f"(this platform reads version {FORMAT_VERSION})"
        )
    if "pools" not in data:
        errors.append("line 1: pools: required (a list, may be empty)")

    inv = Inventory()
    known_acc = set(AcceleratorType.objects.values_list("slug", flat=True))
    seen: dict[str, int] = {}
    for i, item in enumerate(_list(data, "accelerators", lines, errors)):
        path = f"accelerators[{i}]"
        rec = _record(item, path, ACCELERATOR_FIELDS, lines, errors)
        slug = rec.get("slug")
        if slug:
            if slug in seen:
                errors.append(
                    f"line {lines[path]}: {path}.slug: duplicate slug {slug!r} (first on line {seen[slug]})"
                )
            seen[slug] = lines[path]
            known_acc.add(slug)
        inv.accelerators.append(rec)

    seen = {}
    for i, item in enumerate(_list(data, "pools", lines, errors)):
        path = f"pools[{i}]"
        rec = _record(item, path, POOL_FIELDS, lines, errors)
        slug = rec.get("slug")
        if slug:
            if slug in seen:
                errors.append(
                    f"line {lines[path]}: {path}.slug: duplicate slug {slug!r} (first on line {seen[slug]})"
                )
            seen[slug] = lines[path]
            rec.setdefault("name", slug)
        acc = rec.get("accelerator")
        if acc and acc not in known_acc:
            shown = ", ".join(sorted(known_acc)[:20])
            errors.append(
                f"line {lines.get(f'{path}.accelerator', lines[path])}: {path}.accelerator: "
                f"unknown accelerator {acc!r} (known: {shown}; or define it under 'accelerators')"
            )
        inv.pools.append(rec)
    if errors:
        raise InventoryFileError(errors)
    return inv


# --------------------------------------------------------------------------- apply / dump


@dataclass
class Summary:
    accelerators_created: int = 0
    accelerators_updated: int = 0
    pools_created: int = 0
    pools_updated: int = 0

    def __str__(self) -> str:
        return (
            f"accelerators: {self.accelerators_created} created, {self.accelerators_updated} updated; "
            f"pools: {self.pools_created} created, {self.pools_updated} updated"
        )


@transaction.atomic
def apply(inv: Inventory, only_new: bool = False) -> Summary:
    """Upsert everything in one transaction (all or nothing); `only_new` leaves existing rows alone."""
    s = Summary()
    existing_accs = set(AcceleratorType.objects.values_list("slug", flat=True))
    existing_pools = set(Pool.objects.values_list("slug", flat=True))
    for rec in inv.accelerators:
        if only_new and rec["slug"] in existing_accs:
            continue
        data = dict(rec)
        _, created = AcceleratorType.objects.update_or_create(slug=data.pop("slug"), defaults=data)
        s.accelerators_created += created
        s.accelerators_updated += not created
    accs = {a.slug: a for a in AcceleratorType.objects.all()}
    for rec in inv.pools:
        if only_new and rec["slug"] in existing_pools:
            continue
        data = dict(rec)
        data["accelerator"] = accs[data["accelerator"]]
        data["cost_per_device_hour"] = Decimal(str(data["cost_per_device_hour"])).quantize(Decimal("0.0001"))
        _, created = Pool.objects.update_or_create(slug=data.pop("slug"), defaults=data)
        s.pools_created += created
        s.pools_updated += not created
    return s


def import_text(text: str | bytes) -> Summary:
    return apply(load(text))


def _num(v: float) -> int | float:
    return int(v) if float(v).is_integer() else float(v)


def dump(all_accelerators: bool = False) -> str:
    """The current inventory as an inventory file (accelerators: those the pools use, or all)."""
    pools = list(Pool.objects.select_related("accelerator").order_by("slug"))
    accs = AcceleratorType.objects.order_by("slug")
    if not all_accelerators:
        accs = accs.filter(pools__isnull=False).distinct()
    doc = {
        "version": FORMAT_VERSION,
        "accelerators": [
            {
                "slug": a.slug,
                "vendor": a.vendor,
                "model": a.model,
                "kind": a.kind,
                "generation": a.generation,
                "year": a.year,
                "memory_gib": _num(a.memory_gib),
                "peak_bf16_tflops": _num(a.peak_bf16_tflops),
                "tdp_watts": a.tdp_watts,
                "source": a.source,
            }
            for a in accs
        ],
        "pools": [
            {
                "slug": p.slug,
                "name": p.name,
                "region": p.region,
                "provider": p.provider,
                "accelerator": p.accelerator.slug,
                "device_count": p.device_count,
                "cost_per_device_hour": _num(p.cost_per_device_hour),
                "link_gbps": _num(p.link_gbps),
                "latency_ms": _num(p.latency_ms),
                "speed_factor": _num(p.speed_factor),
                "state": p.state,
                "notes": p.notes,
            }
            for p in pools
        ],
    }
    return "# DiLoCo platform inventory (manage.py export_inventory)\n" + yaml.safe_dump(
        doc, sort_keys=False, allow_unicode=True, width=110
    )
