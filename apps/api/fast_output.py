"""Read-only serializer output without DRF's per-field machinery, byte for byte the same.

Why: DRF's `Serializer.to_representation` builds the fields on every serializer instance and
walks each of them through `get_attribute` / `to_representation` with exception handling and
isinstance checks. For the job list (50 jobs x 23 fields) that was about 9 ms of the request's
10 ms of CPU in cProfile (issue 19). `FastOutputMixin` compiles a class's fields once into
plain (name, getter, converter) steps for the field types whose output it reproduces exactly;
a serializer with any other kind of field keeps DRF's own path. tests/api/test_fast_output.py
holds the two outputs equal.
"""
from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from django.utils import timezone
from rest_framework import fields as f
from rest_framework.fields import SkipField
from rest_framework.relations import PKOnlyObject
from rest_framework.settings import api_settings

_MISSING = object()
# How a step reads its value: a model column (getattr, nothing else: a column's value is never a
# callable nor a PKOnlyObject), a SerializerMethodField, or DRF's own get_attribute rules.
_COLUMN, _METHOD, _ATTRIBUTE = 0, 1, 2
Step = tuple[str, int, Any, Callable[[Any], Any] | None]


def _datetime(value, tz=None):
    """DRF's ISO 8601 output of an aware datetime in the current time zone ('Z' for UTC)."""
    if not value:
        return None
    if isinstance(value, str):
        return value
    if not timezone.is_aware(value):
        raise _Fallback  # DRF makes it aware first: leave that to DRF
    text = value.astimezone(tz or timezone.get_current_timezone()).isoformat()
    return text[:-6] + "Z" if text.endswith("+00:00") else text


def _choice(field: f.ChoiceField) -> Callable[[Any], Any]:
    table = field.choice_strings_to_values

    def convert(value):
        if value in ("", None):
            return value
        return table.get(str(value), value)

    return convert


def _converter(field: f.Field) -> Callable[[Any], Any] | None | object:
    """How to turn a non-None attribute into output: a function, None (as it is), or _MISSING
    when this field's output is not reproduced here."""
    kind = type(field)
    if kind in (f.IntegerField,) or (kind is f.BigIntegerField and not getattr(
            field, "coerce_to_string", api_settings.COERCE_BIGINT_TO_STRING)):
        return int
    if kind is f.FloatField:
        return float
    if kind is f.CharField:
        return str
    if kind is f.ReadOnlyField:
        return None
    if kind is f.JSONField:
        return (lambda v: json.dumps(v, cls=field.encoder).encode()) if field.binary else None
    if kind is f.ChoiceField:
        return _choice(field)
    if (kind is f.DateTimeField and not hasattr(field, "timezone")
            and str(getattr(field, "format", api_settings.DATETIME_FORMAT)).lower() == f.ISO_8601):
        return _datetime
    return _MISSING


class _Fallback(Exception):  # noqa: N818 - a signal, not an error
    """This value needs DRF's own conversion (a naive datetime)."""


def _getter(field: f.Field) -> Callable[[Any], Any]:
    """DRF's attribute rules for one field (default, allow_null, skip, callables)."""
    if len(field.source_attrs) == 1:
        attr = field.source_attrs[0]
        proto_get = field.get_attribute

        def get(obj):
            try:
                value = getattr(obj, attr)
            except AttributeError:
                return proto_get(obj)  # DRF's rules: default, allow_null, skip
            return proto_get(obj) if callable(value) and f.is_simple_callable(value) else value

        return get
    return field.get_attribute  # dotted source: DRF's walk, errors and all


def _columns(serializer) -> frozenset[str]:
    """The attribute names that are the serializer's model's own (non-relation) columns."""
    model = getattr(getattr(serializer, "Meta", None), "model", None)
    if model is None:
        return frozenset()
    return frozenset(c.attname for c in model._meta.concrete_fields if not c.is_relation)


def compile_fields(serializer) -> list[Step] | None:
    """The steps that reproduce `serializer`'s output, or None when some field is not covered."""
    steps: list[Step] = []
    columns = _columns(serializer)
    for field in serializer._readable_fields:
        if isinstance(field, f.SerializerMethodField):
            steps.append((field.field_name, _METHOD, field.method_name, None))
            continue
        convert = _converter(field)
        if convert is _MISSING:
            return None
        if field.source_attrs == [field.source] and field.source in columns:
            steps.append((field.field_name, _COLUMN, field.source, convert))
        else:
            steps.append((field.field_name, _ATTRIBUTE, _getter(field), convert))
    return steps


class FastOutputMixin:
    """Serializer output through steps compiled once per class (see the module docstring).

    Only for serializers whose fields do not depend on the instance's context (no per-request
    field sets); SerializerMethodFields run on the serializer at hand, as in DRF.
    """

    def to_representation(self, instance):
        cls = type(self)
        steps = cls.__dict__.get("_fast_steps", _MISSING)
        if steps is _MISSING:
            steps = compile_fields(self)
            cls._fast_steps = steps  # per class: a subclass compiles its own
        if steps is None:
            return super().to_representation(instance)
        ret = {}
        tz = None
        try:
            for name, kind, arg, convert in steps:
                if kind is _COLUMN:
                    value = getattr(instance, arg)
                elif kind is _METHOD:
                    ret[name] = getattr(self, arg)(instance)
                    continue
                else:
                    try:
                        value = arg(instance)
                    except SkipField:
                        continue
                    if isinstance(value, PKOnlyObject) and value.pk is None:
                        value = None
                if value is None or convert is None:
                    ret[name] = value
                elif convert is _datetime:
                    if tz is None:
                        tz = timezone.get_current_timezone()  # once per object, not per field
                    ret[name] = _datetime(value, tz)
                else:
                    ret[name] = convert(value)
        except _Fallback:
            return super().to_representation(instance)
        return ret
