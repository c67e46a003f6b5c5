"""GET /metrics: the platform's state in Prometheus text format (docs/metrics.md).

A custom collector reads the database at scrape time (a few aggregate queries), so every web
process answers the same figures in a multi-process deployment and nothing is counted in
process memory. Off by default: METRICS_TOKEN (a bearer token) and/or METRICS_ALLOWED_NETWORKS
(client addresses) must be set, and each one that is set must pass.
"""
from __future__ import annotations

import hmac
import ipaddress
from collections.abc import Iterator
from datetime import timedelta

from django.conf import settings
from django.db.models import Count, DurationField, ExpressionWrapper, F, Max, Q, Sum
from django.http import HttpRequest, HttpResponse
from django.utils import timezone
from django.views.decorators.http import require_GET
from prometheus_client import exposition
from prometheus_client.core import (
    CollectorRegistry,
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from apps.dashboard import data
from apps.inventory.models import Node, visible_nodes_q
from apps.jobs import state as st
from apps.jobs.models import Incident, Job, Learner

HEAL_BUCKETS_S = (1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0)


def _jobs() -> Iterator[Metric]:
    counts = dict(Job.objects.values_list("status").annotate(n=Count("id")).order_by())
    g = GaugeMetricFamily("diloco_jobs", "Jobs by state.", labels=["state"])
    for s in st.STATUSES:
        g.add_metric([s], counts.get(s, 0))
    yield g
    totals = Job.objects.aggregate(steps=Sum("outer_steps"), computed=Sum("tokens_computed"),
                                   contributed=Sum("tokens_contributed"), lost=Sum("tokens_lost"))
    yield CounterMetricFamily("diloco_outer_steps", "Outer steps of all jobs.", value=totals["steps"] or 0)
    tokens = CounterMetricFamily("diloco_tokens", "Tokens of all jobs: computed by learners, "
                                 "contributed to merges, lost to failures.", labels=["kind"])
    for kind in ("computed", "contributed", "lost"):
        tokens.add_metric([kind], totals[kind] or 0)
    yield tokens


def _active_jobs() -> Iterator[Metric]:
    """Per job that is placing, running or pausing: progress, goodput and telemetry lag."""
    labels = ["job", "name"]
    steps = GaugeMetricFamily("diloco_job_outer_steps", "Outer steps of an active job.", labels=labels)
    tokens = GaugeMetricFamily("diloco_job_tokens_computed", "Tokens computed by an active job.",
                               labels=labels)
    goodput = GaugeMetricFamily("diloco_job_goodput_ratio",
                                "Tokens contributed to merges over tokens computed, per active job.",
                                labels=labels)
    lag = GaugeMetricFamily("diloco_telemetry_lag_seconds",
                            "Seconds since the newest heartbeat of a running learner of an active job "
                            "reached the database.", labels=labels)
    running = Count("learners", filter=Q(learners__state=Learner.State.RUNNING))
    newest = Max("learners__last_heartbeat", filter=Q(learners__state=Learner.State.RUNNING))
    now = timezone.now()
    for j in (Job.objects.filter(status__in=data.ACTIVE).annotate(running=running, newest=newest)
              .order_by("pk").values("pk", "name", "outer_steps", "tokens_computed", "tokens_contributed",
                                     "running", "newest")):
        lv = [str(j["pk"]), j["name"]]
        steps.add_metric(lv, j["outer_steps"])
        tokens.add_metric(lv, j["tokens_computed"])
        if j["tokens_computed"]:
            goodput.add_metric(lv, j["tokens_contributed"] / j["tokens_computed"])
        if j["running"] and j["newest"] is not None:
            lag.add_metric(lv, max(0.0, (now - j["newest"]).total_seconds()))
    yield from (steps, tokens, goodput, lag)


def _learners() -> Iterator[Metric]:
    counts = dict(Learner.objects.values_list("state").annotate(n=Count("id")).order_by())
    g = GaugeMetricFamily("diloco_learners", "Learners by state.", labels=["state"])
    for s in Learner.State.values:
        g.add_metric([s], counts.get(s, 0))
    yield g


def _incidents() -> Iterator[Metric]:
    heal = ExpressionWrapper(F("healed_at") - F("detected_at"), output_field=DurationField())
    healed = Q(healed_at__isnull=False)
    buckets = {f"le{i}": Count("id", filter=healed & Q(heal_s__lte=timedelta(seconds=b)))
               for i, b in enumerate(HEAL_BUCKETS_S)}
    rows = (Incident.objects.annotate(heal_s=heal).values("kind")
            .annotate(total=Count("id"), open=Count("id", filter=Q(healed_at__isnull=True)),
                      healed=Count("id", filter=healed), heal_sum=Sum("heal_s", filter=healed), **buckets)
            .order_by("kind"))
    total = CounterMetricFamily("diloco_incidents", "Incidents recorded, by kind.", labels=["kind"])
    open_ = GaugeMetricFamily("diloco_incidents_open", "Incidents not healed yet, by kind.", labels=["kind"])
    healed_c = CounterMetricFamily("diloco_incidents_healed", "Incidents healed, by kind.", labels=["kind"])
    hist = HistogramMetricFamily("diloco_incident_time_to_heal_seconds",
                                 "From detection to the work running again, healed incidents, by kind.",
                                 labels=["kind"])
    for r in rows:
        total.add_metric([r["kind"]], r["total"])
        open_.add_metric([r["kind"]], r["open"])
        healed_c.add_metric([r["kind"]], r["healed"])
        cumulative = [(floatToGoString(b), r[f"le{i}"]) for i, b in enumerate(HEAL_BUCKETS_S)]
        cumulative.append(("+Inf", r["healed"]))
        sum_s = r["heal_sum"].total_seconds() if r["heal_sum"] is not None else 0.0
        hist.add_metric([r["kind"]], cumulative, sum_value=sum_s)
    yield from (total, open_, healed_c, hist)


def _pools() -> Iterator[Metric]:
    labels = ["pool"]
    fams = {
        "utilisation": GaugeMetricFamily("diloco_pool_utilisation_ratio",
                                         "Devices running a learner over devices, per pool.", labels=labels),
        "busy": GaugeMetricFamily("diloco_pool_busy_devices", "Devices running a learner, per pool.",
                                  labels=labels),
        "devices": GaugeMetricFamily("diloco_pool_devices", "Devices of the pool.", labels=labels),
        "tokens_per_s": GaugeMetricFamily("diloco_pool_tokens_per_second",
                                          "Tokens/s reported by the pool's running learners.", labels=labels),
        "watts": GaugeMetricFamily("diloco_pool_power_watts", "TDP-based power estimate of the pool.",
                                   labels=labels),
    }
    for r in data.pool_rows():
        lv = [r["pool"].slug]
        for key, fam in fams.items():
            fam.add_metric(lv, r["pool"].device_count if key == "devices" else r[key])
    yield from fams.values()
    nodes = GaugeMetricFamily("diloco_nodes", "Nodes shown in the fleet view, by pool and state "
                              "(purged ones left out).", labels=["pool", "state"])
    for slug, state, n in (Node.objects.filter(visible_nodes_q()).values_list("pool__slug", "state")
                           .annotate(n=Count("id")).order_by("pool__slug", "state")):
        nodes.add_metric([slug, state], n)
    yield nodes


class PlatformCollector(Collector):
    """Reads the database on every scrape; no state of its own."""

    def collect(self) -> Iterator[Metric]:
        for part in (_jobs, _active_jobs, _learners, _incidents, _pools):
            yield from part()


REGISTRY = CollectorRegistry(auto_describe=False)
REGISTRY.register(PlatformCollector())


def _client_allowed(request: HttpRequest, networks: list[str]) -> bool:
    try:
        addr = ipaddress.ip_address(request.META.get("REMOTE_ADDR", ""))
    except ValueError:
        return False
    return any(addr in ipaddress.ip_network(n, strict=False) for n in networks)


def _token_ok(request: HttpRequest, token: str) -> bool:
    scheme, _, given = request.META.get("HTTP_AUTHORIZATION", "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), token.encode())


def refusal(request: HttpRequest) -> HttpResponse | None:
    """Why this request may not scrape (403 off or wrong network, 401 wrong token), or None."""
    token, networks = settings.METRICS_TOKEN, list(settings.METRICS_ALLOWED_NETWORKS)
    if not token and not networks:
        return HttpResponse("metrics are off: set METRICS_TOKEN and/or METRICS_ALLOWED_NETWORKS\n",
                            status=403, content_type="text/plain")
    if networks and not _client_allowed(request, networks):
        return HttpResponse("this address may not scrape metrics (METRICS_ALLOWED_NETWORKS)\n",
                            status=403, content_type="text/plain")
    if token and not _token_ok(request, token):
        resp = HttpResponse("a valid bearer token is required (METRICS_TOKEN)\n", status=401,
                            content_type="text/plain")
        resp["WWW-Authenticate"] = 'Bearer realm="metrics"'
        return resp
    return None


@require_GET
def metrics(request: HttpRequest) -> HttpResponse:
    """The exposition, in the format the scraper asks for (Prometheus text or OpenMetrics)."""
    refused = refusal(request)
    if refused is not None:
        return refused
    encoder, content_type = exposition.choose_encoder(request.META.get("HTTP_ACCEPT", ""))
    resp = HttpResponse(encoder(REGISTRY), content_type=content_type)
    resp["Cache-Control"] = "no-store"
    return resp
