"""Device, link and model profiles of a simulated fleet, and the per-island time ledger.

- `DeclaredModel`: the model whose cost we account for (parameters, FLOPs per token,
  tokens per inner step of one learner). The proxy model actually trained is smaller; one
  proxy inner step stands for one declared inner step.
- `Island`: one learner's devices (an SPMD island): accelerator class from
  `trainer.catalogue`, number of chips, the pool it sits in.
- `Link`: a pool's link to the syncer (or to the other sites), one FIFO per direction,
  shared by every transfer that crosses it; counts bytes.
- `Ledger`: per island, seconds busy (useful or wasted), idle and down; energy from it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from trainer import catalogue
from trainer.compression import DEFAULT_DENSITY, SPARSE_BITS, SPARSE_CHUNK

WIRE_BYTES_PER_PARAM = {"none": 4.0, "bf16": 2.0, "int8": 1.0, "int4": 0.5}


def wire_bytes_per_param(method: str, density: float = DEFAULT_DENSITY) -> float:
    """Bytes per parameter of a payload: the dense methods' fixed rate; the top-k methods send
    `density` of each chunk as a uint16 offset plus a 2- or 4-bit code, and one fp32 scale a chunk."""
    if method in WIRE_BYTES_PER_PARAM:
        return WIRE_BYTES_PER_PARAM[method]
    return density * (2 + SPARSE_BITS[method] / 8) + 4 / SPARSE_CHUNK


@dataclass
class DeclaredModel:
    name: str
    params: float
    tokens_per_step: float  # tokens of one learner's inner step (its island's batch)
    flops_per_token: float | None = None
    grad_bytes_per_param: float = 2.0  # data-parallel gradients travel in bf16

    def __post_init__(self) -> None:
        if self.flops_per_token is None:
            self.flops_per_token = 6.0 * self.params

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class PoolProfile:
    slug: str
    accelerator: str
    link_gbps: float
    latency_ms: float = 1.0
    spare_slots: int = 0  # whole learner islands that can still be placed here
    speed_factor: float = 1.0
    whole_pool_failures: bool = True  # subject to FailureModel.pool_mtbf_s

    @property
    def acc(self) -> catalogue.Accelerator:
        return catalogue.get(self.accelerator)


@dataclass
class Island:
    index: int
    pool: PoolProfile
    chips: int

    @property
    def acc(self) -> catalogue.Accelerator:
        return self.pool.acc

    def step_time(self, model: DeclaredModel) -> float:
        """Virtual seconds of one inner step at full speed."""
        flops = model.tokens_per_step * model.flops_per_token
        return flops / (self.chips * self.acc.peak_bf16_tflops * 1e12 * self.acc.mfu * self.pool.speed_factor)

    def tokens_per_s(self, model: DeclaredModel) -> float:
        return model.tokens_per_step / self.step_time(model)


class Link:
    """Store-and-forward FIFO per direction: transfers queue behind each other."""

    def __init__(self, slug: str, gbps: float, latency_ms: float) -> None:
        self.slug = slug
        self.bytes_per_s = gbps * 1e9 / 8
        self.latency = latency_ms / 1e3
        self.free_at = {"up": 0.0, "down": 0.0}
        self.bytes = {"up": 0.0, "down": 0.0}
        self.busy_s = {"up": 0.0, "down": 0.0}

    def send(self, t: float, nbytes: float, direction: str = "up") -> float:
        """Arrival time of `nbytes` handed to the link at `t`."""
        start = max(t, self.free_at[direction])
        dur = nbytes / self.bytes_per_s
        self.free_at[direction] = start + dur
        self.bytes[direction] += nbytes
        self.busy_s[direction] += dur
        return start + dur + self.latency

    def transfer_time(self, nbytes: float) -> float:
        return nbytes / self.bytes_per_s + self.latency


@dataclass
class Ledger:
    """Seconds of one island by state. busy = useful + wasted."""

    useful: float = 0.0
    wasted: float = 0.0
    idle: float = 0.0
    down: float = 0.0
    pending: float = 0.0  # busy time not yet safe (since the last checkpoint / contribution)
    history: list = field(default_factory=list)

    @property
    def busy(self) -> float:
        return self.useful + self.wasted + self.pending

    def commit(self) -> None:
        self.useful += self.pending
        self.pending = 0.0

    def lose(self) -> None:
        self.wasted += self.pending
        self.pending = 0.0


def energy_j(island: Island, led: Ledger) -> float:
    """Busy devices draw TDP; allocated devices that idle or wait for recovery draw idle power."""
    a = island.acc
    return island.chips * (led.busy * a.tdp_watts + (led.idle + led.down) * a.idle_watts)
