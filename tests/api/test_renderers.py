"""The orjson renderer gives the JSON values DRF's renderer gives (apps/api/renderers.py)."""
from __future__ import annotations

import datetime as dt
import json
import uuid
from decimal import Decimal

import pytest
from django.utils.translation import gettext_lazy
from rest_framework.renderers import JSONRenderer
from rest_framework.utils.serializer_helpers import ReturnDict, ReturnList

from apps.api.renderers import FastJSONRenderer

UTC = dt.UTC


def _both(data, media_type=None, context=None) -> tuple[bytes, bytes]:
    return (FastJSONRenderer().render(data, media_type, context),
            JSONRenderer().render(data, media_type, context))


SAMPLES = [
    {"a": 1, "b": [1.5, 2.0, 1e-05, 1e16, -0.0, 123456789.123456789], "c": None, "d": True},
    {"when": dt.datetime(2026, 12, 6, 21, 3, 4, 567891, tzinfo=UTC),
     "naive": dt.datetime(2026, 12, 6, 21, 3, 4),  # noqa: DTZ001 - DRF writes naive ones too
     "day": dt.date(2026, 12, 6),
     "clock": dt.time(21, 3, 4, 500), "took": dt.timedelta(seconds=90.5)},
    {"price": Decimal("1.10"), "id": uuid.UUID(int=7), "lazy": gettext_lazy("Not found."),
     "text": "naïve – ünïcode ✓", "bytes": b"raw"},
    ReturnDict({"z": 1, "a": ReturnList([{"k": "v"}], serializer=None)}, serializer=None),
    [{"nested": {"deeper": [[1, 2], [3, {"x": "y"}]]}}],
    {"order": "kept", "b": 2, "a": 1},
]


@pytest.mark.parametrize("data", SAMPLES)
def test_the_same_json_values_as_drfs_renderer(data):
    fast, drf = _both(data)
    assert json.loads(fast) == json.loads(drf)
    assert list(json.loads(fast)) == list(json.loads(drf))  # key order kept


def test_datetimes_are_formatted_by_drf_not_by_orjson():
    fast, drf = _both({"t": dt.datetime(2026, 1, 2, 3, 4, 5, 678901, tzinfo=UTC)})
    assert fast == drf == b'{"t":"2026-01-02T03:04:05.678901Z"}'


def test_line_and_paragraph_separators_are_escaped_as_drf_does():
    fast, drf = _both({"s": "a\u2028b\u2029c"})
    assert fast == drf
    assert b"\\u2028" in fast and "\u2028".encode() not in fast


def test_indented_output_is_drfs_byte_for_byte():
    data = {"a": [1, 2.5], "b": {"c": "d"}}
    fast, drf = _both(data, "application/json; indent=2")
    assert fast == drf and b"\n  " in fast


def test_what_orjson_refuses_goes_through_drfs_encoder():
    fast, drf = _both({"big": 2**70, 1: "int key"})
    assert fast == drf


def test_out_of_range_floats_become_null_instead_of_an_error():
    with pytest.raises(ValueError):
        JSONRenderer().render({"v": float("nan")})
    assert json.loads(FastJSONRenderer().render({"v": float("nan"), "w": float("inf")})) == \
        {"v": None, "w": None}


def test_none_renders_as_an_empty_body():
    assert FastJSONRenderer().render(None) == b""


@pytest.mark.django_db
def test_the_api_answers_through_it(client, django_user_model):
    from rest_framework.test import APIClient

    from apps.api.models import ApiToken

    user = django_user_model.objects.create_user("renderer-user", password=None)
    _, raw = ApiToken.issue(user, "t")
    api = APIClient()
    api.credentials(HTTP_AUTHORIZATION=f"Bearer {raw}")
    r = api.get("/api/v1/jobs/")
    assert r.status_code == 200 and r["Content-Type"] == "application/json"
    assert isinstance(r.accepted_renderer, FastJSONRenderer)
    assert json.loads(r.content)["results"] == []
