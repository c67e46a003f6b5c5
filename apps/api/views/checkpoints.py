"""Checkpoints: metadata and download, streamed from the blob store."""
from __future__ import annotations

import logging

from django.conf import settings
from django.http import StreamingHttpResponse
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, OpenApiResponse, extend_schema
from rest_framework import viewsets
from rest_framework.decorators import action
from rest_framework.exceptions import APIException, NotFound

from apps.jobs import access
from apps.jobs.models import Checkpoint

from .. import serializers as s
from ..exceptions import ServiceUnavailable
from ..pagination import BoundedLimitOffsetPagination
from ..permissions import IsPerson
from .common import SafeQueryMixin

CHUNK = 1 << 20
log = logging.getLogger(__name__)


def _store_and_key(blob_uri):
    """(store, key) for a blob_uri (a key of the configured store, or a full URL), or for a
    callable that finds the key in the configured store."""
    try:
        from trainer.transport import open_store
    except ImportError:
        raise ServiceUnavailable("The blob store is not available on this server.") from None
    if callable(blob_uri):
        store = open_store(settings.BLOB_STORE_URL)
        return store, blob_uri(store)
    base = settings.BLOB_STORE_URL.rstrip("/")
    if blob_uri.startswith(base + "/"):
        return open_store(settings.BLOB_STORE_URL), blob_uri[len(base) + 1:]
    if "://" in blob_uri:
        parent, _, key = blob_uri.rpartition("/")
        return open_store(parent), key
    return open_store(settings.BLOB_STORE_URL), blob_uri


def _chunks(data: bytes):
    view = memoryview(data)
    for i in range(0, len(view), CHUNK):
        yield bytes(view[i:i + CHUNK])


def blob_response(locate, filename: str, sha256: str | None = None, what: str = "blob"):
    """Stream a blob of the store; `locate(store)` gives its key (or None when there is none yet).
    Missing blob: 404; any store failure: 503 (never a 500)."""
    try:
        store, key = _store_and_key(locate)
        data = store.get(key) if key else None
    except APIException:
        raise
    except (KeyError, FileNotFoundError):
        data = None
    except Exception as exc:  # any backend (file, redis, s3) failing is the store's problem, not a 500
        log.warning("%s: blob store read failed: %r", filename, exc)
        raise ServiceUnavailable(f"The blob store could not be read: {exc.__class__.__name__}.") from None
    if data is None:
        raise NotFound(f"The {what} is not in the store (yet).")
    resp = StreamingHttpResponse(_chunks(data), content_type="application/octet-stream")
    resp["Content-Length"] = str(len(data))
    resp["Content-Disposition"] = f'attachment; filename="{filename}"'
    if sha256:
        resp["X-Checksum-SHA256"] = sha256
    if key:
        resp["X-Blob-Key"] = key
    return resp


class CheckpointViewSet(SafeQueryMixin, viewsets.ReadOnlyModelViewSet):
    """Checkpoints of your jobs (staff: all). `download` streams the blob."""

    serializer_class = s.CheckpointSerializer
    permission_classes = [IsPerson]
    pagination_class = BoundedLimitOffsetPagination
    lookup_value_regex = r"[0-9]+"

    def get_queryset(self):
        qs = Checkpoint.objects.select_related("job")
        qs = qs.filter(access.job_access_q(self.request.user, "job__"))
        job = self.request.query_params.get("job")
        if self.action == "list" and job:
            ok = job.isascii() and job.isdigit() and len(job) <= 18  # "²": isdigit() true, int() raises
            qs = qs.filter(job_id=int(job)) if ok else qs.none()
        return qs.order_by("job_id", "-version")

    @extend_schema(parameters=[OpenApiParameter("job", int)])
    def list(self, request, *args, **kwargs):
        return super().list(request, *args, **kwargs)

    @extend_schema(responses={(200, "application/octet-stream"): OpenApiResponse(OpenApiTypes.BINARY),
                              503: OpenApiTypes.OBJECT})
    @action(detail=True, methods=["get"])
    def download(self, request, pk=None):
        """The checkpoint file (safetensors), with its SHA-256 in `X-Checksum-SHA256`."""
        ckpt = self.get_object()
        name = f"job{ckpt.job_id}-{ckpt.kind}-v{ckpt.version:05d}.safetensors"
        return blob_response(ckpt.blob_uri, name, ckpt.sha256, what=f"blob of checkpoint {ckpt.pk}")
