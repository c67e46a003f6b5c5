"""import_inventory / export_inventory: round trip, and every bad file refused whole."""

from __future__ import annotations

import io
import textwrap
from decimal import Decimal
from pathlib import Path

import pytest
from django.conf import settings
from django.core.management import CommandError, call_command

from apps.inventory.inventory_file import InventoryFileError, load
from apps.inventory.models import AcceleratorType, Pool

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("catalogue")]

GOOD = textwrap.dedent("""\
    version: 1
    accelerators:
      - slug: mi300x
        vendor: AMD
        model: MI300X
        kind: gpu
        generation: CDNA3
        year: 2023
        memory_gib: 192
        peak_bf16_tflops: 1307.4
        tdp_watts: 750
    pools:
      - slug: iad-h100
        name: IAD H100 rack
        region: us-east-1
        provider: aws
        accelerator: h100-sxm
        device_count: 8
        cost_per_device_hour: 4.5
        link_gbps: 5
        latency_ms: 20
      - slug: ams-mi300
        region: eu-west
        accelerator: mi300x
        device_count: 4
        link_gbps: 2.5
        state: draining
        notes: "second rack, ask Jo before draining"
""")


def run_import(tmp_path, text: str | bytes, *extra) -> str:
    p = tmp_path / "inv.yaml"
    p.write_bytes(text if isinstance(text, bytes) else text.encode())
    out = io.StringIO()
    call_command("import_inventory", str(p), *extra, stdout=out)
    return out.getvalue()


def snapshot():
    return (
        list(Pool.objects.order_by("slug").values()),
        list(AcceleratorType.objects.order_by("slug").values()),
    )


def test_import_creates_and_updates(tmp_path):
    out = run_import(tmp_path, GOOD)
    assert "accelerators: 1 created" in out and "pools: 2 created" in out
    p = Pool.objects.get(slug="iad-h100")
    assert p.provider == "aws" and p.device_count == 8 and p.cost_per_device_hour == Decimal("4.5")
    assert p.accelerator.slug == "h100-sxm" and p.latency_ms == 20
    q = Pool.objects.get(slug="ams-mi300")
    assert q.name == "ams-mi300" and q.provider == "onprem" and q.state == "draining"
    assert q.speed_factor == 1.0 and q.accelerator.peak_bf16_tflops == 1307.4
    assert q.total_peak_tflops == pytest.approx(4 * 1307.4)
    out = run_import(tmp_path, GOOD.replace("device_count: 8", "device_count: 16"))
    assert "pools: 0 created, 2 updated" in out
    assert Pool.objects.get(slug="iad-h100").device_count == 16
    assert Pool.objects.count() == 2


def test_only_new_leaves_existing_pools_alone(tmp_path):
    run_import(tmp_path, GOOD)
    Pool.objects.filter(slug="iad-h100").update(state="draining")
    out = run_import(tmp_path, GOOD.replace("device_count: 8", "device_count: 16"), "--only-new")
    assert "pools: 0 created, 0 updated" in out
    p = Pool.objects.get(slug="iad-h100")
    assert p.state == "draining" and p.device_count == 8


def test_demo_fleet_file_is_valid(tmp_path):
    out = run_import(tmp_path, (Path(settings.BASE_DIR) / "apps/inventory/demo_fleet.yaml").read_text())
    assert "pools: 3 created" in out
    speeds = dict(Pool.objects.values_list("slug", "speed_factor"))
    assert speeds == {"cpu-new": 1.0, "cpu-mid": 0.6, "cpu-old": 0.35}


def test_round_trip(tmp_path):
    run_import(tmp_path, GOOD)
    before = snapshot()
    out = tmp_path / "out.yaml"
    call_command("export_inventory", "-o", str(out))
    exported = out.read_text()
    assert "iad-h100" in exported and "mi300x" in exported
    Pool.objects.all().delete()
    AcceleratorType.objects.filter(slug="mi300x").delete()
    run_import(tmp_path, exported)
    after = snapshot()

    def strip(rows):
        return [
            {k: v for k, v in r.items() if k not in ("id", "created_at", "updated_at", "accelerator_id")}
            for r in rows
        ]

    assert strip(after[0]) == strip(before[0])
    assert strip(after[1]) == strip(before[1])
    # and exporting again gives the same text
    again = tmp_path / "again.yaml"
    call_command("export_inventory", "-o", str(again))
    assert again.read_text() == exported


def test_export_to_stdout_all_accelerators():
    out = io.StringIO()
    call_command("export_inventory", "--all-accelerators", stdout=out)
    doc = out.getvalue()
    assert "tpu-v5p" in doc and "pools: []" in doc
    load(doc)  # valid input for import


def test_dry_run_changes_nothing(tmp_path):
    out = run_import(tmp_path, GOOD, "--dry-run")
    assert "valid (1 accelerators, 2 pools)" in out
    assert Pool.objects.count() == 0 and not AcceleratorType.objects.filter(slug="mi300x").exists()


def pool_file(**overrides) -> str:
    fields = {"slug": "p1", "region": "r", "accelerator": "cpu", "device_count": 2, "link_gbps": 1}
    fields.update(overrides)
    body = "\n".join(f"    {k}: {v}" for k, v in fields.items() if v is not ...)
    return (
        f"version: 1\npools:\n  - slug: ok-pool\n    region: r\n    accelerator: cpu\n"
        f"    device_count: 1\n    link_gbps: 1\n  -\n{body}\n"
    )


BAD = [
    # (id, text, expected fragments of the message)
    ("not-yaml", "version: 1\npools: [\n  {slug: x", ["line 3", "not valid YAML"]),
    ("tabs", "version: 1\npools:\n\t- slug: x\n", ["line 3", "not valid YAML"]),
    ("empty", "", ["empty"]),
    ("comment-only", "# nothing\n", ["empty"]),
    ("top-level-list", "- slug: a\n- slug: b\n", ["top level", "must be a mapping", "list"]),
    ("top-level-scalar", "hello\n", ["top level", "str"]),
    ("unknown-top-key", "version: 1\npools: []\nnodes: []\n", ["line 3", "nodes", "unknown top-level key"]),
    ("no-version", "pools: []\n", ["version", "required"]),
    ("bad-version", "version: 2\npools: []\n", ["line 1", "unsupported version 2"]),
    ("version-bool", "version: true\npools: []\n", ["unsupported version True"]),
    ("no-pools", "version: 1\n", ["pools", "required"]),
    ("pools-not-list", "version: 1\npools: {a: 1}\n", ["line 2", "pools: must be a list", "dict"]),
    (
        "pool-not-mapping",
        "version: 1\npools:\n  - just-a-string\n",
        ["line 3", "pools[0]", "must be a mapping"],
    ),
    ("unknown-field", pool_file(gpus=4), ["line 14", "pools[1].gpus", "unknown field"]),
    ("missing-region", pool_file(region=...), ["line 9", "pools[1].region", "required field is missing"]),
    ("missing-slug", pool_file(slug=...), ["pools[1].slug", "required field is missing"]),
    ("null-count", pool_file(device_count=""), ["pools[1].device_count", "required field is missing"]),
    (
        "count-string",
        pool_file(device_count="eight"),
        ["line 12", "pools[1].device_count", "must be an integer", "str"],
    ),
    ("count-float", pool_file(device_count=2.5), ["pools[1].device_count", "must be an integer"]),
    ("count-bool", pool_file(device_count="true"), ["pools[1].device_count", "must be an integer", "bool"]),
    ("count-negative", pool_file(device_count=-3), ["line 12", "pools[1].device_count", "at least 0", "-3"]),
    ("count-huge", pool_file(device_count=10**30), ["pools[1].device_count", "at most"]),
    ("cost-negative", pool_file(cost_per_device_hour=-1), ["pools[1].cost_per_device_hour", "at least 0"]),
    ("cost-huge", pool_file(cost_per_device_hour="1.0e+300"), ["pools[1].cost_per_device_hour", "at most"]),
    ("link-zero", pool_file(link_gbps=0), ["pools[1].link_gbps", "greater than 0"]),
    ("link-nan", pool_file(link_gbps=".nan"), ["pools[1].link_gbps", "finite"]),
    ("link-inf", pool_file(link_gbps=".inf"), ["pools[1].link_gbps", "finite"]),
    ("link-list", pool_file(link_gbps="[1, 2]"), ["pools[1].link_gbps", "must be a number", "list"]),
    ("speed-zero", pool_file(speed_factor=0), ["pools[1].speed_factor", "greater than 0"]),
    ("bad-provider", pool_file(provider="ibm"), ["pools[1].provider", "must be one of", "'ibm'"]),
    ("bad-state", pool_file(state="paused"), ["pools[1].state", "must be one of"]),
    ("bad-slug", pool_file(slug="'Has Spaces'"), ["line 9", "pools[1].slug", "must be a slug"]),
    ("slug-too-long", pool_file(slug="a" * 41), ["pools[1].slug", "must be a slug"]),
    ("name-too-long", pool_file(name="n" * 101), ["pools[1].name", "too long"]),
    ("name-number", pool_file(name=12), ["pools[1].name", "must be a string", "int"]),
    (
        "unknown-accelerator",
        pool_file(accelerator="h900"),
        ["line 11", "pools[1].accelerator", "unknown accelerator", "'h900'", "h100-sxm"],
    ),
    (
        "duplicate-pool-slug",
        pool_file(slug="ok-pool"),
        ["line 9", "duplicate slug 'ok-pool'", "first on line 3"],
    ),
    (
        "duplicate-key",
        "version: 1\nversion: 1\npools: []\n",
        ["line 2", "duplicate key 'version'", "first on line 1"],
    ),
    ("duplicate-field", pool_file() + "    region: again\n", ["duplicate key 'region'"]),
    ("python-tag", "version: 1\npools: !!python/object:os.system {}\n", ["line 2", "not valid YAML"]),
    ("alias", "version: 1\nx: &a [1]\npools: *a\n", ["line 3", "aliases"]),
    (
        "bad-accelerator-record",
        textwrap.dedent("""\
        version: 1
        accelerators:
          - slug: x1
            vendor: X
            model: X1
            kind: fpga
            generation: g
            year: 1900
            memory_gib: -1
            peak_bf16_tflops: 0
            tdp_watts: 1.5
        pools: []
        """),
        [
            "line 6",
            "accelerators[0].kind",
            "line 8",
            "accelerators[0].year",
            "line 9",
            "accelerators[0].memory_gib",
            "line 10",
            "peak_bf16_tflops",
            "line 11",
            "tdp_watts",
        ],
    ),
    (
        "duplicate-accelerator",
        "version: 1\naccelerators:\n  - {slug: cpu2, vendor: V, model: M, kind: cpu, "
        "generation: g, year: 2020, memory_gib: 1, peak_bf16_tflops: 1, tdp_watts: 1}\n"
        "  - {slug: cpu2, vendor: V, model: M, kind: cpu, generation: g, year: 2020, memory_gib: 1, "
        "peak_bf16_tflops: 1, tdp_watts: 1}\npools: []\n",
        ["line 4", "duplicate slug 'cpu2'", "first on line 3"],
    ),
    ("nul-in-notes", pool_file(notes='"a\\0b"'), ["pools[1].notes", "NUL"]),
]


@pytest.mark.parametrize(("text", "fragments"), [pytest.param(t, f, id=i) for i, t, f in BAD])
def test_bad_file_is_refused_whole(tmp_path, text, fragments):
    Pool.objects.create(
        slug="existing",
        name="x",
        region="r",
        accelerator=AcceleratorType.objects.get(slug="cpu"),
        device_count=1,
        link_gbps=1,
    )
    before = snapshot()
    with pytest.raises(CommandError) as info:
        run_import(tmp_path, text)
    msg = str(info.value)
    assert "nothing imported" in msg
    for frag in fragments:
        assert frag in msg, f"{frag!r} not in:\n{msg}"
    assert snapshot() == before


def test_all_problems_are_reported_at_once():
    text = pool_file(device_count=-1, link_gbps="fast", provider="ibm")
    with pytest.raises(InventoryFileError) as info:
        load(text)
    assert len(info.value.errors) == 3


def test_not_utf8(tmp_path):
    with pytest.raises(CommandError, match="not UTF-8"):
        run_import(tmp_path, b"version: 1\npools: []\nnotes: \xff\xfe\n")


def test_too_large(tmp_path):
    with pytest.raises(CommandError, match="too large"):
        run_import(tmp_path, "# " + "x" * (3 * 1024 * 1024))


def test_too_many_items():
    text = "version: 1\npools:\n" + "".join("  - 1\n" for _ in range(10_001))
    with pytest.raises(InventoryFileError, match="too many items"):
        load(text)


def test_missing_file():
    with pytest.raises(CommandError, match="no such file"):
        call_command("import_inventory", "/nonexistent/inv.yaml")


def test_a_late_database_error_rolls_back_everything(tmp_path, monkeypatch):
    """Even past validation, a failure while writing leaves nothing half-imported."""
    from apps.inventory import inventory_file

    real = Pool.objects.update_or_create
    calls = []

    def flaky(**kw):
        calls.append(kw["slug"])
        if len(calls) == 2:
            raise RuntimeError("disk full")
        return real(**kw)

    monkeypatch.setattr(inventory_file.Pool.objects, "update_or_create", flaky)
    before = snapshot()
    with pytest.raises(RuntimeError):
        run_import(tmp_path, GOOD)
    assert snapshot() == before
