"""A JSON parser that bounds the body size and nesting and never lets bad input become a 500."""
from __future__ import annotations

import json
import math
import re

from django.conf import settings
from rest_framework import parsers
from rest_framework.exceptions import ParseError

from .exceptions import PayloadTooLarge

MAX_DEPTH = 32


_SURROGATES = re.compile("[\ud800-\udfff]")


def check_tree(obj, limit: int = MAX_DEPTH) -> str | None:
    """Why this decoded JSON is refused (too deep, non-finite number, bad string), or None."""
    stack = [(obj, 1, "")]
    while stack:
        node, depth, path = stack.pop()
        if depth > limit:
            return f"nested deeper than {limit} levels"
        if isinstance(node, dict):
            for key, val in node.items():
                bad = _bad_string(key)
                if bad:
                    return f"key {path + '.' if path else ''}{key!a}: {bad}"
                stack.append((val, depth + 1, f"{path}.{key}" if path else key))
        elif isinstance(node, list):
            stack.extend((v, depth + 1, f"{path}.{i}" if path else str(i)) for i, v in enumerate(node))
        elif isinstance(node, float) and not math.isfinite(node):
            return f"{path or 'value'}: number out of range"
        elif isinstance(node, str):
            bad = _bad_string(node)
            if bad:
                return f"{path or 'value'}: {bad}"
    return None


def _bad_string(s: str) -> str | None:
    if "\x00" in s:
        return "NUL characters are not allowed"
    if _SURROGATES.search(s):
        return "unpaired UTF-16 surrogates are not allowed"
    return None


def _reject_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


class BoundedJSONParser(parsers.JSONParser):
    """Strict JSON (no NaN/Infinity), at most DATA_UPLOAD_MAX_MEMORY_SIZE bytes, nesting <= 32.

    A view may set `max_body_bytes` lower (the token endpoints: a few hundred bytes is all
    they take, so a large body is refused before it is decoded)."""

    def parse(self, stream, media_type=None, parser_context=None):
        limit = settings.DATA_UPLOAD_MAX_MEMORY_SIZE or 1024 * 1024
        view_limit = getattr((parser_context or {}).get("view"), "max_body_bytes", None)
        if view_limit:
            limit = min(limit, view_limit)
        request = (parser_context or {}).get("request")
        length = request.META.get("CONTENT_LENGTH") if request is not None else None
        try:
            if length and int(length) > limit:
                raise PayloadTooLarge(f"Request body too large: at most {limit} bytes.")
        except ValueError:
            raise ParseError("Invalid Content-Length header.") from None
        raw = stream.read(limit + 1) if stream is not None else b""
        if len(raw) > limit:
            raise PayloadTooLarge(f"Request body too large: at most {limit} bytes.")
        if not raw.strip():
            raise ParseError("JSON parse error: empty body.")
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ParseError(f"Request body is not valid UTF-8 (byte {exc.start}).") from None
        try:
            data = json.loads(text, parse_constant=_reject_constant)
        except RecursionError:
            raise ParseError(f"JSON parse error: nested deeper than {MAX_DEPTH} levels.") from None
        except ValueError as exc:
            raise ParseError(f"JSON parse error: {exc}") from None
        problem = check_tree(data)
        if problem:
            raise ParseError(f"Invalid JSON: {problem}.")
        return data
