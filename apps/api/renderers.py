"""The API's JSON renderer: DRF's JSONRenderer, with the encoding done by orjson.

Why: encoding was the largest single cost of a metrics response in the web process (Python's
json formatting 1,200 floats, about a tenth of the request's CPU; issue 19's profile), and
orjson does it in C. What a client parses is unchanged: the same keys in the same order, the
same strings, DRF's own formatting for dates, times, decimals, UUIDs and lazy strings (they are
handed to DRF's encoder), U+2028/U+2029 escaped as DRF does. Floats are written in their
shortest round-trip form (`1e-5` where Python writes `1e-05`: the same number). DRF's encoder
still writes indented output (`Accept: application/json; indent=2`), the output of the
UNICODE_JSON / COMPACT_JSON settings turned off, and anything orjson refuses (an integer beyond
64 bits, a non-string key). Out-of-range floats (NaN, infinities) become null instead of a
server error.
"""
from __future__ import annotations

from typing import Any

import orjson
from rest_framework.renderers import JSONRenderer
from rest_framework.utils.encoders import JSONEncoder

_OPTIONS = orjson.OPT_PASSTHROUGH_DATETIME | orjson.OPT_PASSTHROUGH_DATACLASS
_LS, _PS = "\u2028".encode(), "\u2029".encode()


class FastJSONRenderer(JSONRenderer):
    """JSONRenderer whose compact output is encoded by orjson (same JSON values)."""

    _fallback = JSONEncoder()

    def render(self, data: Any, accepted_media_type: str | None = None,
               renderer_context: dict | None = None) -> bytes:
        if data is None:
            return b""
        if (self.ensure_ascii or not self.compact
                or self.get_indent(accepted_media_type or "", renderer_context or {}) is not None):
            return super().render(data, accepted_media_type, renderer_context)
        try:
            out = orjson.dumps(data, default=self._fallback.default, option=_OPTIONS)
        except orjson.JSONEncodeError:
            return super().render(data, accepted_media_type, renderer_context)
        if _LS in out or _PS in out:  # as DRF: valid JSON, but not inside a <script> literal
            out = out.replace(_LS, b"\\u2028").replace(_PS, b"\\u2029")
        return out
