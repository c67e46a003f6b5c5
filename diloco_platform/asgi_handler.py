"""Django's ASGI handler with the middleware chain run in sync mode: one thread hop per request.

Why: under ASGI, Django builds the middleware chain in async mode, and every middleware built
on MiddlewareMixin (all of Django's, whitenoise's) then calls its process_request and
process_response through `sync_to_async` on its own: with eight middlewares and sync DRF views
a request crossed between the event loop and its worker thread about 30 times (cProfile,
issue 19). This handler builds the chain as WSGI does and runs the whole of it, view included,
in one `sync_to_async` call on the request's thread. What is served, and on which thread
(one per request: ASGIHandler's ThreadSensitiveContext), is unchanged; an async view, should
one appear, runs through async_to_sync from that thread.
"""
from __future__ import annotations

from asgiref.sync import sync_to_async
from django.core.handlers.asgi import ASGIHandler
from django.http import HttpRequest, HttpResponseBase


class SyncChainASGIHandler(ASGIHandler):
    """ASGIHandler whose middleware chain and views run synchronously, in one thread hop."""

    def load_middleware(self, is_async: bool = False) -> None:
        super().load_middleware(is_async=False)

    async def get_response_async(self, request: HttpRequest) -> HttpResponseBase:
        return await sync_to_async(self.get_response, thread_sensitive=True)(request)


def get_asgi_application() -> SyncChainASGIHandler:
    """Like django.core.asgi.get_asgi_application, with the one-hop handler."""
    import django

    django.setup(set_prefix=False)
    return SyncChainASGIHandler()
