"""Server-rendered dashboard pages. Live parts update over /ws/jobs/<id>/ and /ws/fleet/.

Over 500 lines because it holds every page's view in one place, each short and alike (a query,
a permission check, a template); the page-specific logic lives in data.py, compare.py,
markers.py and job_filters.py.
"""
from __future__ import annotations

import io
import logging
from collections import defaultdict
from datetime import timedelta

from django.contrib import messages
from django.contrib.admin.views.decorators import staff_member_required
from django.contrib.auth import views as auth_views
from django.contrib.auth.decorators import login_required
from django.core.exceptions import PermissionDenied
from django.core.paginator import Paginator
from django.db.models import Count, Q
from django.http import FileResponse, Http404, HttpResponse, HttpResponseRedirect, JsonResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.urls import reverse
from django.utils import timezone
from django.views.decorators.http import require_POST

from apps.api.authentication import TokenRefused, issue_token
from apps.api.models import ApiToken
from apps.api.throttling import AUTH_THROTTLES, JOB_CREATE_THROTTLES, TOKEN_CREATE_THROTTLES, throttle_wait
from apps.coordinator.models import SyncerLease
from apps.inventory.models import Node, Pool
from apps.jobs import access, services
from apps.jobs import state as st
from apps.jobs.models import Checkpoint, Event, Incident, Job, Learner, OuterStep
from apps.jobs.spec import SpecError

from . import compare, data
from .demo_chaos import demo_chaos_enabled
from .forms import JobSpecForm, TokenCreateForm, TokenRevokeForm
from .job_filters import JobFilters
from .markers import job_markers
from .preview import dry_run

log = logging.getLogger(__name__)

JOB_CHART_BUCKETS = 300
SPARK_BUCKETS = 40
SPARK_RECENT = 2000  # sparklines show the newest points of each series
SPARK_JOBS = 12
TIMELINE_LIMIT = 200
OUTER_STEPS_FOR_HEALTH = 50


def _throttled(response: HttpResponse, wait: int) -> HttpResponse:
    response.status_code = 429
    response["Retry-After"] = str(wait)
    return response


class LoginView(auth_views.LoginView):
    """Sign-in under the API's lock-out: every attempt counts against the client address and
    the username (apps.api.throttling.AUTH_THROTTLES), on the same counters as
    POST /api/v1/auth/token/, so the two doors share one allowance. A locked-out attempt
    is not checked at all, right password or not."""

    def post(self, request, *args, **kwargs):
        wait = throttle_wait(request, AUTH_THROTTLES)
        if wait is None:
            return super().post(request, *args, **kwargs)
        context = self.get_context_data(form=self.get_form_class()(request))  # unbound: no password check
        context["locked_out"] = f"Too many sign-in attempts; try again in {wait} s."
        return _throttled(self.render_to_response(context), wait)


def admin_login(request, *args, **kwargs):
    """The admin's sign-in under the same lock-out as the dashboard's and the API's."""
    from django.contrib import admin

    if request.method == "POST":
        wait = throttle_wait(request, AUTH_THROTTLES)
        if wait is not None:
            return _throttled(HttpResponse(f"Too many sign-in attempts; try again in {wait} s.\n",
                                           content_type="text/plain"), wait)
    return admin.site.login(request, *args, **kwargs)


def _publish_fleet(msg: dict) -> None:
    try:
        from apps.telemetry.publish import publish_fleet
    except ImportError:
        return
    try:
        publish_fleet(msg)
    except Exception:  # the page is right after a reload anyway; never fail the action
        log.exception("publish_fleet failed")


# --------------------------------------------------------------------------- overview
@login_required
def overview(request):
    jobs = data.visible_jobs(request.user)
    running = list(jobs.filter(status__in=data.ACTIVE).select_related("owner")
                   .order_by("-started_at", "-created_at")[:SPARK_JOBS])
    series = data.downsample([j.pk for j in running], ["train_loss", "goodput"], SPARK_BUCKETS,
                             recent=SPARK_RECENT)
    for j in running:
        s = series.get(j.pk, {})
        j.loss_points = [v for _, _, v in s.get("train_loss", [])]
        j.goodput_points = [v for _, _, v in s.get("goodput", [])]
    counts = dict(jobs.values_list("status").annotate(n=Count("id")).order_by())
    incidents = list(
        Incident.objects.filter(healed_at__isnull=True)
        .filter(Q(job__in=jobs) if not request.user.is_staff else Q())
        .select_related("job", "pool", "learner").order_by("-detected_at")[:20]
    )
    return render(request, "dashboard/overview.html", {
        "running": running,
        "active_total": sum(counts.get(s, 0) for s in data.ACTIVE),
        "counts": counts,
        "rows": data.pool_rows(),
        "incidents": incidents,
        "today": data.energy_cost_today(jobs),
        "nav": "overview",
    })


# --------------------------------------------------------------------------- fleet
@login_required
def fleet(request):
    pools = list(Pool.objects.select_related("accelerator"))
    return render(request, "dashboard/fleet.html", {
        "rows": data.pool_rows(pools),
        "nav": "fleet",
    })


@login_required
def fleet_live(request):
    """Live figures of every pool (fleet pages refresh them when /ws/fleet/ reports a change)."""
    rows = data.pool_rows()
    return JsonResponse({"pools": [{
        "id": r["pool"].pk, "slug": r["pool"].slug, "state": r["pool"].state,
        "state_display": r["pool"].get_state_display(), "utilisation": r["utilisation"], "busy": r["busy"],
        "tokens_per_s": r["tokens_per_s"], "watts": r["watts"], "nodes_online": r["nodes_online"],
        "nodes_total": r["nodes_total"],
    } for r in rows]})


@login_required
def pool_detail(request, slug):
    pool = get_object_or_404(Pool.objects.select_related("accelerator"), slug=slug)
    learners = Learner.objects.filter(pool=pool).exclude(
        state__in=[Learner.State.DONE, Learner.State.REMOVED, Learner.State.STOPPED]).select_related(
        "job", "node").order_by("job_id", "index")
    learners = learners.filter(access.job_access_q(request.user, "job__"))
    events = Event.objects.filter(access.job_or_fleet_q(request.user), pool=pool).order_by("-time")[:50]
    span = _history_span(request)
    if isinstance(span, HttpResponse):
        return span
    nodes = list(Node.objects.filter(pool=pool).order_by("hostname"))
    return render(request, "dashboard/pool.html", {
        "pool": pool,
        "rows": data.pool_rows([pool]),
        "nodes": [n for n in nodes if not n.is_purged],
        "purged_nodes": sum(n.is_purged for n in nodes),
        "learners": list(learners[:200]),
        "events": list(events),
        "history": _history(span, pool_id=pool.pk),
        "history_range": span,
        "history_ranges": list(HISTORY_RANGES),
        "nav": "fleet",
    })


HISTORY_RANGES = {"1h": 3600, "6h": 6 * 3600, "24h": 24 * 3600, "7d": 7 * 86400, "30d": 30 * 86400}
HISTORY_BUCKETS = 240


def _history_span(request) -> str | HttpResponse:
    """The `range` of the history charts, or a 400 that names the field and the reason."""
    span = request.GET.get("range", "6h")
    if span not in HISTORY_RANGES:
        return HttpResponse(f"range: must be one of {', '.join(HISTORY_RANGES)}\n", status=400,
                            content_type="text/plain")
    return span


def _history(span: str, **which) -> dict:
    since = timezone.now() - timedelta(seconds=HISTORY_RANGES[span])
    return data.fleet_history(since, HISTORY_BUCKETS, **which)


@login_required
def node_detail(request, slug, pk):
    """A node: its figures, its utilisation, tokens/s and power history, its learners."""
    node = get_object_or_404(Node.objects.select_related("pool__accelerator"), pk=pk, pool__slug=slug)
    span = _history_span(request)
    if isinstance(span, HttpResponse):
        return span
    learners = (Learner.objects.filter(node=node, state__in=[Learner.State.RUNNING, Learner.State.STARTING])
                .filter(access.job_access_q(request.user, "job__")).select_related("job")
                .order_by("job_id", "index"))
    events = (Event.objects.filter(access.job_or_fleet_q(request.user), pool=node.pool,
                                   message__contains=node.worker_name).order_by("-time")[:50])
    return render(request, "dashboard/node.html", {
        "node": node, "pool": node.pool, "learners": list(learners[:200]), "events": list(events),
        "history": _history(span, node_id=node.pk), "history_range": span,
        "history_ranges": list(HISTORY_RANGES), "nav": "fleet",
    })


@login_required
def fleet_history_json(request, slug, pk=None):
    """The history charts' series ({series: [[unix_time, value], ...]}), refetched by the pages."""
    pool = get_object_or_404(Pool, slug=slug)
    span = _history_span(request)
    if isinstance(span, HttpResponse):
        return span
    if pk is not None:
        node = get_object_or_404(Node, pk=pk, pool=pool)
        series = _history(span, node_id=node.pk)
    else:
        series = _history(span, pool_id=pool.pk)
    return JsonResponse({name: [[t, v] for t, v in pts] for name, pts in series.items()})


@staff_member_required
@require_POST
def pool_drain(request, slug):
    """Stop placing on a pool; the coordinator moves its learners elsewhere. Staff with the
    `inventory.change_pool` permission only, as the admin's drain action (issue 35)."""
    if not request.user.has_perm("inventory.change_pool"):
        raise PermissionDenied("Draining a pool needs the inventory.change_pool permission.")
    pool = get_object_or_404(Pool, slug=slug)
    target = request.POST.get("state", Pool.State.DRAINING)
    if target not in (Pool.State.DRAINING, Pool.State.ACTIVE):
        messages.error(request, f"unknown pool state {target!r}")
        return HttpResponseRedirect(_next_url(request, reverse("dashboard:pool", args=[slug])))
    if pool.state != target:
        Pool.objects.filter(pk=pool.pk).update(state=target, updated_at=timezone.now())
        pool.state = target
        verb = "drained" if target == Pool.State.DRAINING else "re-activated"
        reason = f"{verb} by {request.user.username} from the dashboard"
        Event.objects.create(pool=pool, kind=Event.Kind.DRAINED if target == Pool.State.DRAINING
                             else Event.Kind.INFO, message=f"pool {pool.slug} {verb}",
                             payload={"pool": pool.slug, "state": target, "reason": reason})
        affected = list(Learner.objects.filter(pool=pool, job__status__in=data.ACTIVE)
                        .values_list("job_id", flat=True).distinct())
        for job_id in affected:
            services._kick_coordinator(job_id)
        _publish_fleet({"type": "pool", "id": pool.pk, "slug": pool.slug, "state": target,
                        "state_display": pool.get_state_display()})
        messages.success(request, f"Pool {pool.slug} {verb}.")
    return HttpResponseRedirect(_next_url(request, reverse("dashboard:pool", args=[slug])))


def _next_url(request, default: str) -> str:
    nxt = request.POST.get("next", "")
    return nxt if nxt.startswith("/") and not nxt.startswith("//") else default


# --------------------------------------------------------------------------- jobs
@login_required
def job_list(request):
    """Jobs, filtered by status, owner, team, pool and text, all in the URL (job_filters)."""
    visible = data.visible_jobs(request.user)
    f = JobFilters.from_query(request.GET)
    # one query for the status counts and the owner and team choices
    counts: dict[str, int] = defaultdict(int)
    owners, teams = set(), set()
    for status, owner, team, n in (visible.values_list("status", "owner__username", "team")
                                   .annotate(n=Count("id")).order_by()):
        counts[status] += n
        owners.add(owner)
        teams.add(team)
    jobs = f.apply(visible.select_related("owner"))
    page = Paginator(jobs.order_by("-created_at"), 25).get_page(request.GET.get("page"))
    filters = [("", "All", sum(counts.values())),
               ("active", "Active", sum(counts.get(s, 0) for s in data.ACTIVE))]
    filters += [(s, s.capitalize(), counts.get(s, 0)) for s in st.STATUSES]
    return render(request, "dashboard/jobs.html", {
        "page": page, "status": f.status, "q": f.q, "f": f, "nav": "jobs",
        "filters": [(v, label, n, f.query(status=v)) for v, label, n in filters],
        "owners": sorted(owners), "teams": sorted(t for t in teams if t),
        "pools": list(Pool.objects.order_by("slug").values_list("slug", flat=True)),
        "page_query": f.query(),
    })


@login_required
def job_new(request):
    """The new-job form. Dry runs and submissions count against the API's job_create rate
    (apps.api.throttling.JOB_CREATE_THROTTLES, the same per-user counter)."""
    preview = None
    if request.method == "POST" and (wait := throttle_wait(request, JOB_CREATE_THROTTLES)) is not None:
        return _throttled(render(request, "dashboard/job_new.html", {
            "form": JobSpecForm.unchecked(request.POST, user=request.user), "preview": None, "nav": "new",
            "throttled": f"Too many dry runs and submissions; try again in {wait} s.",
        }), wait)
    if request.method == "POST":
        form = JobSpecForm(request.POST, user=request.user)
        if form.is_valid():
            if request.POST.get("action") == "dry_run":
                preview = dry_run(form.spec)
            else:
                try:
                    job, _ = services.submit_job(request.user, form.spec.model_dump(mode="json"),
                                                 team=form.cleaned_data.get("team", ""))
                except SpecError as exc:  # validated twice: the service is the authority
                    for field, msgs in exc.errors.items():
                        for m in msgs:
                            form.add_error(field if field in form.fields else None, m)
                else:
                    messages.success(request, f"Job #{job.pk} submitted.")
                    return redirect("dashboard:job", pk=job.pk)
    else:
        form = JobSpecForm(user=request.user)
    # Invalid input re-renders with 200 and the errors inline (as Django forms do): a 4xx
    # document would be logged by browsers as a failed resource load.
    return render(request, "dashboard/job_new.html", {"form": form, "preview": preview, "nav": "new"})


def _empty_health() -> dict:
    return {"n": 0, "norm": 0.0, "nnorm": 0, "cos": 0.0, "ncos": 0, "last_norm": None, "last_cos": None}


def _recent_outer_steps(job: Job) -> list[dict]:
    return list(OuterStep.objects.filter(job=job).order_by("-created_at").values(
        "fragment", "version", "contributors", "merged_norm", "duration_s", "created_at")
        [:OUTER_STEPS_FOR_HEALTH])


def _contribution_health(outer_steps: list[dict], learners: list[Learner]) -> tuple[list[dict], int]:
    steps = [s["contributors"] for s in outer_steps]
    acc: dict[int, dict] = defaultdict(_empty_health)
    for contributors in reversed(steps):  # oldest first, so "last" is the newest
        for c in contributors or []:
            try:
                idx = int(c.get("learner"))
            except (TypeError, ValueError):
                continue
            a = acc[idx]
            a["n"] += 1
            if isinstance(c.get("norm"), int | float):
                a["norm"] += c["norm"]
                a["nnorm"] += 1
                a["last_norm"] = c["norm"]
            if isinstance(c.get("cosine"), int | float):
                a["cos"] += c["cosine"]
                a["ncos"] += 1
                a["last_cos"] = c["cosine"]
    rows = []
    for lr in learners:
        a = acc.get(lr.index) or _empty_health()
        mean_cos = a["cos"] / a["ncos"] if a["ncos"] else None
        rows.append({
            "learner": lr, "merged": a["n"], "mean_norm": a["norm"] / a["nnorm"] if a["nnorm"] else None,
            "last_norm": a["last_norm"], "mean_cosine": mean_cos, "last_cosine": a["last_cos"],
            "rejected": lr.rejected_contributions,
            "healthy": (mean_cos is None or mean_cos > 0) and lr.rejected_contributions <= a["n"],
        })
    return rows, len(steps)


def _reason(payload) -> str:
    if not isinstance(payload, dict):
        return ""
    parts = []
    if payload.get("reason"):
        parts.append(str(payload["reason"]))
    if isinstance(payload.get("reasons"), list):
        parts += [str(r) for r in payload["reasons"][:5]]
    return "; ".join(parts)[:500]


def _timeline(job: Job, outer_steps: list[dict]) -> list[dict]:
    items = [
        {"time": e.time, "kind": e.kind, "message": e.message, "reason": _reason(e.payload),
         "pool": e.pool.slug if e.pool else ""}
        for e in Event.objects.filter(job=job).select_related("pool").order_by("-time")[:TIMELINE_LIMIT]
    ]
    for o in outer_steps:
        contributors = o["contributors"] or []
        items.append({
            "time": o["created_at"], "kind": "outer-step",
            "message": f"fragment {o['fragment']} → v{o['version']}: merged {len(contributors)} "
                       f"contribution{'s' if len(contributors) != 1 else ''}, norm {o['merged_norm']:.3g}",
            "reason": f"merge took {o['duration_s']:.2f} s; learners "
                      + ", ".join(str(c.get("learner")) for c in contributors if isinstance(c, dict)),
            "pool": "",
        })
    incidents = Incident.objects.filter(job=job).select_related("pool").order_by("-detected_at")[:50]
    for inc in incidents:
        heal = f", healed after {inc.time_to_heal_s:.1f} s" if inc.healed_at else ", not healed yet"
        items.append({
            "time": inc.detected_at, "kind": "incident",
            "message": f"{inc.kind}: {inc.description}".strip(": "),
            "reason": f"detected {inc.time_to_detect_s:.1f} s after last sign of life{heal}",
            "pool": inc.pool.slug if inc.pool else "",
        })
    items.sort(key=lambda i: i["time"], reverse=True)
    return items[:TIMELINE_LIMIT]


@login_required
def job_detail(request, pk):
    job = get_object_or_404(data.visible_jobs(request.user).select_related("owner"), pk=pk)
    learners = list(job.learners.select_related("pool", "node").order_by("index"))
    series = data.downsample([job.pk], data.job_chart_series(job), JOB_CHART_BUCKETS)[job.pk]
    chart_data = {name: [[x, t, v] for x, t, v in pts] for name, pts in series.items()}
    pools_here = sorted({lr.pool for lr in learners if lr.pool is not None}, key=lambda p: p.slug)
    outer_steps = _recent_outer_steps(job)
    health, health_steps = _contribution_health(outer_steps, learners)
    goodput = job.tokens_contributed / job.tokens_computed if job.tokens_computed else None
    actions = st.allowed_actions(job.status)
    return render(request, "dashboard/job.html", {
        "job": job,
        "spec": job.spec,
        "learners": learners,
        "health": health,
        "health_steps": health_steps,
        "timeline": _timeline(job, outer_steps),
        "checkpoints": list(job.checkpoints.order_by("-version")[:50]),
        "syncer_shards": SyncerLease.shards_of(job),
        "chart_data": chart_data,
        "rank_series": data.rank_series(job),
        "demo_chaos": demo_chaos_enabled() and request.user.has_perm("inventory.change_pool"),
        "pools_here": pools_here,
        "goodput": goodput,
        "can_cancel": "cancel" in actions,
        "can_pause": "pause" in actions,
        "can_resume": "resume" in actions,
        "nav": "jobs",
    })


@login_required
def job_series(request, pk):
    """The job's downsampled chart series (the job page refetches it after a reconnect)."""
    job = get_object_or_404(data.visible_jobs(request.user).only("pk", "spec"), pk=pk)
    series = data.downsample([job.pk], data.job_chart_series(job), JOB_CHART_BUCKETS)[job.pk]
    return JsonResponse({name: [[x, t, v] for x, t, v in pts] for name, pts in series.items()})


@login_required
def job_markers_json(request, pk):
    """Incidents, learner moves and checkpoints as chart markers (refetched by the job page)."""
    job = get_object_or_404(data.visible_jobs(request.user).only("pk"), pk=pk)
    return JsonResponse({"markers": job_markers(job)})


@staff_member_required
@require_POST
def demo_kill_worker(request, pk):
    """Demo only (DILOCO_DEMO_CHAOS=1): ask `manage.py demo` to SIGKILL the worker of a pool
    that runs one of this job's learners, so an incident opens, the learner moves and heals."""
    from .demo_chaos import kill_candidates, request_kill

    if not demo_chaos_enabled():
        raise Http404("the chaos button exists only in `manage.py demo`")
    if not request.user.has_perm("inventory.change_pool"):
        raise PermissionDenied("Killing a pool worker needs the inventory.change_pool permission.")
    job = get_object_or_404(Job, pk=pk)
    pools = kill_candidates(job.pk)
    if not pools:
        messages.error(request, f"Job #{job.pk} has no running learner: nothing to kill.")
    else:
        request_kill(pools, job.pk, request.user.username)
        messages.success(request, f"Asked the demo to kill the worker of pool {pools[0]}: watch the "
                                  "charts for the incident marker, the learner move and the heal.")
    return redirect("dashboard:job", pk=job.pk)


@login_required
def compare_jobs(request):
    """Several jobs overlaid, one pinned as baseline (apps.dashboard.compare). Bad or unknown
    ids re-render the page with the reason (200, like the forms here), never an error page."""
    raw = request.GET.getlist("jobs")
    ctx = {"nav": "jobs", "raw_jobs": ",".join(raw)[:200], "error": None, "result": None}
    if any(v.strip() for v in raw):
        try:
            ids = compare.parse_ids(raw)
            baseline = compare.parse_baseline(request.GET.get("baseline"), ids)
            metric = compare.parse_metric(request.GET.get("metric"))
            result = compare.compare(request.user, ids, baseline, metric)
        except compare.CompareError as exc:
            ctx["error"] = exc
        else:
            ctx["result"] = result
            ctx["ids"] = ",".join(str(r["id"]) for r in result["jobs"])
            ctx["chart"] = {"metric": result["metric"], "jobs": [
                {k: r[k] for k in ("id", "name", "baseline", "series")} for r in result["jobs"]]}
    return render(request, "dashboard/compare.html", ctx)


@login_required
def job_checkpoints(request, pk):
    """The checkpoint rows of the job page (refetched when a checkpoint event arrives)."""
    job = get_object_or_404(data.visible_jobs(request.user).only("pk"), pk=pk)
    return render(request, "dashboard/_checkpoint_rows.html",
                  {"job": job, "checkpoints": list(job.checkpoints.order_by("-version")[:50])})


@login_required
@require_POST
def job_action(request, pk, action):
    """Cancel, pause or resume: the same service and rules as the API (st.USER_ACTIONS)."""
    job = get_object_or_404(data.visible_jobs(request.user), pk=pk)
    if action not in st.USER_ACTIONS:
        raise Http404("unknown action")
    try:
        services.act(job, action, reason=f"{action} by {request.user.username} from the dashboard")
    except st.IllegalTransition as exc:
        messages.error(request, f"Job #{job.pk}: {exc}")
    else:
        messages.success(request, f"Job #{job.pk}: {action} requested.")
    return redirect("dashboard:job", pk=job.pk)


@login_required
def checkpoint_download(request, pk, version):
    """Stream a checkpoint from the platform's blob store (same resolution as the API)."""
    job = get_object_or_404(data.visible_jobs(request.user), pk=pk)
    ckpt = get_object_or_404(Checkpoint, job=job, version=version)
    from apps.api.views.checkpoints import _store_and_key

    try:
        store, key = _store_and_key(ckpt.blob_uri)
        blob = store.get(key)
    except (KeyError, FileNotFoundError):
        raise Http404("the checkpoint's blob is missing from the store") from None
    except (OSError, ValueError) as exc:
        log.warning("checkpoint %s unreadable: %s", ckpt.pk, exc)
        return HttpResponse(f"The blob store could not be read ({type(exc).__name__}).", status=503,
                            content_type="text/plain")
    name = f"job{job.pk}-{ckpt.kind}-v{ckpt.version:05d}.safetensors"
    resp = FileResponse(io.BytesIO(blob), as_attachment=True, filename=name,
                        content_type="application/octet-stream")
    resp["X-Checksum-SHA256"] = ckpt.sha256
    return resp


# --------------------------------------------------------------------------- API tokens
@login_required
def tokens(request):
    """Personal API tokens (CLI, CI pipelines): create (the key is shown once) and revoke.

    Issued under the API's rules (apps.api.authentication.issue_token). Bad input re-renders
    the page with the reason, like the other forms here.
    """
    new_key = None
    if request.method == "POST":
        action = request.POST.get("action", "create")
        if action == "revoke":
            form = TokenRevokeForm(request.POST)
            if form.is_valid():
                tok = get_object_or_404(ApiToken, pk=form.cleaned_data["token"], user=request.user)
                tok.revoke()
                messages.success(request, f"Token “{tok.name}” revoked.")
                return redirect("dashboard:tokens")
            messages.error(request, "That is not one of your tokens.")
        elif action == "create" and (wait := throttle_wait(request, TOKEN_CREATE_THROTTLES)) is not None:
            messages.error(request, f"Too many new tokens; try again in {wait} s.")  # the API's counter
        elif action == "create":
            form = TokenCreateForm(request.POST)
            if form.is_valid():
                try:
                    _, new_key = issue_token(request.user, form.cleaned_data["name"],
                                             expires_at=form.expires_at())
                except TokenRefused as exc:
                    messages.error(request, str(exc))
            else:
                messages.error(request, " ".join(m for errs in form.errors.values() for m in errs))
        else:
            messages.error(request, f"Unknown action {action[:40]!r}.")
    rows = list(ApiToken.objects.filter(user=request.user).order_by("-created_at")[:100])
    return render(request, "dashboard/tokens.html", {"tokens": rows, "new_key": new_key, "nav": "tokens"},
                  status=201 if new_key else 200)
