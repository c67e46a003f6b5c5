"""Content-Security-Policy on every response (issue 35: there was none).

The dashboard loads its scripts and styles from /static/ only (no inline <script>, no style
or on* attributes; JSON data rides in <script type="application/json">, which is not run),
so its policy is strict: a script injected into a page would not run. Two pages of third-party
code need more: the admin and DRF's browsable API write style attributes (`'unsafe-inline'`
styles), and the Swagger UI at /api/docs/ starts itself with an inline script (inline scripts
allowed there; the page shows the schema, no user data).

`connect-src` names the request's own host for ws:// and wss:// (the dashboard's live
sockets): not every browser counts websockets to the same host as 'self'.

CSP_POLICY in the environment replaces the policy whole, on every path (e.g. to add report-uri);
CSP_REPORT_ONLY=1 sends it as Content-Security-Policy-Report-Only instead.
"""
from __future__ import annotations

import os

from django.core.exceptions import DisallowedHost

BASE = {
    "default-src": "'self'",
    "script-src": "'self'",
    "style-src": "'self'",
    "img-src": "'self' data:",
    "font-src": "'self'",
    "connect-src": "'self'",
    "object-src": "'none'",
    "base-uri": "'none'",
    "form-action": "'self'",
    "frame-ancestors": "'none'",
}
# path prefix -> directives replaced there (the first prefix that matches wins)
RELAXED = (
    ("/api/docs/", {"script-src": "'self' 'unsafe-inline'", "style-src": "'self' 'unsafe-inline'"}),
    ("/admin/", {"style-src": "'self' 'unsafe-inline'"}),
    ("/api/", {"style-src": "'self' 'unsafe-inline'"}),
)
HEADER = "Content-Security-Policy"


def policy_for(path: str, host: str | None = None) -> str:
    directives = dict(BASE)
    for prefix, changes in RELAXED:
        if path.startswith(prefix):
            directives.update(changes)
            break
    if host:
        directives["connect-src"] = f"'self' ws://{host} wss://{host}"
    return "; ".join(f"{k} {v}" for k, v in directives.items())


class ContentSecurityPolicyMiddleware:
    def __init__(self, get_response):
        self.get_response = get_response
        self.override = os.environ.get("CSP_POLICY", "").strip()
        self.header = HEADER + ("-Report-Only" if os.environ.get("CSP_REPORT_ONLY") == "1" else "")

    def __call__(self, request):
        response = self.get_response(request)
        if HEADER in response or f"{HEADER}-Report-Only" in response:
            return response  # a view that set its own
        try:
            host = request.get_host()
        except DisallowedHost:
            host = None
        if host and not all(c.isalnum() or c in ".-:[]" for c in host):
            host = None  # never put an odd Host header into a header of ours
        response[self.header] = self.override or policy_for(request.path, host)
        return response
