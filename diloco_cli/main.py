"""The `diloco` command.

Over 500 lines because every subcommand is a thin typer function over client.py, kept in one
file so `diloco --help` and the code read in the same order.

Exit codes (stable, for CI): 0 done / job completed, 1 job failed or cancelled, 2 invalid
spec or input, 3 timeout while waiting, 4 authentication or permission error, 5 server
unreachable or unexpected server error.
"""
from __future__ import annotations

import json
import socket
import sys
import time
from pathlib import Path
from typing import Annotated, Any

import typer
import yaml
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from . import config
from .client import ApiError, AuthError, Client, ConnectError
from .safe import SafeConsole, clean, clean_markup

EXIT_OK, EXIT_FAILED, EXIT_INVALID, EXIT_TIMEOUT, EXIT_AUTH, EXIT_ERROR = 0, 1, 2, 3, 4, 5
TERMINAL = {"completed", "failed", "cancelled"}

app = typer.Typer(no_args_is_help=True, add_completion=False, rich_markup_mode=None,
                  help="Client of the DiLoCo training platform. Server and token: DILOCO_URL and "
                       "DILOCO_TOKEN, or what `diloco login` saved.")
jobs_app = typer.Typer(no_args_is_help=True, help="Submit, follow and control training jobs.")
ckpt_app = typer.Typer(no_args_is_help=True, help="List and download checkpoints.")
app.add_typer(jobs_app, name="jobs")
app.add_typer(ckpt_app, name="checkpoints")

# Every string these print is cleaned of terminal control sequences (diloco_cli/safe.py): event
# messages, names and error details come from the server, written by other people.
out = SafeConsole(highlight=False, soft_wrap=True)
err = SafeConsole(stderr=True, highlight=False)

UrlOpt = Annotated[str | None, typer.Option("--url", help="server URL (else DILOCO_URL / saved login)")]
TokenOpt = Annotated[str | None, typer.Option("--token", help="API token (else DILOCO_TOKEN / saved login)")]
JsonOpt = Annotated[bool, typer.Option("--json", help="print machine-readable JSON only")]


# --- helpers ------------------------------------------------------------------------------------

def _client(url: str | None, token: str | None, need_token: bool = True) -> Client:
    s = config.resolve(url, token)
    if need_token and not s.token:
        err.print("error: no API token: set DILOCO_TOKEN or run `diloco login`")
        raise typer.Exit(EXIT_AUTH)
    return Client(s.url, s.token)


def _print_json(data: Any) -> None:
    sys.stdout.write(json.dumps(data, indent=2, sort_keys=True, default=str) + "\n")
    sys.stdout.flush()


def _fail(exc: Exception, as_json: bool, invalid_code: int = EXIT_INVALID) -> typer.Exit:
    """Report an error (JSON body on stdout with --json, readable text on stderr otherwise)."""
    if isinstance(exc, ConnectError):
        code, body = EXIT_ERROR, {"detail": str(exc), "errors": {}}
    elif isinstance(exc, AuthError):
        code, body = EXIT_AUTH, exc.body
    elif isinstance(exc, ApiError):
        if exc.status in (400, 413, 415):
            code = invalid_code
        elif exc.status in (404, 409, 429):
            code = EXIT_FAILED
        else:
            code = EXIT_ERROR
        body = exc.body
    else:
        code, body = EXIT_ERROR, {"detail": str(exc), "errors": {}}
    if as_json:
        _print_json({**body, "exit_code": code})
    else:
        err.print(f"error: {body.get('detail')}", markup=False)
        for field, msgs in (body.get("errors") or {}).items():
            if field != "detail":
                for msg in msgs:
                    err.print(f"  {field}: {msg}", markup=False)
    return typer.Exit(code)


def _read_spec(path: Path, overrides: list[str]) -> dict:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read {path}: {exc}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ValueError(f"{path} is not valid YAML: {exc}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: the spec must be a mapping of fields (see examples/job.yaml)")
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--set {item!r}: expected FIELD=VALUE")
        try:
            data[key.strip()] = yaml.safe_load(raw)
        except yaml.YAMLError:
            data[key.strip()] = raw
    return data


def _fmt_tokens(n: float) -> str:
    for unit, size in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.1f}{unit}"
    return f"{int(n)}"


def _job_table(job: dict) -> Table:
    t = Table(show_header=False, box=None, pad_edge=False)
    t.add_column(style="bold")
    t.add_column()
    latest = job.get("latest") or {}
    rows = [
        ("job", f"#{job['id']} {job['name']}"), ("status", job["status"] + (
            f" ({job['status_reason']})" if job.get("status_reason") else "")),
        ("owner", job.get("owner", "")), ("progress", f"{job.get('progress', 0) * 100:.1f}% "
                                                      f"({_fmt_tokens(_done(job))} / "
                                                      f"{_fmt_tokens(job.get('total_tokens', 0))} tokens)"),
        ("outer steps", str(job.get("outer_steps", 0))),
        ("train loss", f"{latest['train_loss']:.4f}" if "train_loss" in latest else "-"),
        ("val loss", f"{job['final_val_loss']:.4f}" if job.get("final_val_loss") is not None else (
            f"{latest['val_loss']:.4f}" if "val_loss" in latest else "-")),
        ("created", str(job.get("created_at"))), ("finished", str(job.get("finished_at") or "-")),
    ]
    for k, v in rows:
        t.add_row(k, v)
    return t


def _done(job: dict) -> int:
    """Tokens computed so far (live learner counters while running; older servers: the job total)."""
    return int(job.get("tokens_done", job.get("tokens_computed", 0)) or 0)


def _exit_for_status(status: str) -> int:
    return EXIT_OK if status == "completed" else EXIT_FAILED


def _wait(client: Client, job_id: int, timeout: float | None, poll: float, as_json: bool) -> tuple[dict, int]:
    """Poll until the job ends (exit 0/1) or the timeout passes (exit 3), with a progress bar."""
    deadline = time.monotonic() + timeout if timeout else None
    job = client.job(job_id)
    progress = None
    if not as_json:
        progress = Progress(TextColumn("[bold]#{task.fields[id]}[/] {task.fields[status]:<9}"), BarColumn(),
                            TextColumn("{task.fields[tok]}"), TextColumn("loss {task.fields[loss]}"),
                            TimeElapsedColumn(), console=err, transient=False)
        progress.start()
        task = progress.add_task("job", total=max(1, job.get("total_tokens") or 1), id=job_id,
                                 status=clean_markup(job["status"]), tok="", loss="-")
    try:
        while True:
            if progress is not None:
                loss = (job.get("latest") or {}).get("train_loss")
                progress.update(task, completed=min(_done(job), job.get("total_tokens") or 0),
                                status=clean_markup(job["status"]),
                                loss=f"{loss:.3f}" if loss is not None else "-",
                                tok=f"{_fmt_tokens(_done(job))}/"
                                    f"{_fmt_tokens(job.get('total_tokens') or 0)} tok")
            if job["status"] in TERMINAL:
                return job, _exit_for_status(job["status"])
            if deadline is not None and time.monotonic() >= deadline:
                return job, EXIT_TIMEOUT
            sleep = poll if deadline is None else max(0.05, min(poll, deadline - time.monotonic()))
            time.sleep(sleep)
            job = client.job(job_id)
    finally:
        if progress is not None:
            progress.stop()


def _finish_wait(job: dict, code: int, timeout: float | None, as_json: bool) -> None:
    if as_json:
        _print_json({**job, "exit_code": code, "timed_out": code == EXIT_TIMEOUT})
    else:
        out.print(_job_table(job))
        if code == EXIT_TIMEOUT:
            err.print(f"timeout: job #{job['id']} is still {job['status']} after {timeout:g} s "
                      "(it keeps running; cancel it with `diloco jobs cancel`)")
    raise typer.Exit(code)


# --- commands -----------------------------------------------------------------------------------

@app.command()
def login(
    url: UrlOpt = None,
    username: Annotated[str | None, typer.Option("--username", "-u")] = None,
    password: Annotated[str | None, typer.Option("--password", "-p", help="else prompted (hidden)")] = None,
    token: Annotated[str | None, typer.Option("--token", help="save an existing token instead")] = None,
    name: Annotated[str | None, typer.Option("--name", help="name of the new token")] = None,
    as_json: JsonOpt = False,
):
    """Sign in with username and password, create an API token and save it (or save --token)."""
    server = config.resolve(url).url
    try:
        if token is None:
            username = username or typer.prompt("Username")
            password = password if password is not None else typer.prompt("Password", hide_input=True)
            with Client(server, None) as c:
                created = c.obtain_token(username, password, name or f"cli@{socket.gethostname()}"[:60])
            token = created["token"]
        with Client(server, token) as c:
            me = c.me()
    except (ApiError, ConnectError) as exc:
        raise _fail(exc, as_json) from None
    path = config.save(server, token)
    if as_json:
        _print_json({"url": server, "username": me["username"], "config": str(path)})
    else:
        out.print(f"signed in to {server} as {me['username']}; token saved in {path}")


@app.command()
def whoami(url: UrlOpt = None, token: TokenOpt = None, as_json: JsonOpt = False):
    """Show who the current credentials belong to."""
    try:
        with _client(url, token) as c:
            me = c.me()
    except (ApiError, ConnectError) as exc:
        raise _fail(exc, as_json) from None
    if as_json:
        _print_json(me)
    else:
        teams = f", teams: {', '.join(me['teams'])}" if me.get("teams") else ""
        out.print(f"{me['username']}{' (staff)' if me['is_staff'] else ''} at {c.url}{teams}")


@app.command()
def fleet(url: UrlOpt = None, token: TokenOpt = None, as_json: JsonOpt = False):
    """Pools of the fleet: accelerators, devices, state, nodes online, running learners."""
    try:
        with _client(url, token) as c:
            pools = c.pools()
    except (ApiError, ConnectError) as exc:
        raise _fail(exc, as_json) from None
    if as_json:
        _print_json({"pools": pools})
        return
    t = Table(title="Fleet")
    for col in ("pool", "region", "accelerator", "devices", "state", "nodes", "learners", "TFLOP/s", "W",
                "$/h"):
        t.add_column(col, justify="right" if col in ("devices", "nodes", "learners", "TFLOP/s", "W", "$/h")
                     else "left")
    for p in pools:
        t.add_row(p["slug"], p["region"], p["accelerator"], str(p["device_count"]), p["state"],
                  str(p["nodes_online"]), str(p["learners_running"]), f"{p['total_peak_tflops']:.0f}",
                  str(p["total_watts"]), f"{p['cost_per_hour']:.2f}")
    out.print(t)


@jobs_app.command("submit")
def jobs_submit(
    spec_file: Annotated[Path, typer.Argument(help="job spec (YAML or JSON), e.g. examples/job.yaml")],
    dry_run: Annotated[bool, typer.Option("--dry-run", help="validate and preview placement only")] = False,
    wait: Annotated[bool, typer.Option("--wait", help="follow the job until it ends")] = False,
    timeout: Annotated[float | None, typer.Option("--timeout", min=0.1, help="seconds to --wait")] = None,
    poll: Annotated[float, typer.Option("--poll", min=0.1, help="seconds between status polls")] = 1.0,
    team: Annotated[str, typer.Option("--team", help="your team: its members see the job too")] = "",
    overrides: Annotated[list[str] | None, typer.Option("--set", help="FIELD=VALUE over the file")] = None,
    devices_per_learner: Annotated[int | None, typer.Option(
        "--devices-per-learner", help="devices of one learner, all on one node (an island)")] = None,
    idempotency_key: Annotated[str | None, typer.Option(
        "--idempotency-key", envvar="DILOCO_IDEMPOTENCY_KEY",
        help="a retried submission with the same key returns the same job (e.g. the CI build id)")] = None,
    url: UrlOpt = None, token: TokenOpt = None, as_json: JsonOpt = False,
):
    """Submit a job spec. --wait: exit 0 when it completes, 1 failed/cancelled, 3 on --timeout."""
    if timeout is not None and not wait and not dry_run:
        err.print("error: --timeout only applies with --wait")
        raise typer.Exit(EXIT_INVALID)
    try:
        spec = _read_spec(spec_file, overrides or [])
        if devices_per_learner is not None:
            spec["devices_per_learner"] = devices_per_learner  # the server validates it (400 per field)
    except ValueError as exc:
        if as_json:
            _print_json({"detail": str(exc), "errors": {"spec": [str(exc)]}, "exit_code": EXIT_INVALID})
        else:
            err.print(f"error: {exc}", markup=False)
        raise typer.Exit(EXIT_INVALID) from None
    try:
        with _client(url, token) as c:
            if dry_run:
                result = c.dry_run(spec, team)
                _show_dry_run(result, as_json)
                return
            job = c.submit(spec, team, idempotency_key)
            if not wait:
                if as_json:
                    _print_json(job)
                else:
                    out.print(f"submitted job #{job['id']} ({job['name']}): {job['status']}")
                return
            if not as_json:
                err.print(f"submitted job #{job['id']} ({job['name']}); waiting"
                          + (f" up to {timeout:g} s" if timeout else ""))
            job, code = _wait(c, job["id"], timeout, poll, as_json)
    except (ApiError, ConnectError) as exc:
        raise _fail(exc, as_json) from None
    _finish_wait(job, code, timeout, as_json)


def _show_dry_run(result: dict, as_json: bool) -> None:
    if as_json:
        _print_json(result)
        return
    plan = result["placement"]
    spec = result["spec"]
    devices = int(spec.get("devices_per_learner") or 1)
    nodes = int(spec.get("nodes_per_learner") or 1)
    shape = f" x {devices} devices" + (f" over {nodes} nodes" if nodes > 1 else "") if devices > 1 else ""
    out.print(f"spec valid: {spec['name']} ({spec['strategy']}, model {spec['model']}, {spec['learners']} "
              f"learners{shape}, "
              f"{_fmt_tokens(result['total_tokens'])} tokens)")
    if plan.get("learners"):
        t = Table(title=f"Placement (objective: {plan.get('objective')})")
        spread = any(row.get("nodes") for row in plan["learners"])  # islands over several nodes
        for col in ("learner", "pool", "H", "wire", *(("nodes",) if spread else ())):
            t.add_column(col)
        for row in plan["learners"]:
            t.add_row(str(row["index"]), row["pool"], str(row["work_size"]), row["wire_dtype"],
                      *((", ".join(row.get("nodes") or []),) if spread else ()))
        out.print(t)
    est = plan.get("estimate")
    if est:
        out.print(f"estimate: {est['time_s']:.1f} s, {est['energy_j'] / 3.6e6:.4f} kWh, ${est['cost']:.4f}")
    for reason in plan.get("reasons", []):
        out.print(f"  - {reason}", markup=False)
    for problem in plan.get("problems", []):
        err.print(f"problem: {problem}", markup=False)


@jobs_app.command("list")
def jobs_list(
    status: Annotated[str | None, typer.Option("--status", help="e.g. running or queued,placing")] = None,
    search: Annotated[str | None, typer.Option("--search")] = None,
    limit: Annotated[int, typer.Option("--limit", min=1, max=500)] = 20,
    url: UrlOpt = None, token: TokenOpt = None, as_json: JsonOpt = False,
):
    """Your jobs (staff: everyone's), newest first."""
    try:
        with _client(url, token) as c:
            page = c.jobs(status, search, limit)
    except (ApiError, ConnectError) as exc:
        raise _fail(exc, as_json) from None
    if as_json:
        _print_json(page)
        return
    t = Table(title=f"Jobs ({page['count']})")
    for col in ("id", "name", "owner", "status", "progress", "outer steps", "final val loss", "created"):
        t.add_column(col)
    for j in page["results"]:
        t.add_row(str(j["id"]), j["name"], j["owner"], j["status"], f"{j['progress'] * 100:.0f}%",
                  str(j["outer_steps"]),
                  f"{j['final_val_loss']:.4f}" if j["final_val_loss"] is not None else "-",
                  str(j["created_at"])[:19])
    out.print(t)


@jobs_app.command("status")
def jobs_status(job_id: int, url: UrlOpt = None, token: TokenOpt = None, as_json: JsonOpt = False):
    """Status, progress and latest losses of a job."""
    try:
        with _client(url, token) as c:
            job = c.job(job_id)
    except (ApiError, ConnectError) as exc:
        raise _fail(exc, as_json) from None
    if as_json:
        _print_json(job)
    else:
        out.print(_job_table(job))


@jobs_app.command("wait")
def jobs_wait(
    job_id: int,
    timeout: Annotated[float | None, typer.Option("--timeout", min=0.1)] = None,
    poll: Annotated[float, typer.Option("--poll", min=0.1)] = 1.0,
    url: UrlOpt = None, token: TokenOpt = None, as_json: JsonOpt = False,
):
    """Wait for a job to end: exit 0 completed, 1 failed/cancelled, 3 timeout."""
    try:
        with _client(url, token) as c:
            job, code = _wait(c, job_id, timeout, poll, as_json)
    except (ApiError, ConnectError) as exc:
        raise _fail(exc, as_json) from None
    _finish_wait(job, code, timeout, as_json)


@jobs_app.command("logs")
def jobs_logs(
    job_id: int,
    follow: Annotated[bool, typer.Option("--follow", "-f", help="keep printing until the job ends")] = False,
    poll: Annotated[float, typer.Option("--poll", min=0.1)] = 1.0,
    url: UrlOpt = None, token: TokenOpt = None, as_json: JsonOpt = False,
):
    """Events of a job (status changes, placements, merges, failures...), oldest first."""
    try:
        with _client(url, token) as c:
            after, ended = 0, False
            while True:
                page = c.events(job_id, after=after, limit=500)
                for ev in page["results"]:
                    after = max(after, ev["id"])
                    if as_json:
                        sys.stdout.write(json.dumps(ev, sort_keys=True) + "\n")
                    else:
                        pool = f" [{ev['pool']}]" if ev.get("pool") else ""
                        # one event, one line: a newline in a message cannot forge the next event
                        message = clean(ev["message"]).replace("\n", "\\n")
                        out.print(f"{str(ev['time'])[:23]} {ev['kind']:<12}{pool} {message}",
                                  markup=False)
                sys.stdout.flush()
                if page.get("next"):
                    continue
                if not follow or ended:
                    break
                if c.job(job_id)["status"] in TERMINAL:
                    ended = True  # one more round: events written as the job ended
                    continue
                time.sleep(poll)
    except (ApiError, ConnectError) as exc:
        raise _fail(exc, as_json) from None


@jobs_app.command("metrics")
def jobs_metrics(
    job_id: int,
    names: Annotated[list[str] | None, typer.Option("--name", help="metric name(s), e.g. train_loss")] = None,
    points: Annotated[int, typer.Option("--points", min=1, max=5000)] = 50,
    learner: Annotated[str, typer.Option("--learner", help="'job', 'all' or a learner index")] = "job",
    url: UrlOpt = None, token: TokenOpt = None, as_json: JsonOpt = False,
):
    """Metric series of a job (downsampled by the server to --points per series)."""
    try:
        with _client(url, token) as c:
            data = c.metrics(job_id, names, points, learner)
    except (ApiError, ConnectError) as exc:
        raise _fail(exc, as_json) from None
    if as_json:
        _print_json(data)
        return
    t = Table(title=f"Metrics of job #{job_id}")
    for col in ("metric", "learner", "points", "first", "min", "last", "at step"):
        t.add_column(col)
    for s in data["series"]:
        pts = s["points"]
        if not pts:
            continue
        vals = [p[1] for p in pts]
        t.add_row(s["name"], "job" if s["learner"] is None else str(s["learner"]), str(len(pts)),
                  f"{vals[0]:.4g}", f"{min(vals):.4g}", f"{vals[-1]:.4g}", _fmt_tokens(pts[-1][0]))
    out.print(t)


@jobs_app.command("compare")
def jobs_compare(
    job_ids: Annotated[list[int], typer.Argument(help="two or more job ids; the first is the baseline")],
    baseline: Annotated[int | None, typer.Option("--baseline", help="pin this job as the baseline")] = None,
    metric: Annotated[str | None, typer.Option("--metric", help="val_loss or train_loss (default: val_loss "
                                                                  "when every job has it)")] = None,
    url: UrlOpt = None, token: TokenOpt = None, as_json: JsonOpt = False,
):
    """Final loss, tokens, wall time and the gap to a baseline at equal tokens, for several jobs."""
    try:
        with _client(url, token) as c:
            data = c.compare(job_ids, baseline, metric)
    except (ApiError, ConnectError) as exc:
        raise _fail(exc, as_json) from None
    if as_json:
        _print_json(data)
        return
    base = next(j for j in data["jobs"] if j["baseline"])
    t = Table(title=f"{data['metric']} against baseline #{base['id']} {base['name']} (at equal tokens)")
    t.add_column("job", overflow="fold")
    for col in ("final loss", "tokens", "wall time", "at tokens", "loss there", "gap"):
        t.add_column(col, justify="right", no_wrap=True)
    for j in data["jobs"]:
        gap = "baseline" if j["baseline"] else ("-" if j["gap_pct"] is None else f"{j['gap_pct']:+.2f}%")
        t.add_row(f"#{j['id']} {j['name']} ({j['status']})", _num(j["final_loss"]), _fmt_tokens(j["tokens"]),
                  "-" if j["wall_time_s"] is None else f"{j['wall_time_s']:.0f} s",
                  "-" if j["common_tokens"] is None else _fmt_tokens(j["common_tokens"]),
                  _num(j["loss_at_common_tokens"]), gap)
    out.print(t)
    if data["missing"]:
        missing = ", ".join(map(str, data["missing"]))
        err.print(f"not shown: job(s) {missing} (no such job, or not yours to see)")


def _num(v: float | None) -> str:
    return "-" if v is None else f"{v:.4f}"


def _job_action(job_id: int, name: str, url, token, as_json: bool) -> None:
    try:
        with _client(url, token) as c:
            job = c.action(job_id, name)
    except (ApiError, ConnectError) as exc:
        raise _fail(exc, as_json) from None
    if as_json:
        _print_json(job)
    else:
        out.print(f"job #{job['id']}: {job['status']}")


@jobs_app.command("cancel")
def jobs_cancel(job_id: int, url: UrlOpt = None, token: TokenOpt = None, as_json: JsonOpt = False):
    """Cancel a job."""
    _job_action(job_id, "cancel", url, token, as_json)


@jobs_app.command("pause")
def jobs_pause(job_id: int, url: UrlOpt = None, token: TokenOpt = None, as_json: JsonOpt = False):
    """Pause a running job."""
    _job_action(job_id, "pause", url, token, as_json)


@jobs_app.command("resume")
def jobs_resume(job_id: int, url: UrlOpt = None, token: TokenOpt = None, as_json: JsonOpt = False):
    """Resume a paused job."""
    _job_action(job_id, "resume", url, token, as_json)


@ckpt_app.command("list")
def checkpoints_list(job_id: int, url: UrlOpt = None, token: TokenOpt = None, as_json: JsonOpt = False):
    """Checkpoints of a job, newest first."""
    try:
        with _client(url, token) as c:
            rows = c.checkpoints(job_id)
    except (ApiError, ConnectError) as exc:
        raise _fail(exc, as_json) from None
    if as_json:
        _print_json(rows)
        return
    t = Table(title=f"Checkpoints of job #{job_id}")
    for col in ("id", "version", "kind", "size", "sha256", "created"):
        t.add_column(col)
    for r in rows:
        t.add_row(str(r["id"]), str(r["version"]), r["kind"], _fmt_tokens(r["size_bytes"]) + "B",
                  r["sha256"][:12], str(r["created_at"])[:19])
    out.print(t)


@ckpt_app.command("download")
def checkpoints_download(
    ckpt_id: Annotated[int, typer.Argument(help="checkpoint id (see `diloco checkpoints list JOB`)")],
    output: Annotated[Path | None, typer.Option("--output", "-o", help="file or directory")] = None,
    url: UrlOpt = None, token: TokenOpt = None, as_json: JsonOpt = False,
):
    """Download a checkpoint (safetensors), verifying its SHA-256."""
    try:
        with _client(url, token) as c:
            meta = c.checkpoint(ckpt_id)
            name = f"job{meta['job']}-{meta['kind']}-v{meta['version']:05d}.safetensors"
            dest = output or Path(name)
            if dest.is_dir():
                dest = dest / name
            path, sha, size = c.download_checkpoint(ckpt_id, dest)
    except (ApiError, ConnectError) as exc:
        raise _fail(exc, as_json, invalid_code=EXIT_FAILED) from None
    except OSError as exc:
        raise _fail(ConnectError(f"cannot write {output}: {exc}"), as_json) from None
    if as_json:
        _print_json({"path": str(path), "sha256": sha, "size_bytes": size, "checkpoint": meta})
    else:
        out.print(f"saved {path} ({size} bytes, sha256 {sha[:16]}…)")


def main() -> None:  # pragma: no cover - `python -m diloco_cli`
    app()
