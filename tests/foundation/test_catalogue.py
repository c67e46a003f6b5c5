"""The accelerator catalogue seeded by migration, and the derived pool figures."""

from __future__ import annotations

import importlib
from decimal import Decimal

import pytest

from apps.inventory.models import AcceleratorType, Pool

REQUIRED = {"h200", "h100-sxm", "a100-80gb", "v100", "l4", "tpu-v5p", "tpu-v5e", "tpu-v4", "tpu-v6e", "cpu"}


@pytest.mark.django_db
def test_catalogue_is_seeded_with_public_figures(catalogue):
    from django.db import connection
    from django.db.migrations.recorder import MigrationRecorder

    applied = MigrationRecorder(connection).applied_migrations()
    assert ("inventory", "0003_catalogue") in applied
    rows = catalogue
    assert set(rows) >= REQUIRED
    assert rows["h100-sxm"].peak_bf16_tflops == 989.0 and rows["h100-sxm"].tdp_watts == 700
    assert rows["a100-80gb"].peak_bf16_tflops == 312.0 and rows["a100-80gb"].memory_gib == 80
    assert rows["tpu-v5p"].peak_bf16_tflops == 459.0
    assert rows["tpu-v4"].peak_bf16_tflops == 275.0
    assert rows["l4"].tdp_watts == 72
    for a in rows.values():
        assert a.peak_bf16_tflops > 0 and a.tdp_watts > 0 and a.memory_gib > 0 and a.source
        assert 2015 <= a.year <= 2026
    # The newer generations are faster than the old: what the demo fleet stands for.
    assert rows["h200"].peak_bf16_tflops > rows["a100-80gb"].peak_bf16_tflops > rows["v100"].peak_bf16_tflops


@pytest.mark.django_db
def test_seed_is_idempotent(catalogue):
    mig = importlib.import_module("apps.inventory.migrations.0003_catalogue")
    from django.apps import apps

    before = AcceleratorType.objects.count()
    mig.seed(apps, None)
    assert AcceleratorType.objects.count() == before


def test_catalogue_matches_the_simulator():
    """trainer/catalogue.py (the simulator's copy) carries the same figures, field by field."""
    from trainer import catalogue as sim

    mig = importlib.import_module("apps.inventory.migrations.0003_catalogue")
    ours = {row[0]: dict(zip(mig.FIELDS, row, strict=True)) for row in mig.CATALOGUE}
    assert set(ours) == set(sim.BY_SLUG)
    for slug, row in ours.items():
        acc = sim.get(slug)
        for field in (
            "vendor",
            "model",
            "kind",
            "generation",
            "year",
            "memory_gib",
            "peak_bf16_tflops",
            "tdp_watts",
        ):
            assert getattr(acc, field) == row[field], (slug, field)


@pytest.mark.django_db
def test_derived_figures(fleet):
    p = fleet["h100"]
    assert p.total_peak_tflops == pytest.approx(8 * 989.0)
    assert p.total_watts == 8 * 700
    assert p.cost_per_hour == pytest.approx(36.0)
    assert p.queue == "pool.iad-h100"
    p.device_count = 0
    assert p.total_peak_tflops == 0 and p.total_watts == 0


@pytest.mark.django_db
def test_cost_is_decimal_exact(catalogue):
    cpu = AcceleratorType.objects.get(slug="cpu")
    p = Pool.objects.create(
        slug="c",
        name="c",
        region="r",
        accelerator=cpu,
        device_count=3,
        cost_per_device_hour=Decimal("0.1"),
        link_gbps=1,
    )
    p.refresh_from_db()
    assert p.cost_per_device_hour == Decimal("0.1000")
    assert p.cost_per_hour == pytest.approx(0.3)
