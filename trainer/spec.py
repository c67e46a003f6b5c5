"""The job spec: one schema shared by the API, the dashboard form, the CLI and the engine.

Every field is bounded so a hostile or mistaken spec is refused with a field-level
message before anything runs. Checks that need the platform (data roots, inventory)
happen in `apps.jobs.spec`.
"""
from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from trainer.config import (
    MAX_DENSITY,
    MAX_INNER_PROX,
    TrainConfig,
    default_fragments,
    default_inner_lr,
    default_inner_prox,
    default_outer_momentum_decay,
    default_quorum,
    token_budget,
)

MODEL_PRESETS = ("tiny", "small", "base")
# The engine's defaults are the spec's: written once, in trainer.config.TrainConfig.
_D = {f.name: f.default for f in dataclasses.fields(TrainConfig)}
_FACTORY_RE = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
_NAME_RE = re.compile(r"^[\w .,:()+/@-]+$")

Strategy = Literal["decoupled", "diloco"]
Compression = Literal["none", "bf16", "int8", "int4", "topk2", "topk4"]
Objective = Literal["time", "energy", "cost"]
InnerParallelism = Literal["ddp", "fsdp"]
InnerOptimizer = Literal["adamw", "muon"]
InnerState = Literal["keep", "reset"]
FragmentMode = Literal["balanced", "strided"]

# Bounds of a dataset's file selection (trainer.data.resolve_files walks with them): a glob may
# hold at most MAX_GLOB_STARS recursive `**` segments, a dataset at most MAX_SOURCES sources.
MAX_GLOB_STARS = 2
MAX_SOURCES = 64
# Nodes one learner's island may span: each adds a rank-0 broadcast hop and a node whose loss fails the
# whole learner, so more than a few is a data-parallel job that should be several learners instead.
MAX_NODES_PER_LEARNER = 16
GLOB_CHARS = "*?["


def split_source(source: str | Iterable[str]) -> list[str]:
    """The parts of a source spec: a string is split on commas, a list is taken as is.

    The platform checks each part against its data roots with this same function, so what
    it checks is exactly what the engine reads (trainer.data re-exports it).
    """
    if isinstance(source, str):
        return [p.strip() for p in source.split(",") if p.strip()]
    return [str(p) for p in source]


def glob_stars(part: str) -> int:
    """The recursive `**` segments of a source part (what makes a glob's walk costly)."""
    return sum(1 for seg in part.split("/") if seg == "**")


def short(text: str, limit: int = 80) -> str:
    """`text` quoted and cut to `limit` characters, for a message that echoes a value."""
    return repr(text if len(text) <= limit else text[:limit] + "...")


def source_problem(source: str | Iterable[str]) -> str | None:
    """Why a dataset's sources break the selection bounds (count, `**` per glob), or None."""
    parts = split_source(source)
    if len(parts) > MAX_SOURCES:
        return f"at most {MAX_SOURCES} sources per dataset ({len(parts)} given)"
    for part in parts:
        stars = glob_stars(part)
        if stars > MAX_GLOB_STARS:
            return f"at most {MAX_GLOB_STARS} '**' per pattern ({short(part)} has {stars})"
    return None


class JobSpec(BaseModel):
    """A training job. Defaults give the demo job: tiny GPT on the stdlib corpus."""

    model_config = ConfigDict(extra="forbid", str_strip_whitespace=True)

    name: str = Field("demo", min_length=1, max_length=100)
    strategy: Strategy = "decoupled"
    model: str = Field(_D["model"], max_length=200, description="preset or package.module:factory")
    dataset: str = Field(
        _D["dataset"], max_length=2000,
        description="'stdlib', or absolute paths under a data root: a list, or one string split on commas",
    )
    learners: int = Field(_D["learners"], ge=1, le=64, description="M: number of learners")
    min_learners: int | None = Field(None, ge=1, le=64)
    max_learners: int | None = Field(None, ge=1, le=64)
    inner_steps: int = Field(
        _D["inner_steps"], ge=1, le=10_000, description="H: inner steps per outer round")
    fragments: int | None = Field(
        None, ge=1, le=64, description="P: fragments synced on a staggered schedule (default 4, at most H)")
    fragment_mode: FragmentMode = Field(
        _D["fragment_mode"],
        description="balanced: P fragments of near-equal size; strided: whole layers dealt in turn")
    quorum: int | None = Field(None, ge=1, le=64, description="K: minimum contributions per merge")
    syncer_shards: int = Field(
        1, ge=1, le=64, description="syncer tasks, each merging its share of the fragments (at most P)"
    )
    outer_lr: float = Field(_D["outer_lr"], gt=0, le=2.0)
    outer_momentum: float = Field(
        _D["outer_momentum"], ge=0, lt=1.0, description="Nesterov momentum of the outer step")
    outer_momentum_warmup: int = Field(
        _D["outer_momentum_warmup"], ge=0, le=100_000,
        description="outer steps over which the outer momentum ramps up from 0")
    outer_momentum_decay: int | None = Field(
        None, ge=0, le=100_000,
        description="last outer steps of the run over which the outer momentum falls to 0 (0: off; "
        "default a sixth of the run's outer steps, steps // inner_steps, rounded down)")
    inner_optimizer: InnerOptimizer = Field(
        _D["inner_optimizer"],
        description="adamw, or muon: Muon for the hidden matrices and AdamW for the rest (MuLoCo)")
    muon_momentum: float = Field(_D["muon_momentum"], ge=0, lt=1.0, description="Muon's own momentum")
    inner_state: InnerState = Field(
        _D["inner_state"], description="keep or reset the inner optimizer's state on adopting a global")
    inner_lr: float | None = Field(
        None, gt=0, le=1.0,
        description="inner AdamW lr; default by model and batch: tiny 5e-3; small 7e-4, 2e-3 above 8,192 "
        "tokens per learner step; others half of small's",
    )
    weight_decay: float = Field(_D["weight_decay"], ge=0, le=1.0)
    inner_prox: float | None = Field(
        None, ge=0, le=MAX_INNER_PROX,
        description="pull of each inner step towards the adopted global weights, per unit of inner lr "
        "(FedProx-style, keeps the learners from drifting apart; 0: off; default 0.125 / inner_lr, "
        "e.g. 25 at 5e-3, and 0.05 / inner_lr above 8,192 tokens per learner step; at most 1 / inner_lr)",
    )
    rda: bool = Field(_D["rda"], description="radial-directional averaging of the merged pseudo-gradients")
    final_average: bool = Field(
        _D["final_average"],
        description="the merges after the budget (steps // inner_steps outer steps) make the global the "
        "plain token-weighted average of the learners' models: outer lr 1, no momentum, no RDA",
    )
    warmup_steps: int = Field(_D["warmup_steps"], ge=0, le=100_000)
    grad_clip: float = Field(_D["grad_clip"], gt=0, le=1000)
    batch_size: int = Field(_D["batch_size"], ge=1, le=1024)
    seq_len: int = Field(_D["seq_len"], ge=8, le=8192)
    steps: int = Field(_D["steps"], ge=1, le=10_000_000, description="inner steps per learner (budget)")
    max_tokens: int | None = Field(None, ge=1, le=10**15, description="optional token budget")
    compression: Compression = _D["compression"]
    global_compression: Compression = Field(
        _D["global_compression"],
        description="global updates sent down to learners (none: whole fp32 fragments)",
    )
    compression_density: float = Field(
        _D["compression_density"], gt=0, le=MAX_DENSITY,
        description="share of each chunk of 4,096 values that topk2 / topk4 send (the largest; the rest "
        "is kept by the sender and goes out later: error feedback)")
    objective: Objective = "time"
    checkpoint_interval: int = Field(10, ge=1, le=100_000, description="outer steps between checkpoints")
    eval_interval: int = Field(5, ge=1, le=100_000, description="outer steps between evaluations")
    max_staleness: int = Field(
        _D["max_staleness"], ge=0, le=1000, description="versions behind before dropped")
    grace_cap_s: float = Field(_D["grace_cap_s"], ge=0, le=3600)
    pools: list[str] = Field(default_factory=list, max_length=64, description="restrict placement")
    devices_per_learner: int = Field(
        1, ge=1, le=64, description="devices (processes) of one learner: an island training data-parallel "
        "inside (trainer.island), on one node unless nodes_per_learner says more")
    nodes_per_learner: int = Field(
        1, ge=1, le=MAX_NODES_PER_LEARNER,
        description="nodes one learner's island spans (devices_per_learner / nodes_per_learner processes on "
        "each; must divide devices_per_learner): ranks meet at rank 0's node address over torch.distributed "
        "(gloo on CPU, nccl on CUDA); placement needs that many distinct live nodes of one pool")
    inner_parallelism: InnerParallelism = Field(
        "ddp", description="how an island's devices share the inner steps: ddp (replicas) or fsdp "
        "(FSDP2: each device holds a shard of the weights and moments)")
    seed: int = Field(_D["seed"], ge=0, le=2**31 - 1)

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not _NAME_RE.match(v):
            raise ValueError("use letters, digits, spaces and . , : ( ) + / @ - only")
        return v

    @field_validator("model")
    @classmethod
    def _model(cls, v: str) -> str:
        if v not in MODEL_PRESETS and not _FACTORY_RE.match(v):
            raise ValueError(f"must be one of {', '.join(MODEL_PRESETS)} or 'package.module:factory'")
        return v

    @field_validator("dataset", mode="before")
    @classmethod
    def _dataset_list(cls, v: object) -> object:
        """A list of paths is stored as the engine's comma-joined source string."""
        if isinstance(v, list):
            if not v or len(v) > MAX_SOURCES or not all(isinstance(p, str) and p.strip() for p in v):
                raise ValueError(f"must be a list of 1 to {MAX_SOURCES} non-empty paths")
            if any("," in p for p in v):
                raise ValueError("a path in the list must not contain a comma")
            return ",".join(p.strip() for p in v)
        return v

    @field_validator("dataset")
    @classmethod
    def _dataset(cls, v: str) -> str:
        if "\x00" in v or not v.strip(",").strip():
            raise ValueError("must be 'stdlib' or a file path")
        problem = source_problem(v)
        if problem:
            raise ValueError(problem)
        return v

    @field_validator("pools")
    @classmethod
    def _pools(cls, v: list[str]) -> list[str]:
        for slug in v:
            if not re.match(r"^[-a-zA-Z0-9_]{1,40}$", slug):
                raise ValueError(f"{slug!r} is not a pool slug")
        return v

    @model_validator(mode="after")
    def _consistent(self) -> JobSpec:
        if self.quorum is None:
            self.quorum = default_quorum(self.learners)
        if self.quorum > self.learners:
            raise ValueError("quorum: must not exceed learners")
        if self.inner_lr is None:
            self.inner_lr = default_inner_lr(self.model, self.batch_size * self.seq_len)
        if self.inner_prox is None:
            self.inner_prox = default_inner_prox(self.inner_lr, self.batch_size * self.seq_len)
        if self.inner_lr * self.inner_prox > 1:
            raise ValueError("inner_prox: inner_lr x inner_prox must be <= 1 (no pull past the global)")
        if self.fragments is None:
            self.fragments = default_fragments(self.inner_steps)
        if self.outer_momentum_decay is None:
            self.outer_momentum_decay = default_outer_momentum_decay(self.steps, self.inner_steps)
        if self.fragments > self.inner_steps:
            raise ValueError("fragments: must not exceed inner_steps (one sync per step at most)")
        if self.batch_size % self.devices_per_learner:
            raise ValueError("devices_per_learner: must divide batch_size (each device reads its share "
                             "of the learner's batch)")
        if self.devices_per_learner % self.nodes_per_learner:
            raise ValueError("nodes_per_learner: must divide devices_per_learner (each node runs the same "
                             "number of the island's processes)")
        muon_fsdp = (self.inner_optimizer, self.inner_parallelism) == ("muon", "fsdp")
        if muon_fsdp and self.devices_per_learner > 1:
            raise ValueError("inner_optimizer: muon orthogonalises whole matrices, and fsdp islands hold "
                             "row shards of them: use inner_parallelism ddp with muon")
        if self.syncer_shards > self.fragments:
            raise ValueError("syncer_shards: must not exceed fragments (a shard merges whole fragments)")
        lo = self.min_learners or self.learners
        hi = self.max_learners or self.learners
        if not lo <= self.learners <= hi:
            raise ValueError("learners: must lie between min_learners and max_learners")
        if self.quorum > lo:
            raise ValueError("quorum: must not exceed min_learners")
        return self

    @property
    def total_tokens(self) -> int:
        """Token budget of the whole job (all learners; trainer.config.token_budget)."""
        return token_budget(self.learners, self.steps, self.batch_size, self.seq_len, self.max_tokens)


def stored_spec(data: object) -> JobSpec | None:
    """A stored job's spec read back for display (defaults filled in, rules applied), or None when
    it no longer validates. Running a job validates it again with the platform's rules."""
    try:
        return JobSpec.model_validate(data)
    except ValidationError:
        return None


def spec_errors(exc: ValidationError) -> dict[str, list[str]]:
    """Field path -> messages, the shape the API, form and CLI all show."""
    out: dict[str, list[str]] = {}
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"]) or "non_field_errors"
        msg = err["msg"].removeprefix("Value error, ")
        if ":" in msg and loc == "non_field_errors":
            field, _, rest = msg.partition(":")
            if field.isidentifier():
                loc, msg = field, rest.strip()
        out.setdefault(loc, []).append(msg)
    return out
