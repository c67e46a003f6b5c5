"""Seed the accelerator catalogue with public figures (per device).

Peak figures are dense (no structured sparsity) bf16 tensor TFLOP/s from the vendors'
datasheets; memory is the vendor's figure. The values are frozen here (a migration must
not change when code elsewhere changes); trainer/catalogue.py carries the same numbers for
the simulator and tests/foundation/test_catalogue.py checks that the two agree.
Re-running is harmless: rows are keyed by slug and updated in place.
"""

from django.db import migrations

CATALOGUE = [
    # slug, vendor, model, kind, generation, year, memory_gib, peak_bf16_tflops, tdp_watts, source
    ("h200", "NVIDIA", "H200 SXM", "gpu", "Hopper", 2024, 141, 989.0, 700,
     "NVIDIA H200 datasheet: 1,979 TFLOP/s bf16 with sparsity (989 dense), 141 GB HBM3e, up to 700 W"),
    ("h100-sxm", "NVIDIA", "H100 SXM", "gpu", "Hopper", 2022, 80, 989.0, 700,
     "NVIDIA H100 datasheet: 1,979 TFLOP/s bf16 with sparsity (989 dense), 80 GB HBM3, up to 700 W"),
    ("a100-80gb", "NVIDIA", "A100 80GB SXM", "gpu", "Ampere", 2020, 80, 312.0, 400,
     "NVIDIA A100 datasheet: 312 TFLOP/s bf16 dense, 80 GB HBM2e, 400 W"),
    ("v100", "NVIDIA", "V100 SXM2 32GB", "gpu", "Volta", 2017, 32, 125.0, 300,
     "NVIDIA V100 datasheet: no bf16 support; 125 TFLOP/s is its fp16 tensor-core peak, 32 GB HBM2, 300 W"),
    ("l4", "NVIDIA", "L4", "gpu", "Ada Lovelace", 2023, 24, 121.0, 72,
     "NVIDIA L4 datasheet: 242 TFLOP/s bf16 with sparsity (121 dense), 24 GB GDDR6, 72 W"),
    ("tpu-v6e", "Google", "TPU v6e (Trillium)", "tpu", "v6e", 2024, 32, 918.0, 400,
     "Google Cloud TPU v6e docs: 918 TFLOP/s bf16, 32 GB HBM; power not published (400 W is an estimate)"),
    ("tpu-v5p", "Google", "TPU v5p", "tpu", "v5p", 2023, 95, 459.0, 450,
     "Google Cloud TPU v5p docs: 459 TFLOP/s bf16, 95 GB HBM2e; power not published (450 W is an estimate)"),
    ("tpu-v5e", "Google", "TPU v5e", "tpu", "v5e", 2023, 16, 197.0, 220,
     "Google Cloud TPU v5e docs: 197 TFLOP/s bf16, 16 GB HBM2; power not published (220 W is an estimate)"),
    ("tpu-v4", "Google", "TPU v4", "tpu", "v4", 2021, 32, 275.0, 192,
     "Google Cloud TPU v4 docs: 275 TFLOP/s bf16, 32 GiB HBM2; power not published (192 W, an estimate "
     "from the TPU v4 paper, Jouppi et al., ISCA 2023)"),
    ("cpu", "Generic", "CPU server (2 sockets)", "cpu", "x86-64", 2023, 512, 4.0, 500,
     "Nominal figures for a 2-socket x86-64 server with bf16 matrix units; the demo pools on this machine"),
]

FIELDS = ("slug", "vendor", "model", "kind", "generation", "year", "memory_gib", "peak_bf16_tflops",
          "tdp_watts", "source")


def seed(apps, schema_editor):
    AcceleratorType = apps.get_model("inventory", "AcceleratorType")
    for row in CATALOGUE:
        data = dict(zip(FIELDS, row, strict=True))
        AcceleratorType.objects.update_or_create(slug=data.pop("slug"), defaults=data)


def unseed(apps, schema_editor):
    AcceleratorType = apps.get_model("inventory", "AcceleratorType")
    AcceleratorType.objects.filter(slug__in=[r[0] for r in CATALOGUE], pools__isnull=True).delete()


class Migration(migrations.Migration):
    dependencies = [("inventory", "0002_accelerator_source")]

    operations = [migrations.RunPython(seed, unseed)]
