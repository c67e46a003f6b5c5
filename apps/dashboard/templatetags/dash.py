"""Formatting helpers for the dashboard templates (numbers, bytes, sparklines)."""
from __future__ import annotations

import math

from django import template
from django.utils.html import format_html

from trainer.spec import stored_spec

register = template.Library()


def _finite(values) -> list[float]:
    out = []
    for v in values or []:
        try:
            f = float(v)
        except (TypeError, ValueError):
            continue
        if math.isfinite(f):
            out.append(f)
    return out


@register.filter
def si(value, unit: str = "") -> str:
    """1234567 -> '1.23 M' (plus unit)."""
    if value is None or value == "":
        return "—"
    try:
        v = float(value)
    except (TypeError, ValueError):
        return str(value)
    for factor, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(v) >= factor:
            return f"{v / factor:.3g} {prefix}{unit}".strip()
    text = f"{v:.3g}" if v != int(v) else f"{int(v)}"
    return f"{text} {unit}".strip()


@register.filter
def bytes_h(value) -> str:
    if value is None:
        return "—"
    v = float(value)
    for factor, unit in ((2**40, "TiB"), (2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if abs(v) >= factor:
            return f"{v / factor:.3g} {unit}"
    return f"{int(v)} B"


@register.filter
def pct(value, digits: int = 0) -> str:
    if value is None:
        return "—"
    return f"{float(value) * 100:.{int(digits)}f} %"


@register.filter
def num(value, digits: int = 3) -> str:
    if value is None:
        return "—"
    return f"{float(value):.{int(digits)}g}"


@register.simple_tag
def sparkline(values, label: str, width: int = 120, height: int = 28):
    """An inline SVG polyline of the values (server-side, no JS), with an accessible name."""
    pts = _finite(values)
    if len(pts) < 2:
        return format_html('<span class="muted spark-empty" role="img" aria-label="{}: no data yet">—</span>',
                           label)
    lo, hi = min(pts), max(pts)
    span = (hi - lo) or 1.0
    step = (width - 2) / (len(pts) - 1)
    coords = " ".join(f"{1 + i * step:.1f},{1 + (height - 2) * (1 - (v - lo) / span):.1f}"
                      for i, v in enumerate(pts))
    return format_html(
        '<svg class="spark" width="{}" height="{}" viewBox="0 0 {} {}" role="img" aria-label="{}">'
        "<title>{}</title><polyline fill=\"none\" stroke=\"currentColor\" stroke-width=\"1.5\" "
        'points="{}"/></svg>',
        width, height, width, height, f"{label}: {pts[0]:.4g} → {pts[-1]:.4g}",
        f"{label}: {pts[0]:.4g} → {pts[-1]:.4g}", coords,
    )


STATUS_TONE = {"running": "ok", "completed": "ok", "placing": "info", "queued": "info",
               "pausing": "warn", "paused": "warn", "failed": "bad", "cancelled": "muted",
               "active": "ok", "draining": "warn", "disabled": "muted", "online": "ok",
               "offline": "muted", "lost": "bad", "starting": "info", "pending": "info",
               "stopped": "muted", "done": "ok", "removed": "muted"}


@register.filter
def tone(status: str) -> str:
    return STATUS_TONE.get(str(status), "info")


@register.filter
def kwh(joules) -> str:
    """Joules as kWh (or Wh below 1 kWh)."""
    if joules is None:
        return "—"
    j = float(joules)
    return f"{j / 3.6e6:.3g} kWh" if j >= 3.6e6 else f"{j / 3.6e3:.3g} Wh"


@register.filter
def budget(job) -> int | None:
    """The job's token budget (JobSpec.total_tokens), or None when its spec no longer validates."""
    spec = stored_spec(job.spec)
    return spec.total_tokens if spec else None


@register.filter
def progress(job) -> float | None:
    """Fraction of the job's token budget computed so far, or None."""
    total = budget(job)
    return None if total is None else min(1.0, job.tokens_computed / total)
