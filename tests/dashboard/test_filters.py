"""Template filters of the dashboard."""
from __future__ import annotations

from types import SimpleNamespace

from apps.dashboard.templatetags.dash import bytes_h, kwh, pct, progress, si, sparkline


def test_number_formats():
    assert si(1234567) == "1.23 M" and si(999) == "999" and si(None) == "—" and si(2500, "W") == "2.5 kW"
    assert bytes_h(3 * 2**20) == "3 MiB" and bytes_h(12) == "12 B"
    assert pct(0.256) == "26 %" and pct(0.256, 1) == "25.6 %"
    assert kwh(7.2e6) == "2 kWh" and kwh(3600) == "1 Wh" and kwh(None) == "—"


def test_progress_from_spec():
    spec = {"learners": 2, "steps": 10, "batch_size": 4, "seq_len": 8}  # 640 tokens
    assert progress(SimpleNamespace(spec=spec, tokens_computed=320)) == 0.5
    assert progress(SimpleNamespace(spec={**spec, "max_tokens": 100}, tokens_computed=320)) == 1.0
    assert progress(SimpleNamespace(spec={"name": "x"}, tokens_computed=5)) == 5 / (4 * 400 * 16 * 64)
    assert progress(SimpleNamespace(spec={"learners": 0}, tokens_computed=5)) is None
    assert progress(SimpleNamespace(spec={**spec, "steps": "bad"}, tokens_computed=5)) is None


def test_sparkline_svg_is_labelled_and_escaped():
    svg = str(sparkline([3.0, 2.5, float("nan"), 2.0], "loss of <b>"))
    assert svg.startswith("<svg") and 'role="img"' in svg and "&lt;b&gt;" in svg and "<b>" not in svg
    assert svg.count(",") == 3  # three finite points, NaN dropped
    assert "no data yet" in str(sparkline([1.0], "x"))
