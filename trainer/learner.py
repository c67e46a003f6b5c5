"""The learner: inner AdamW loop on its own data stream, contributions on a staggered schedule.

One inner step = one AdamW step on one batch of this learner's `TokenStream` (linear warmup,
cosine decay to `inner_lr * min_lr_ratio` over `config.steps`, global-norm clipping), then,
with `inner_prox` > 0, a pull towards the adopted global weights: x <- x - lr * inner_prox *
(x - base).

After inner step s of its current cycle, fragment p is due when
`s in sync_schedule(s, H_learner, P)`. The learner then emits a `Contribution` with the
pseudo-gradient `base_p - local_p` (base_p = the global fragment at the version it last
adopted) and the tokens / inner steps behind it (counted since that base). It never waits.
While a contribution for p is outstanding (sent, no newer global version adopted since),
the next one for p is skipped: the progress stays in the local weights and goes out with the
next contribution. So one (learner, incarnation, fragment, base_version) key names exactly
one payload.

A global fragment arrives whole (fp32) or as an update from the version the learner holds
(`GlobalFragment.is_update`, compressed): g = base_p + update.

Adoption of a newer global fragment g (Streaming DiLoCo overlap):
    local_p <- g + mix_alpha * (local_p - ref_p)
where ref_p is the local weights at the time the outstanding contribution was sent (the
progress made meanwhile is kept, scaled by mix_alpha), or the previous base when nothing was
outstanding (the unsent progress is kept, scaled). With lock-step learners (no inner step
between send and adopt) this is classic DiLoCo: local <- global, a copy of the global's bits (not
the arithmetic above, which equals it only up to fp32 rounding). The inner AdamW state is kept.

The contribution path stays off the training step's critical path: the local weights at send
time go into a snapshot buffer per fragment, reused (no clone per send), and the delta into a
payload buffer per fragment, reused once the previous contribution that carried it is gone (its
consumer, e.g. the writer thread, encoded it). On CUDA the delta is computed and copied into
pinned host memory on a side stream with non-blocking copies, overlapped with the next inner
steps; the contribution carries the copy's event and `Contribution.wait()` (called by
`to_bytes`, `Syncer.submit`) blocks on it, so the writer thread, not the training loop, waits.

Error feedback (compression topk2 / topk4, `trainer.compression`): a sparse contribution sends
only the largest values of each chunk, quantized; what it leaves out is kept per fragment in
`residual` and added to the fragment's next pseudo-gradient before it is compressed:
    c = (base_p - local_p) + residual_p;  sent = densify(sparsify(c));  residual_p <- c - sent
The contribution's tensors are `sent` (dense, the exact values the syncer decodes) and it carries
the sparse entries, so `to_bytes` does not select twice. The residual is folded in when the send
is settled, not when it is made: until then the learner keeps the entries (`_pending`, small), and
on adopting the next global version it recomputes c from the same base, snapshot and residual
(the same operations on the same values: the same bits) and keeps c - sent. A refused send (or
one a new incarnation forgets) just drops its entries: the residual is still the one before it,
exactly, and its progress is still in the local weights. `residual` and `_pending` are part of
`state_dict()`, so a resume continues bit for bit. Per element, c = sent + residual exactly where
nothing was sent (sent is 0 there) and up to one fp32 rounding of the subtraction where a value was.
"""

from __future__ import annotations

import copy
import math
import weakref
from dataclasses import dataclass

import torch
from torch import nn

from trainer.compression import SPARSE_BITS, densify, sparsify
from trainer.config import TrainConfig
from trainer.data import Corpus, TokenStream
from trainer.fragments import make_fragments, sync_schedule
from trainer.models import autocast, build_model, pick_device, set_flush_denormal
from trainer.optimizers import forget_state, make_optimizer
from trainer.protocol import Contribution, GlobalFragment

STATE_VERSION = 1


@dataclass
class StepResult:
    loss: float
    tokens: int
    step: int


def inner_lr(config: TrainConfig, step: int) -> float:
    """Learning rate of inner step `step` (0-based): linear warmup, then cosine."""
    if step < config.warmup_steps:
        return config.inner_lr * (step + 1) / config.warmup_steps
    span = max(1, config.steps - config.warmup_steps)
    progress = min(1.0, (step - config.warmup_steps) / span)
    floor = config.min_lr_ratio
    return config.inner_lr * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))


def _cpu_copy(obj):
    """A copy of nested dicts/lists with every tensor cloned to host memory."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu().clone()
    if isinstance(obj, dict):
        return {k: _cpu_copy(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(_cpu_copy(v) for v in obj)
    return copy.copy(obj)


def load_corpus(config: TrainConfig) -> Corpus:
    return Corpus.load(
        config.dataset,
        cache_dir=config.cache_dir,
        tokenizer=config.tokenizer,
        val_fraction=config.val_fraction,
    )


class Learner:
    def __init__(
        self,
        config: TrainConfig,
        index: int,
        incarnation: int = 0,
        corpus: Corpus | None = None,
        model: nn.Module | None = None,
        job: str = "local",
        num_learners: int | None = None,
        standalone: bool = False,
    ) -> None:
        if config.threads:
            torch.set_num_threads(config.threads)
        self.config = config
        self.index = index
        self.incarnation = incarnation
        self.job = job
        self.standalone = standalone
        self.device = pick_device(config.device)
        set_flush_denormal(self.device, config.flush_denormal)
        self.corpus = corpus if corpus is not None else load_corpus(config)
        if model is None:
            model = build_model(config.model, config.seq_len, config.seed, vocab_size=self.corpus.vocab_size)
        self.model = model.to(self.device)
        self.model.train()
        # hooks of an island (trainer.island): the loss runs through DDP, each rank reads 1/ranks
        # of the batch and counts the whole batch's tokens
        self.forward_loss = self.model.loss
        self.data_ranks = 1
        self.params = dict(self.model.named_parameters())
        self.fragments = make_fragments(self.model, config.fragments, config.fragment_mode)
        self.stream = TokenStream(
            self.corpus,
            index,
            num_learners or config.learners,
            config.batch_size,
            config.seq_len,
            config.seed,
        )
        self.optimizer = make_optimizer(self.model, config, self.device)
        self.base: dict[int, dict[str, torch.Tensor]] = {
            p: {n: self.params[n].detach().float().clone() for n in names}
            for p, names in enumerate(self.fragments)
        }
        self.adopted_versions: dict[int, int] = dict.fromkeys(range(len(self.fragments)), 0)
        self._sent: dict[int, dict[str, torch.Tensor] | None] = dict.fromkeys(range(len(self.fragments)))
        self._since: dict[int, list[int]] = {p: [0, 0] for p in range(len(self.fragments))}
        self._sent_counts: dict[int, list[int]] = {p: [0, 0] for p in range(len(self.fragments))}
        self.work_size = config.inner_steps
        self._next_work_size: int | None = None
        self.cycle_step = 0
        self.inner_steps = 0
        self.tokens = 0
        self.last_loss = float("nan")
        self._due: list[Contribution] = []
        self.skipped_sends = 0
        # reusable buffers of the contribution path (see the module docstring)
        self._snapshots: dict[int, list[torch.Tensor]] = {}
        self._payloads: dict[int, list[torch.Tensor]] = {}
        self._payload_deltas: dict[int, list[torch.Tensor]] = {}  # on the device, CUDA only
        self._payload_owner: dict[int, weakref.ref] = {}
        self._copy_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._param_list = [self.params[n] for names in self.fragments for n in names]
        # error feedback of the sparse compressions (see the module docstring)
        self._sparse_method = config.compression if config.compression in SPARSE_BITS else None
        self.residual: dict[int, dict[str, torch.Tensor]] = {}
        self._pending: dict[int, dict | None] = dict.fromkeys(range(len(self.fragments)))

    # -- training ---------------------------------------------------------------------------
    @property
    def done(self) -> bool:
        if self.inner_steps >= self.config.steps:
            return True
        if self.config.max_tokens:
            return self.tokens >= self.config.max_tokens // max(1, self.stream.num_learners)
        return False

    def step(self) -> StepResult:
        lr = inner_lr(self.config, self.inner_steps)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        x, y = self.stream.next_batch()
        x, y = x.to(self.device), y.to(self.device)
        with autocast(self.device, self.config.bf16):
            loss = self.forward_loss(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.config.inner_prox and not self.standalone:
            self._pull_towards_base(lr * self.config.inner_prox)
        ntok = x.numel() * self.data_ranks
        self.inner_steps += 1
        self.tokens += ntok
        for since in self._since.values():
            since[0] += ntok
            since[1] += 1
        self.cycle_step += 1
        if not self.standalone:
            for p in sync_schedule(self.cycle_step, self.work_size, len(self.fragments)):
                self._contribute(p)
        if self.cycle_step >= self.work_size:
            self.cycle_step = 0
            if self._next_work_size is not None:
                self.work_size, self._next_work_size = self._next_work_size, None
        self.last_loss = float(loss.detach())
        return StepResult(loss=self.last_loss, tokens=ntok, step=self.inner_steps)

    @torch.no_grad()
    def _pull_towards_base(self, rate: float) -> None:
        """Proximal step x <- x - rate (x - base), decoupled from AdamW like its weight decay
        (FedProx's proximal term, applied after the step): the learners stay near the global
        weights they share, so a larger inner lr buys progress without the drift that twenty
        local steps would otherwise add between merges."""
        base = [self.base[p][n] for p, names in enumerate(self.fragments) for n in names]
        if any(b.dtype != x.dtype for b, x in zip(base, self._param_list, strict=True)):
            base = [b.to(x.dtype) for b, x in zip(base, self._param_list, strict=True)]
        torch._foreach_lerp_(self._param_list, base, rate)

    def set_work_size(self, inner_steps_per_cycle: int) -> None:
        """New H for this learner (dynamic local updates); applies from the next cycle."""
        h = int(inner_steps_per_cycle)
        if h < 1:
            raise ValueError("work size must be >= 1")
        if self.cycle_step == 0:
            self.work_size = h
        else:
            self._next_work_size = h

    # -- protocol ---------------------------------------------------------------------------
    def _contribute(self, p: int) -> None:
        tokens, steps = self._since[p]
        if steps == 0:
            return
        if self._sent[p] is not None:
            self.skipped_sends += 1
            return
        names = self.fragments[p]
        sparse = None
        with torch.no_grad():
            local = self._snapshot(p)
            if self._sparse_method is None:
                delta, ready = self._delta(p, local)
            else:
                delta, sparse = self._sparse_delta(p, local)
                ready = None
        self._sent[p] = dict(zip(names, local, strict=True))
        self._sent_counts[p] = [tokens, steps]
        c = Contribution(
            job=self.job,
            learner=self.index,
            incarnation=self.incarnation,
            fragment=p,
            base_version=self.adopted_versions[p],
            tokens=tokens,
            inner_steps=steps,
            tensors=dict(zip(names, delta, strict=True)),
            ready=ready,
            sparse=sparse,
        )
        self._payload_owner[p] = weakref.ref(c)
        self._due.append(c)

    def _snapshot(self, p: int) -> list[torch.Tensor]:
        """The fragment's local weights now, in fp32, in its reused snapshot buffer."""
        names = self.fragments[p]
        snap = self._snapshots.get(p)
        if snap is None:
            snap = self._snapshots[p] = [torch.empty_like(self.params[n], dtype=torch.float32) for n in names]
        torch._foreach_copy_(snap, [self.params[n].detach() for n in names])
        return snap

    def _payload(self, p: int) -> list[torch.Tensor]:
        """Host buffers for the fragment's delta: the previous ones once the contribution that
        carried them is gone, else new ones (pinned on CUDA)."""
        owner = self._payload_owner.get(p)
        buf = self._payloads.get(p)
        if buf is None or (owner is not None and owner() is not None):
            pin = self.device.type == "cuda"
            buf = [
                torch.empty(self.params[n].shape, dtype=torch.float32, pin_memory=pin)
                for n in self.fragments[p]
            ]
            self._payloads[p] = buf
        return buf

    def _delta(self, p: int, local: list[torch.Tensor]) -> tuple[list[torch.Tensor], object]:
        """base - local into the payload buffers; on CUDA on the side stream, returning the
        event that marks the host copy done (None on the CPU: done already)."""
        base = [self.base[p][n] for n in self.fragments[p]]
        out = self._payload(p)
        if self._copy_stream is None:
            torch._foreach_copy_(out, base)
            torch._foreach_sub_(out, local)
            return out, None
        stream = self._copy_stream
        stream.wait_stream(torch.cuda.current_stream(self.device))  # the snapshot is taken
        with torch.cuda.stream(stream):
            dev = self._payload_deltas.get(p)
            if dev is None:
                dev = self._payload_deltas[p] = [torch.empty_like(t) for t in local]
            torch._foreach_copy_(dev, base)
            torch._foreach_sub_(dev, local)
            torch._foreach_copy_(out, dev, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record(stream)
        return out, ready

    def _compensated(self, p: int, local: list[torch.Tensor]) -> list[torch.Tensor]:
        """(base - local) + residual of fragment p: what a sparse contribution compresses."""
        names = self.fragments[p]
        out = [self.base[p][n] - x for n, x in zip(names, local, strict=True)]
        residual = self.residual.get(p)
        if residual is not None:
            torch._foreach_add_(out, [residual[n] for n in names])
        return out

    def _sparse_delta(self, p: int, local: list[torch.Tensor]) -> tuple[list[torch.Tensor], tuple]:
        """The dense form of the sparse contribution of fragment p, and (method, density, entries).
        The entries wait in `_pending` until the send is settled (`_fold_residual`)."""
        names = self.fragments[p]
        if self._copy_stream is not None:  # a dense send's side stream may still read the base
            torch.cuda.current_stream(self.device).wait_stream(self._copy_stream)
        comp = dict(zip(names, self._compensated(p, local), strict=True))
        method, density = self._sparse_method, self.config.compression_density
        entries = sparsify(comp, method, density)
        sent = densify(entries, {n: list(comp[n].shape) for n in names}, method, density)
        self._pending[p] = entries
        return [sent[n] for n in names], (method, density, entries)

    @torch.no_grad()
    def _fold_residual(self, p: int) -> None:
        """The outstanding sparse send of fragment p is settled: residual <- c - sent, with c
        recomputed as at the send (base and snapshot are untouched until the adoption)."""
        entries, self._pending[p] = self._pending[p], None
        if entries is None or self._sent[p] is None or self._sparse_method is None:
            return
        names = self.fragments[p]
        comp = self._compensated(p, [self._sent[p][n] for n in names])
        method, density = self._sparse_method, self.config.compression_density
        sent = densify(entries, {n: list(t.shape) for n, t in zip(names, comp, strict=True)}, method,
                       density, device=self.device)
        torch._foreach_sub_(comp, [sent[n] for n in names])
        self.residual[p] = dict(zip(names, comp, strict=True))

    def due_contributions(self) -> list[Contribution]:
        out, self._due = self._due, []
        return out

    def flush(self) -> list[Contribution]:
        """Contributions for every fragment with unsent progress (end of a run)."""
        for p in range(len(self.fragments)):
            self._contribute(p)
        return self.due_contributions()

    def refused(self, p: int) -> None:
        """The syncer refused the outstanding contribution for fragment p: none of it was applied,
        so the progress stays local and goes out, whole, with the next scheduled contribution
        (a sparse send's residual stays the one before it)."""
        self._sent[p] = None
        self._pending[p] = None

    def outstanding(self, p: int) -> bool:
        return self._sent[p] is not None

    def expected_shapes(self, p: int) -> dict[str, tuple]:
        return {n: tuple(self.params[n].shape) for n in self.fragments[p]}

    @torch.no_grad()
    def adopt(self, g: GlobalFragment) -> bool:
        """Adopt a newer global version of a fragment. Returns False when it is not newer."""
        p = g.fragment
        if not 0 <= p < len(self.fragments):
            raise ValueError(f"fragment {p} out of range")
        if g.version <= self.adopted_versions[p]:
            return False
        names = self.fragments[p]
        if set(g.tensors) != set(names):
            raise ValueError(f"global fragment {p} does not hold this fragment's tensors")
        if g.is_update and g.base_version != self.adopted_versions[p]:
            raise ValueError(
                f"update of fragment {p} from version {g.base_version} does not apply to the adopted "
                f"version {self.adopted_versions[p]}; fetch the full fragment"
            )
        if self._copy_stream is not None:  # the side stream may still read base and the snapshot
            torch.cuda.current_stream(self.device).wait_stream(self._copy_stream)
        self._fold_residual(p)
        alpha = self.config.mix_alpha
        sent = self._sent[p]
        # lock-step learners (no inner step since the send, or since the last adoption when nothing
        # is outstanding) take the global as it is, bit for bit: classic DiLoCo's replacement
        unchanged = self._since[p][1] == (self._sent_counts[p][1] if sent is not None else 0)
        for n in names:
            new = g.tensors[n].to(self.device, dtype=torch.float32)
            if g.is_update:
                new = self.base[p][n] + new  # base holds the published weights of base_version
            param = self.params[n]
            if unchanged:
                param.copy_(new)
            elif sent is None:
                ref = self.base[p][n]
                param.copy_((param.detach().float() - ref).mul_(alpha).add_(new))
            else:
                # local_at_send + (g - (base - delta_sent)) + alpha * (local - local_at_send): equal to
                # g + alpha * (local - local_at_send), written so that a global that only applied this
                # learner's own contribution at lr 1 gives back its exact weights (no rounding drift)
                ref = sent[n]
                base = self.base[p][n]
                expected = base - (base - ref)
                param.copy_((new - expected).add_(ref).add_((param.detach().float() - ref).mul_(alpha)))
            self.base[p][n] = new.clone()
        if self.config.inner_state == "reset":
            forget_state(self.optimizer, [self.params[n] for n in names])
        if self._sent[p] is not None:
            # keep counting only the progress made since the send
            since, sent = self._since[p], self._sent_counts[p]
            self._since[p] = [since[0] - sent[0], since[1] - sent[1]]
        self._sent[p] = None
        self.adopted_versions[p] = g.version
        return True

    @torch.no_grad()
    def adopt_updates(self, updates: list[GlobalFragment]) -> bool:
        """Adopt the newest of a chain of updates (`Syncer.global_updates`), the first made from
        the version this learner holds. They are added in order, as the syncer added them to
        its published weights, so the result has the same bits; then adopted as one version."""
        if not updates:
            return False
        p = updates[0].fragment
        if not 0 <= p < len(self.fragments):
            raise ValueError(f"fragment {p} out of range")
        held = self.adopted_versions[p]
        for u in updates:
            if not u.is_update or u.fragment != p or u.base_version != held:
                raise ValueError(f"updates of fragment {p} do not form a chain from version "
                                 f"{self.adopted_versions[p]}")
            held = u.version
        names = self.fragments[p]
        whole = {}
        for n in names:
            t = self.base[p][n]
            for u in updates:
                t = t + u.tensors[n].to(self.device, dtype=torch.float32)
            whole[n] = t
        return self.adopt(GlobalFragment(updates[-1].job, p, updates[-1].version, whole))

    # -- state ------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {
            "version": STATE_VERSION,
            "index": self.index,
            "incarnation": self.incarnation,
            **self._weights_state(),
            "stream": self.stream.state_dict(),
            "adopted_versions": dict(self.adopted_versions),
            "base": _cpu_copy(self.base),
            "sent": _cpu_copy(self._sent),
            "sent_counts": {p: list(v) for p, v in self._sent_counts.items()},
            "since": {p: list(v) for p, v in self._since.items()},
            "inner_steps": self.inner_steps,
            "tokens": self.tokens,
            "cycle_step": self.cycle_step,
            "work_size": self.work_size,
            "next_work_size": self._next_work_size,
            "due": [c.to_state() for c in self._due],
            "residual": _cpu_copy(self.residual),
            "pending": _cpu_copy(self._pending),
        }

    def _weights_state(self) -> dict:
        """The model's and the optimizer's state as whole tensors in host memory (an FSDP island
        gathers its shards here: trainer.island_fsdp)."""
        # copies in host memory: torch hands out live tensors (the optimizer's moments too),
        # and a checkpoint must not move on with training
        return {"model": _cpu_copy(self.model.state_dict()),
                "optimizer": _cpu_copy(self.optimizer.state_dict())}

    def _load_weights(self, model: dict, optimizer: dict) -> None:
        self.model.load_state_dict(model)
        # torch keeps the given tensors as the live state: copy, so that restoring one state into
        # several learners (or training on after a restore) leaves the state and the others alone
        self.optimizer.load_state_dict(copy.deepcopy(optimizer))

    def load_state_dict(self, state: dict) -> None:
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"learner state version {state.get('version')!r} is not {STATE_VERSION}")
        if state["index"] != self.index:
            raise ValueError(f"state of learner {state['index']} loaded into learner {self.index}")
        if len(state["base"]) != len(self.fragments):
            raise ValueError("state has a different number of fragments")
        self._load_weights(state["model"], state["optimizer"])
        self.stream.load_state_dict(state["stream"])
        self.adopted_versions = {int(p): int(v) for p, v in state["adopted_versions"].items()}
        self.base = {
            int(p): {n: t.to(self.device).float().clone() for n, t in d.items()}
            for p, d in state["base"].items()
        }
        self._since = {int(p): [int(a), int(b)] for p, (a, b) in state["since"].items()}
        self.inner_steps = int(state["inner_steps"])
        self.tokens = int(state["tokens"])
        self.cycle_step = int(state["cycle_step"])
        self.work_size = int(state["work_size"])
        self._next_work_size = state["next_work_size"]
        same_incarnation = int(state["incarnation"]) == self.incarnation
        self.residual = {  # (states written before the sparse compressions hold none)
            int(p): {n: t.to(self.device).float().clone() for n, t in d.items()}
            for p, d in (state.get("residual") or {}).items()
        }
        self._pending = dict.fromkeys(range(len(self.fragments)))
        if same_incarnation:
            self._pending.update({int(p): (None if d is None else {n: tuple(e.clone() for e in v)
                                                                 for n, v in d.items()})
                                  for p, d in (state.get("pending") or {}).items()})
            self._sent = {
                int(p): (None if d is None else {n: t.to(self.device).float().clone() for n, t in d.items()})
                for p, d in state["sent"].items()
            }
            self._sent_counts = {int(p): [int(a), int(b)] for p, (a, b) in state["sent_counts"].items()}
            self._due = [Contribution.from_state(d) for d in state["due"]]
        else:
            # A new incarnation loaded as itself (LearnerLoop loads as the writer instead): nothing
            # is outstanding; the progress since the adopted base goes out with the next contribution.
            self._sent = dict.fromkeys(range(len(self.fragments)))
            self._sent_counts = {p: [0, 0] for p in range(len(self.fragments))}
            self._due = []
