"""Helpers shared by the API views."""
from __future__ import annotations

import contextlib
import functools

from rest_framework import serializers

from ..permissions import IsPerson


@functools.cache
def _param_fields(serializer_class: type[serializers.Serializer]) -> tuple[tuple[str, bool], ...]:
    """(name, takes a list) per field: read once per class, since building a serializer's
    fields deep-copies them (a tenth of a millisecond per request, issue 19's profile)."""
    return tuple((name, isinstance(field, serializers.ListField | serializers.MultipleChoiceField))
                 for name, field in serializer_class().fields.items())


def query_params(request, serializer_class: type[serializers.Serializer]) -> dict:
    """Validate query parameters with a serializer (lists for MultipleChoice/List fields)."""
    data = {}
    for name, is_list in _param_fields(serializer_class):
        if is_list:
            values = []
            for raw in request.query_params.getlist(name):
                values += [v for v in raw.split(",") if v]
            if values:
                data[name] = values
        elif name in request.query_params:
            data[name] = request.query_params[name]
    ser = serializer_class(data=data)
    ser.is_valid(raise_exception=True)
    return ser.validated_data


class PersonViewMixin:
    permission_classes = [IsPerson]


class SafeQueryMixin:
    """Refuse query strings the database cannot take (NUL characters, absurd lengths) with a 400."""

    def initial(self, request, *args, **kwargs):
        for key, values in request.query_params.lists():
            for v in [key, *values]:
                if "\x00" in v:
                    raise serializers.ValidationError({key[:40]: ["NUL characters are not allowed."]})
                if len(v) > 2000:
                    raise serializers.ValidationError({key[:40]: ["Too long (at most 2000 characters)."]})
        super().initial(request, *args, **kwargs)


def publish_fleet(msg: dict) -> None:
    """Tell dashboards about a fleet change, when the telemetry app offers it."""
    try:
        from apps.telemetry.publish import publish_fleet as publish
    except ImportError:
        return
    with contextlib.suppress(Exception):  # telemetry must never break an API call
        publish(msg)


def not_found(request, *args, **kwargs):
    """404 in the API's error shape for paths no route matches (with a hint for a missing slash)."""
    from django.http import JsonResponse
    from django.urls import Resolver404, resolve

    detail = "Not found."
    if not request.path.endswith("/"):
        try:
            match = resolve(request.path + "/")
        except Resolver404:
            match = None
        if match is not None and match.func is not not_found:
            if request.method in ("GET", "HEAD"):  # what CommonMiddleware's APPEND_SLASH would do
                from django.http import HttpResponsePermanentRedirect

                query = request.META.get("QUERY_STRING", "")
                return HttpResponsePermanentRedirect(request.path + "/" + (f"?{query}" if query else ""))
            detail = f"Not found. Did you mean {request.path}/ (with a trailing slash)?"
    return JsonResponse({"detail": detail, "errors": {"detail": [detail]}}, status=404)
