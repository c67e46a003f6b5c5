"""Engine-side training settings, and the defaults and rules the job spec shares with them.

`TrainConfig` is what the engine objects (Learner, Syncer, drivers) read. It is built from the
platform's job spec by `TrainConfig.from_spec(spec)` (the one place spec fields map to engine
settings) or directly (CLI, tests, simulator). The defaults that depend on other settings
(quorum, inner lr, inner prox) and the token budget are functions here, so `trainer.spec`,
the CLI and the config cannot disagree.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

STRATEGIES = ("single", "ddp", "diloco", "decoupled")
# Inner AdamW lr of the local-step strategies by model size and batch (docs/engine.md,
# "Defaults"), each the best of a sweep where one was run: at up to 8,192 tokens per learner step
# (the CPU's 16x64 default) tiny 5e-3 and small 7e-4 (600 steps at prox 25: 7e-4 / 1e-3 / 1.5e-3 /
# 5e-3 gave 1.565 / 1.583 / 1.660 / 2.430); at larger batches small 2e-3 (a GPU sweep at 64x256).
# base and factories get about half of small's, and tiny keeps its value at large batches: not measured.
DEFAULT_INNER_LR = {"tiny": 5e-3, "small": 7e-4, "base": 5e-4}
LARGE_BATCH_INNER_LR = {"tiny": 5e-3, "small": 2e-3, "base": 1e-3}
LARGE_BATCH_TOKENS = 8192  # tokens per learner step above which LARGE_BATCH_INNER_LR applies
FALLBACK_INNER_LR = 5e-4
LARGE_BATCH_FALLBACK_INNER_LR = 1e-3

# The inner prox a job gets when it names none pulls a learner a fixed share of the way back to the
# adopted global per inner step at full lr (prox = pull / inner_lr): 1/8 at up to LARGE_BATCH_TOKENS
# (tiny at 5e-3 gets 25, small at 7e-4 about 179: CPU sweeps), 0.05 above (small at 2e-3 gets 25,
# the setting of the GPU runs at 64x256). docs/engine.md, "Defaults": the runs behind them.
DEFAULT_PULL = 0.125
LARGE_BATCH_PULL = 0.05
MAX_INNER_PROX = 10_000.0
DEFAULT_FRAGMENTS = 4      # P when a job names none (at most H): docs/engine.md, "Defaults"
# The outer momentum falls to 0 over the last sixth of the run's outer steps when a job names no
# decay (small on the CPU, 30 outer steps: the last 3 / 5 / 8 / 15 gave 1.479 / 1.477 / 1.481 /
# 1.499 against 1.491 without; docs/engine.md, "Defaults").
DEFAULT_MOMENTUM_DECAY_SHARE = 6


def default_inner_lr(model: str, batch_tokens: int = 1024) -> float:
    """The inner lr a job of `model` gets when it names none; `batch_tokens` is one learner
    step's batch x sequence (a larger batch's less noisy gradient takes a larger step)."""
    if batch_tokens > LARGE_BATCH_TOKENS:
        return LARGE_BATCH_INNER_LR.get(model, LARGE_BATCH_FALLBACK_INNER_LR)
    return DEFAULT_INNER_LR.get(model, FALLBACK_INNER_LR)


def default_inner_prox(inner_lr: float, batch_tokens: int = 1024) -> float:
    """The inner prox a job gets when it names none: the same pull per step (a share of the way
    back to the global) whatever the inner lr, as the pull of a step is lr x prox. Large batches
    get the lighter pull their GPU runs were measured with (a larger one is not measured there)."""
    pull = LARGE_BATCH_PULL if batch_tokens > LARGE_BATCH_TOKENS else DEFAULT_PULL
    return min(pull / inner_lr, MAX_INNER_PROX)


def default_fragments(inner_steps: int) -> int:
    """P when a job names none: 4 staggered fragments, fewer when H is shorter (one sync per step)."""
    return max(1, min(DEFAULT_FRAGMENTS, inner_steps))


def default_outer_momentum_decay(steps: int, inner_steps: int) -> int:
    """Outer steps at the end of a run over which the outer momentum falls to 0, when a job names
    none: a sixth of its outer steps (rounded down), so the last merges anneal like the inner lr
    does instead of carrying on the large pseudo-gradients of the middle of the run. Measured
    (docs/engine.md, "Defaults"): tiny's 20 outer steps best at 3 of 1 / 3 / 5 / 10, small's 30
    at 3-5 of 3 / 5 / 8 / 15."""
    outer = steps // max(1, inner_steps)
    return outer // DEFAULT_MOMENTUM_DECAY_SHARE


def default_quorum(learners: int) -> int:
    """K when a job names none: half the learners (at least one merges)."""
    return max(1, learners // 2)


def token_budget(learners: int, steps: int, batch_size: int, seq_len: int, max_tokens: int | None) -> int:
    """Tokens of a whole job: every learner's steps of batch x sequence, capped by max_tokens."""
    by_steps = learners * steps * batch_size * seq_len
    return min(by_steps, max_tokens) if max_tokens else by_steps

# topk2 / topk4: chunked top-k at `compression_density`, 2- / 4-bit values, error feedback
# (trainer.compression; docs/engine.md, "Sparse pseudo-gradients")
COMPRESSIONS = ("none", "bf16", "int8", "int4", "topk2", "topk4")
DEFAULT_DENSITY = 0.02    # share of each chunk a topk method sends (trainer.compression.DEFAULT_DENSITY)
MAX_DENSITY = 0.5
INNER_OPTIMIZERS = ("adamw", "muon")  # muon: Muon for the hidden matrices, AdamW for the rest (MuLoCo)
INNER_STATES = ("keep", "reset")      # the inner optimizer's state of a fragment on adopting a global
FRAGMENT_MODES = ("strided", "balanced")


@dataclass
class TrainConfig:
    model: str = "tiny"
    dataset: str = "stdlib"
    learners: int = 4                 # M
    inner_steps: int = 20             # H: inner steps between two syncs of one fragment
    fragments: int | None = None      # P; None: default_fragments(inner_steps)
    quorum: int = 1                   # K: minimum contributions per merge
    outer_lr: float = 0.9
    # The defaults are the best measured for the local-step strategies (docs/engine.md, "Defaults").
    # Nesterov, ramped up over outer_momentum_warmup outer steps (small on the CPU: 0.7 / 0.8 / 0.9
    # gave 1.4724 / 1.4594 / 1.4749; docs/engine.md, "Defaults")
    outer_momentum: float = 0.8
    outer_momentum_warmup: int = 10   # outer steps over which the momentum ramps up from 0
    # last outer steps of the run over which it falls to 0 (0: off; None: a sixth of the outer steps)
    outer_momentum_decay: int | None = None
    inner_lr: float | None = None     # None: by model size (default_inner_lr); ddp's own best differs
    inner_optimizer: str = "adamw"    # adamw | muon (trainer.optimizers)
    muon_momentum: float = 0.95       # Muon's own (Nesterov) momentum, with inner_optimizer muon
    inner_state: str = "keep"         # keep | reset the inner optimizer's state on adoption
    weight_decay: float = 0.1
    inner_prox: float | None = None   # pull towards the global per unit of inner lr (0: off; None: by lr)
    warmup_steps: int = 20
    grad_clip: float = 1.0
    batch_size: int = 16
    seq_len: int = 64
    steps: int = 400                  # inner steps per learner (budget)
    compression: str = "none"         # wire format of contributions
    global_compression: str = "none"  # wire format of global updates sent down (none: full fp32 fragments)
    compression_density: float = DEFAULT_DENSITY  # share of each chunk the topk methods send, (0, 0.5]
    max_staleness: int = 4            # versions behind before a contribution is dropped
    grace_cap_s: float = 2.0          # cap of the adaptive grace window
    seed: int = 0
    fragment_mode: str = "balanced"   # balanced: P near-equal fragments; strided: whole layers dealt
    rda: bool = True                  # radial-directional averaging of non-embedding tensors
    # merges after the budget (the run's last) are the plain average of the learners' models
    final_average: bool = True
    mix_alpha: float = 0.5            # share of the progress made meanwhile kept on adoption
    device: str = "cpu"
    bf16: bool = False
    # Beyond the shared contract (all have defaults):
    betas: tuple[float, float] = (0.9, 0.95)
    min_lr_ratio: float = 0.1         # cosine decays the inner lr to inner_lr * min_lr_ratio
    grace_gamma: float = 1.0          # gamma of the grace window
    overlap_steps: int | None = None  # tau (inner steps of slack); None -> max(1, H // P)
    staleness_discount: float = 1.0   # weight *= 1 / (1 + discount * staleness)
    ema_beta: float = 0.8             # smoothing of the syncer's timing estimates
    eval_batches: int = 8
    eval_batch_size: int | None = None
    eval_every: int = 1               # rounds (H inner steps) between validation points
    max_tokens: int | None = None
    val_fraction: float = 0.05
    cache_dir: str | None = None
    tokenizer: str | None = None      # path to a local tokenizer.json (needs `tokenizers`)
    max_payload_bytes: int | None = None
    threads: int | None = 1           # torch.set_num_threads for learners (None: leave as is)
    # CPU learners and syncer flush subnormal floats to zero (torch.set_flush_denormal): on CPUs that
    # trap on them, weights that drift there cost up to twice the time per step (docs/benchmarks.md)
    flush_denormal: bool = True
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.inner_lr is None:
            self.inner_lr = default_inner_lr(self.model, self.batch_size * self.seq_len)
        if self.inner_prox is None:
            self.inner_prox = default_inner_prox(self.inner_lr, self.batch_size * self.seq_len)
        if self.fragments is None and isinstance(self.inner_steps, int):
            self.fragments = default_fragments(self.inner_steps)
        shape_ok = isinstance(self.steps, int) and isinstance(self.inner_steps, int)
        if self.outer_momentum_decay is None and shape_ok:
            self.outer_momentum_decay = default_outer_momentum_decay(self.steps, self.inner_steps)
        self.validate()

    @property
    def total_tokens(self) -> int:
        """Token budget of the whole run (see token_budget)."""
        return token_budget(self.learners, self.steps, self.batch_size, self.seq_len, self.max_tokens)

    @property
    def tau(self) -> int:
        if self.overlap_steps is not None:
            return self.overlap_steps
        return max(1, self.inner_steps // max(1, self.fragments))

    def validate(self) -> None:
        errors: dict[str, str] = {}

        def need(cond: bool, name: str, msg: str) -> None:
            if not cond:
                errors.setdefault(name, msg)

        for name in ("learners", "inner_steps", "fragments", "quorum", "batch_size", "seq_len", "steps"):
            need(isinstance(getattr(self, name), int) and getattr(self, name) >= 1, name,
                 "must be an integer >= 1")
        need(self.outer_lr > 0, "outer_lr", "must be > 0")
        need(0 <= self.outer_momentum < 1, "outer_momentum", "must be in [0, 1)")
        need(isinstance(self.outer_momentum_warmup, int) and self.outer_momentum_warmup >= 0,
             "outer_momentum_warmup", "must be an integer >= 0")
        need(self.inner_lr > 0, "inner_lr", "must be > 0")
        need(self.inner_optimizer in INNER_OPTIMIZERS, "inner_optimizer",
             f"must be one of {', '.join(INNER_OPTIMIZERS)}")
        need(0 <= self.muon_momentum < 1, "muon_momentum", "must be in [0, 1)")
        need(self.inner_state in INNER_STATES, "inner_state", f"must be one of {', '.join(INNER_STATES)}")
        need(isinstance(self.outer_momentum_decay, int) and self.outer_momentum_decay >= 0,
             "outer_momentum_decay", "must be an integer >= 0")
        need(self.weight_decay >= 0, "weight_decay", "must be >= 0")
        need(self.inner_prox >= 0, "inner_prox", "must be >= 0")
        need(self.inner_lr * self.inner_prox <= 1, "inner_prox", "inner_lr x inner_prox must be <= 1")
        need(self.warmup_steps >= 0, "warmup_steps", "must be >= 0")
        need(self.grad_clip > 0, "grad_clip", "must be > 0")
        need(self.compression in COMPRESSIONS, "compression", f"must be one of {', '.join(COMPRESSIONS)}")
        need(self.global_compression in COMPRESSIONS, "global_compression",
             f"must be one of {', '.join(COMPRESSIONS)}")
        density = self.compression_density
        number = isinstance(density, int | float) and not isinstance(density, bool)
        need(number and 0 < density <= MAX_DENSITY, "compression_density",
             f"must be in (0, {MAX_DENSITY}]")
        need(self.fragment_mode in FRAGMENT_MODES, "fragment_mode", "must be 'strided' or 'balanced'")
        need(self.max_staleness >= 0, "max_staleness", "must be >= 0")
        need(self.grace_cap_s >= 0, "grace_cap_s", "must be >= 0")
        need(0 <= self.mix_alpha <= 1, "mix_alpha", "must be in [0, 1]")
        need(self.grace_gamma >= 0, "grace_gamma", "must be >= 0")
        need(self.staleness_discount >= 0, "staleness_discount", "must be >= 0")
        need(0 <= self.ema_beta < 1, "ema_beta", "must be in [0, 1)")
        need(0 < self.val_fraction < 0.5, "val_fraction", "must be in (0, 0.5)")
        need(self.eval_every >= 1, "eval_every", "must be >= 1")
        need(self.overlap_steps is None or self.overlap_steps >= 0, "overlap_steps", "must be >= 0")
        if isinstance(self.quorum, int) and isinstance(self.learners, int):
            need(self.quorum <= self.learners, "quorum", "must not exceed learners")
        if isinstance(self.fragments, int) and isinstance(self.inner_steps, int):
            need(self.fragments <= self.inner_steps, "fragments", "must not exceed inner_steps")
        if errors:
            raise ConfigError(errors)

    @classmethod
    def from_spec(cls, spec: Any, **overrides: Any) -> TrainConfig:
        """The engine settings of a `trainer.spec.JobSpec`: every runtime, the CLI's spec files and
        the tests derive them here. Fields of the same name carry over; `eval_interval` is
        `eval_every`; synchronous DiLoCo (`strategy` "diloco") merges only with every learner.
        (`spec` is typed loosely: trainer.spec imports this module.)"""
        names = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        values: dict[str, Any] = {name: getattr(spec, name) for name in names if hasattr(spec, name)}
        values["eval_every"] = int(spec.eval_interval)
        if values.get("quorum") is None:
            values["quorum"] = default_quorum(int(values["learners"]))
        if getattr(spec, "strategy", None) == "diloco":
            values["quorum"] = int(values["learners"])
        values.update(overrides)
        return cls(**values)

    def replace(self, **changes: Any) -> TrainConfig:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["betas"] = list(self.betas)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TrainConfig:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - names
        if unknown:
            raise ConfigError(dict.fromkeys(sorted(unknown), "unknown setting"))
        d = dict(d)
        if "betas" in d:
            d["betas"] = tuple(d["betas"])
        return cls(**d)


class ConfigError(ValueError):
    """Bad settings; `.errors` maps field -> message."""

    def __init__(self, errors: dict[str, str]) -> None:
        self.errors = errors
        super().__init__("; ".join(f"{k}: {v}" for k, v in errors.items()))
