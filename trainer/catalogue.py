"""Accelerator catalogue: public figures for the device classes the platform knows.

One place for these numbers: the simulator and the benchmarks read them, placement reads
them through `PoolInfo`, and the inventory's data migration may seed `AcceleratorType`
rows from `ACCELERATORS`.

Sources and caveats:
- peak_bf16_tflops: vendor datasheets, dense (no sparsity). V100 has no bf16; its fp16
  tensor-core peak is given. CPU is a nominal 2-socket server with bf16 matrix units.
- tdp_watts: board power from datasheets for GPUs. Google does not publish TPU chip
  power; the TPU figures are estimates (`watts_estimated=True`): v4 from the TPU v4
  paper's measured mean chip power, the others scaled by generation.
- mfu: a typical model-FLOPs utilisation for dense transformer training on that class
  (our assumption, used when nothing has been measured yet).
- idle_watts: what an allocated but idle device draws (our assumption, ~20-30% of TDP).
- cost_per_device_hour: indicative on-demand list prices in USD (vary by provider and
  region); only used to compare placements.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Accelerator:
    slug: str
    vendor: str
    model: str
    kind: str  # gpu | tpu | cpu
    generation: str
    year: int
    memory_gib: float
    peak_bf16_tflops: float
    tdp_watts: int
    idle_watts: int
    mfu: float
    cost_per_device_hour: float
    watts_estimated: bool = False

    def as_dict(self) -> dict:
        return asdict(self)

    @property
    def effective_tflops(self) -> float:
        """Sustained TFLOP/s for training at the class's typical MFU."""
        return self.peak_bf16_tflops * self.mfu

    @property
    def joules_per_pflop(self) -> float:
        """Energy per 1e15 useful FLOPs at TDP and typical MFU (lower is better)."""
        return self.tdp_watts / self.effective_tflops * 1e3


ACCELERATORS: tuple[Accelerator, ...] = (
    Accelerator("h200", "NVIDIA", "H200 SXM", "gpu", "Hopper", 2024, 141, 989, 700, 150, 0.40, 3.80),
    Accelerator("h100-sxm", "NVIDIA", "H100 SXM", "gpu", "Hopper", 2022, 80, 989, 700, 150, 0.40, 3.00),
    Accelerator("a100-80gb", "NVIDIA", "A100 80GB SXM", "gpu", "Ampere", 2020, 80, 312, 400, 90, 0.45, 1.80),
    Accelerator("v100", "NVIDIA", "V100 SXM2 32GB", "gpu", "Volta", 2017, 32, 125, 300, 70, 0.35, 0.90),
    Accelerator("l4", "NVIDIA", "L4", "gpu", "Ada Lovelace", 2023, 24, 121, 72, 20, 0.35, 0.70),
    Accelerator("tpu-v5p", "Google", "TPU v5p", "tpu", "v5p", 2023, 95, 459, 450, 110, 0.50, 4.20, True),
    Accelerator("tpu-v5e", "Google", "TPU v5e", "tpu", "v5e", 2023, 16, 197, 220, 50, 0.45, 1.20, True),
    Accelerator("tpu-v4", "Google", "TPU v4", "tpu", "v4", 2021, 32, 275, 192, 50, 0.50, 3.22, True),
    Accelerator(
        "tpu-v6e", "Google", "TPU v6e (Trillium)", "tpu", "v6e", 2024, 32, 918, 400, 90, 0.45, 2.70, True
    ),
    Accelerator(
        "cpu", "Generic", "CPU server (2 sockets)", "cpu", "x86-64", 2023, 512, 4, 500, 150, 0.30, 0.60
    ),
)

BY_SLUG: dict[str, Accelerator] = {a.slug: a for a in ACCELERATORS}


def get(slug: str) -> Accelerator:
    """The catalogue entry for `slug`; KeyError names the known slugs."""
    try:
        return BY_SLUG[slug]
    except KeyError:
        raise KeyError(f"unknown accelerator {slug!r}; known: {', '.join(BY_SLUG)}") from None
