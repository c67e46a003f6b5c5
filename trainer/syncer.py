"""The syncer: global weights per fragment, the merge rule and the outer optimizer.

Merge rule for fragment p (see docs/engine.md for the full text):

1. Validation on `submit`: job, fragment range, duplicate key,
   base version not in the future, staleness bound, tensor names / shapes / dtypes,
   finite values, checksum. A rejected contribution leaves the state untouched and is
   counted in `rejections` by reason.
2. Quorum: p is merged once K contributions are pending, or at once when every expected
   learner has one pending.
3. Grace window: after the K-th arrival the syncer waits
       g = clamp(gamma * (tau * xi_step - xi_quorum - xi_sync), 0, grace_cap_s)
   where xi_step, xi_quorum, xi_sync are moving averages of the inner-step time (from the
   spacing of each learner's arrivals, or `observe`), the time from a round's first arrival
   to its quorum, and the transfer + merge time. It only waits within the slack the overlap
   of tau inner steps leaves, so learners never stall. `due(now)` lists fragments whose
   deadline has passed; arrivals after the merge wait for the next round.
4. Weights: w_m = tokens_m * (tokens_m / inner_steps_m) * 1 / (1 + d * s_m), where s_m is the
   staleness (current version - base version) and d = `staleness_discount`. Contributions with
   s_m > max_staleness are dropped, at submit and again at merge time.
5. Merged pseudo-gradient: sum_m w_m Delta_m / sum_m w_m; with `rda`, for non-embedding
   tensors, direction and magnitude are averaged apart:
       Delta = normalize(sum_m w_m Delta_m / ||Delta_m||) * sum_m w_m ||Delta_m|| / sum_m w_m.
   Each contributor record of the merge carries ||Delta_m|| (`norm`) and the cosine of Delta_m
   to the merged Delta (`cosine`, None when either is zero): contribution health.
6. Outer step: Nesterov SGD exactly as torch.optim.SGD(momentum=mu, nesterov=True,
   dampening=0): b <- mu b + Delta (b = Delta at the first step); theta <- theta - lr (Delta + mu b).
   With mu = 0: theta <- theta - lr Delta.

7. Publication: learners hold `published`, which is `params` itself when
   `global_compression` is none (they download full fp32 fragments). Otherwise each merge
   encodes the update `params - published` with that compression, adds its decoded form to
   `published` and keeps the bytes (`global_update(p)`): a learner holding version v - 1 adds
   them and holds the same bits; the rounding residual stays in `params - published` and goes
   out with the next update (error feedback). The last `UPDATE_HISTORY` updates of a fragment
   are kept (`global_updates(p, held)`): a learner a few versions behind adds them in order and
   holds the same bits, which costs less than the full fp32 fragment while the chain is short
   (int4: up to ~7 updates). Learners further behind download the full published fragment.

Idempotency: every applied key (learner, incarnation, fragment, base_version) is remembered
(keys that the staleness bound would refuse anyway are pruned), and `state_dict()` carries
them, so a syncer restored from a checkpoint never applies a contribution twice. Fencing is
not the engine's: its driver (`trainer.runtime.syncer_loop.SyncerLoop`: token ranges against
the successor's resume point) admits what counts and `withdraw()`s what its rule refuses later.

The module is over 500 lines because it is one rule: validation, rounds, weights, the outer
step, publication and state share the same per-fragment bookkeeping.
"""

from __future__ import annotations

import math
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from trainer.clock import Clock
from trainer.compression import checksum_matches, decode, nonfinite_index
from trainer.config import TrainConfig
from trainer.fragments import make_fragments
from trainer.fused import Combine, FragmentLayout, OuterStep, flat_copy, fused_merge
from trainer.models import set_flush_denormal
from trainer.protocol import Contribution, GlobalFragment

STATE_VERSION = 1
# compressed updates kept per fragment for learners a few versions behind (an int4 update is ~1/7
# of the fp32 fragment, so a longer chain would cost more than the fragment itself)
UPDATE_HISTORY = 8
EMBEDDING_HINTS = ("wte", "wpe", "embed", "emb.", "tok_emb", "pos_emb")


@dataclass
class SubmitResult:
    accepted: bool
    reason: str


class MergeResult:
    """What a merge did. `global_fragment` (a copy of the new published weights) is taken when
    first read, or by the syncer itself before the fragment changes again, so a caller that
    never reads it does not pay for copying the fragment."""

    def __init__(self, fragment: int, version: int, contributors: list[dict], merged_norm: float,
                 duration_s: float, take: Callable[[], GlobalFragment]) -> None:
        self.fragment = fragment
        self.version = version
        self.contributors = contributors
        self.merged_norm = merged_norm
        self.duration_s = duration_s
        self._take: Callable[[], GlobalFragment] | None = take
        self._global: GlobalFragment | None = None

    @property
    def global_fragment(self) -> GlobalFragment:
        self.settle()
        return self._global

    def settle(self) -> None:
        """Take the copy now (the syncer calls this before it changes the fragment)."""
        if self._take is not None:
            self._global, self._take = self._take(), None


@dataclass
class _Pending:
    contribution: Contribution
    arrived: float
    norms: list[float]  # per tensor, in fragment order, taken by the validation pass


@dataclass
class _Round:
    first_arrival: float | None = None
    quorum_at: float | None = None
    deadline: float | None = None
    pending: dict[tuple, _Pending] = field(default_factory=dict)


def is_embedding(name: str) -> bool:
    return any(h in name for h in EMBEDDING_HINTS)


class _Ema:
    def __init__(self, beta: float, value: float | None = None) -> None:
        self.beta = beta
        self.value = value

    def update(self, x: float) -> None:
        self.value = x if self.value is None else self.beta * self.value + (1 - self.beta) * x

    def get(self, default: float = 0.0) -> float:
        return default if self.value is None else self.value


class Syncer:
    def __init__(
        self,
        config: TrainConfig,
        initial: dict[str, torch.Tensor] | nn.Module,
        clock: Clock,
        job: str = "local",
    ) -> None:
        self.config = config
        self.clock = clock
        self.job = job
        set_flush_denormal(torch.device("cpu"), config.flush_denormal)  # the syncer runs on the CPU
        named = dict(initial.named_parameters()) if isinstance(initial, nn.Module) else dict(initial)
        self.fragments = make_fragments(named, config.fragments, config.fragment_mode)
        self.fragment_of = {n: p for p, names in enumerate(self.fragments) for n in names}
        # each fragment's weights (and momentum) are views of one flat buffer: the merge runs over
        # it in cache-sized chunks (trainer.fused)
        self._layouts = [FragmentLayout([named[n].shape for n in names]) for names in self.fragments]
        self.params: dict[str, torch.Tensor] = {}
        self._flat: list[torch.Tensor] = []
        self._set_params(named)
        self._mom_flat: dict[int, torch.Tensor] = {}
        # What learners hold: the params themselves, or (global_compression != none) the sum of the
        # compressed updates sent so far; the rounding residual stays in params - published and
        # goes out with the next update (error feedback).
        self.published: dict[str, torch.Tensor] = self._fresh_published()
        # fragment -> {version: encoded update from version - 1}, the newest UPDATE_HISTORY of them
        self.updates: dict[int, dict[int, bytes]] = {}
        self.momentum: dict[str, torch.Tensor] = {}
        self.versions: dict[int, int] = dict.fromkeys(range(len(self.fragments)), 0)
        self.applied: set[tuple] = set()
        self.expected_learners = config.learners
        self.rejections: dict[str, int] = {}
        self.merges = 0
        self._rounds: dict[int, _Round] = {p: _Round() for p in range(len(self.fragments))}
        self._acc: dict[int, torch.Tensor] = {}  # one merge buffer per fragment, reused
        self._unread: dict[int, weakref.ref[MergeResult]] = {}
        self._last_arrival: dict[tuple[int, int], float] = {}
        self.xi_step = _Ema(config.ema_beta)
        self.xi_quorum = _Ema(config.ema_beta)
        self.xi_sync = _Ema(config.ema_beta)

    # -- intake -----------------------------------------------------------------------------
    def _reject(self, reason: str) -> SubmitResult:
        kind = reason.split(":", 1)[0]
        self.rejections[kind] = self.rejections.get(kind, 0) + 1
        return SubmitResult(False, reason)

    def submit(self, c: Contribution, now: float | None = None) -> SubmitResult:
        now = self.clock.now() if now is None else now
        c.wait()  # a learner's copy to host memory may still be in flight
        reason = self._check_header(c)
        norms = None
        if reason is None:
            reason, norms = self._check_tensors(c)
        if reason is not None:
            return self._reject(reason)
        last = self._last_arrival.get((c.learner, c.fragment))
        if last is not None and now > last:
            self.xi_step.update((now - last) / c.inner_steps)
        self._last_arrival[(c.learner, c.fragment)] = now
        rnd = self._rounds[c.fragment]
        if rnd.first_arrival is None:
            rnd.first_arrival = now
        rnd.pending[c.key] = _Pending(c, now, norms)
        if rnd.quorum_at is None and len(rnd.pending) >= self.config.quorum:
            rnd.quorum_at = now
            self.xi_quorum.update(now - rnd.first_arrival)
            rnd.deadline = now + self.grace_window()
        return SubmitResult(True, "accepted")

    def _check_header(self, c: Contribution) -> str | None:
        """Why the contribution's identity and counts are refused (None: they are fine)."""
        if c.job != self.job:
            return f"wrong_job: {c.job!r} is not {self.job!r}"
        if not 0 <= c.fragment < len(self.fragments):
            return f"bad_fragment: {c.fragment}"
        if c.key in self.applied:
            return "duplicate: already applied"
        if c.key in self._rounds[c.fragment].pending:
            return "duplicate: already pending"
        version = self.versions[c.fragment]
        if c.base_version > version:
            return f"future: base version {c.base_version} > {version}"
        if version - c.base_version > self.config.max_staleness:
            return f"stale: {version - c.base_version} versions behind (max {self.config.max_staleness})"
        if c.tokens < 1 or c.inner_steps < 1:
            return "invalid: tokens and inner_steps must be >= 1"
        return None

    def _check_tensors(self, c: Contribution) -> tuple[str | None, list[float] | None]:
        """Names, shapes, dtypes, finiteness (one fused norm pass, whose per-tensor norms the
        merge reuses) and checksum; returns (why refused or None, the norms)."""
        names = self.fragments[c.fragment]
        if set(c.tensors) != set(names):
            return "invalid: tensor names do not match the fragment", None
        tensors = [c.tensors[n] for n in names]
        for n, t in zip(names, tensors, strict=True):
            want = self.params[n].shape
            if t.shape != want:
                return f"invalid: {n} has shape {tuple(t.shape)}, expected {tuple(want)}", None
            if t.dtype != torch.float32:
                return f"invalid: {n} has dtype {t.dtype}, expected float32", None
        norms = torch._foreach_norm(tensors)
        bad = nonfinite_index(tensors, norms)
        if bad is not None:
            return f"nonfinite: {names[bad]} holds NaN or Inf", None
        if not checksum_matches(c.tensors, c.checksum):
            return "checksum: payload does not match its checksum", None
        return None, torch.stack(norms).tolist()

    def withdraw(self, key: tuple) -> bool:
        """Take a pending contribution back out (the driver's fencing refused it after all)."""
        rnd = self._rounds.get(key[2])  # key: (learner, incarnation, fragment, base_version)
        if rnd is None or key not in rnd.pending:
            return False
        del rnd.pending[key]
        self._recheck_quorum(rnd)
        return True

    def _recheck_quorum(self, rnd: _Round) -> None:
        if not rnd.pending:
            rnd.first_arrival = rnd.quorum_at = rnd.deadline = None
        elif len(rnd.pending) < self.config.quorum:
            rnd.quorum_at = rnd.deadline = None

    def observe(self, step_time: float | None = None, transfer_time: float | None = None) -> None:
        """Timing measured elsewhere (the runtime): inner-step time, transfer time."""
        if step_time is not None and step_time >= 0:
            self.xi_step.update(step_time)
        if transfer_time is not None and transfer_time >= 0:
            self.xi_sync.update(transfer_time)

    # -- merge rule -------------------------------------------------------------------------
    def grace_window(self) -> float:
        c = self.config
        slack = c.tau * self.xi_step.get() - self.xi_quorum.get() - self.xi_sync.get()
        return min(max(c.grace_gamma * slack, 0.0), c.grace_cap_s)

    def pending_count(self, fragment: int) -> int:
        return len(self._rounds[fragment].pending)

    def deadline(self, fragment: int) -> float | None:
        return self._rounds[fragment].deadline

    def due(self, now: float | None = None) -> list[int]:
        now = self.clock.now() if now is None else now
        out = []
        for p, rnd in self._rounds.items():
            if rnd.quorum_at is None:
                continue
            learners = {k[0] for k in rnd.pending}
            if len(learners) >= self.expected_learners or (rnd.deadline is not None and now >= rnd.deadline):
                out.append(p)
        return out

    def weight(self, c: Contribution, version: int) -> float:
        staleness = version - c.base_version
        return c.tokens * (c.tokens / c.inner_steps) / (1.0 + self.config.staleness_discount * staleness)

    @torch.no_grad()
    def merge(self, fragment: int, force: bool = False) -> MergeResult:
        """Merge the pending contributions of `fragment` (quorum needed unless `force`)."""
        t0 = time.perf_counter()
        rnd = self._rounds[fragment]
        version = self.versions[fragment]
        entries = self._mergeable(fragment, version, force)
        self._settle([fragment])
        weights = [self.weight(e.contribution, version) for e in entries]
        total = sum(weights)
        norm_w = [w / total for w in weights]
        names = self.fragments[fragment]
        deltas = [[e.contribution.tensors[n] for n in names] for e in entries]
        acc = self._acc.get(fragment)
        if acc is None:
            acc = self._acc[fragment] = torch.empty(self._layouts[fragment].numel)
        if self.final(version):  # the run's last merges: the plain mean of the learners' models
            combine, step = Combine(alpha=norm_w), OuterStep(1.0, 0.0, None)
        else:
            combine, step = self._combine_rule(names, entries, norm_w), self._step_rule(fragment, version)
        merged_norms, dots = fused_merge(self._layouts[fragment], deltas, combine, acc, self._flat[fragment],
                                         step)
        merged_norm = math.sqrt(sum(x * x for x in merged_norms))
        new_version = version + 1
        self.versions[fragment] = new_version
        self._publish(fragment, version, new_version)
        contributors = []
        for e, w, dot in zip(entries, norm_w, dots, strict=True):
            c = e.contribution
            norm, cosine = self._health(e.norms, dot, merged_norm)
            self.applied.add(c.key)
            contributors.append(
                {
                    "learner": c.learner,
                    "incarnation": c.incarnation,
                    "base_version": c.base_version,
                    "staleness": version - c.base_version,
                    "tokens": c.tokens,
                    "inner_steps": c.inner_steps,
                    "weight": w,
                    "norm": norm,
                    "cosine": cosine,
                }
            )
        self._prune(fragment)
        rnd.pending.clear()
        rnd.first_arrival = rnd.quorum_at = rnd.deadline = None
        duration = time.perf_counter() - t0
        self.xi_sync.update(duration)
        self.merges += 1
        result = MergeResult(
            fragment=fragment,
            version=new_version,
            contributors=contributors,
            merged_norm=merged_norm,
            duration_s=duration,
            take=lambda: self.global_fragment(fragment),
        )
        self._unread[fragment] = weakref.ref(result)
        return result

    def _settle(self, fragments: list[int]) -> None:
        """Let the merge results still alive and unread copy their fragment before it changes."""
        for p in fragments:
            ref = self._unread.pop(p, None)
            result = ref() if ref is not None else None
            if result is not None:
                result.settle()

    def _mergeable(self, fragment: int, version: int, force: bool) -> list[_Pending]:
        """The pending contributions the staleness bound still admits, in key order."""
        rnd = self._rounds[fragment]
        entries = [
            e
            for e in rnd.pending.values()
            if version - e.contribution.base_version <= self.config.max_staleness
        ]
        dropped = len(rnd.pending) - len(entries)
        if dropped:
            self.rejections["stale"] = self.rejections.get("stale", 0) + dropped
        if not entries:
            raise ValueError(f"fragment {fragment}: nothing to merge")
        if not force and len(entries) < self.config.quorum:
            raise ValueError(
                f"fragment {fragment}: {len(entries)} contributions, quorum is {self.config.quorum}"
            )
        entries.sort(key=lambda e: e.contribution.key)
        return entries

    @staticmethod
    def _health(norms: list[float], dot: float, merged_norm: float) -> tuple:
        """(L2 norm of one contribution's pseudo-gradient, its cosine to the merged one; None when
        either is zero) over the fragment's tensors."""
        norm = math.sqrt(sum(x * x for x in norms))
        if norm == 0 or merged_norm == 0:
            return norm, None
        return norm, max(-1.0, min(1.0, dot / (norm * merged_norm)))

    def _combine_rule(self, names: list[str], entries: list[_Pending], w: list[float]) -> Combine:
        """Token-weighted mean; with `rda`, non-embedding tensors average direction and magnitude
        apart (the norms come from the validation pass)."""
        if not self.config.rda:
            return Combine(alpha=w)
        embedding = [is_embedding(n) for n in names]
        alpha = [
            [wm if emb else (wm / nm if nm > 0 else 0.0) for emb, nm in zip(embedding, e.norms, strict=True)]
            for wm, e in zip(w, entries, strict=True)
        ]
        magnitude = [0.0] * len(names)
        for wm, e in zip(w, entries, strict=True):
            for i, nm in enumerate(e.norms):
                if nm > 0:
                    magnitude[i] += wm * nm
        return Combine(alpha=alpha, magnitude=magnitude, embedding=embedding)

    def _step_rule(self, fragment: int, step: int) -> OuterStep:
        lr, mu = self.config.outer_lr, self.momentum_at(step)
        if self.config.outer_momentum == 0:
            return OuterStep(lr, mu, None)
        momentum = self._mom_flat.get(fragment)
        if momentum is not None:
            return OuterStep(lr, mu, momentum)
        momentum = self._mom_flat[fragment] = torch.empty(self._layouts[fragment].numel)
        views = self._layouts[fragment].views(momentum)
        self.momentum.update(zip(self.fragments[fragment], views, strict=True))
        return OuterStep(lr, mu, momentum, fresh=True)

    def _set_params(self, named: dict[str, torch.Tensor]) -> None:
        self._flat = []
        for names in self.fragments:
            flat, views = flat_copy([named[n] for n in names])
            self._flat.append(flat)
            self.params.update(zip(names, views, strict=True))

    def _set_momentum(self, momentum: dict[str, torch.Tensor]) -> None:
        self.momentum, self._mom_flat = {}, {}
        for p, names in enumerate(self.fragments):
            held = [n in momentum for n in names]
            if not any(held):
                continue
            if not all(held):
                raise ValueError(f"syncer state holds momentum for part of fragment {p}")
            self._mom_flat[p], views = flat_copy([momentum[n] for n in names])
            self.momentum.update(zip(names, views, strict=True))

    def final(self, step: int) -> bool:
        """Whether the fragment's `step`-th merge comes after the run's budget of outer steps and
        `final_average` makes it the plain token-weighted mean of the learners' models (outer lr 1,
        no momentum, no RDA): the mean of models trained to the end of the inner schedule learns
        better than one more outer step towards it (docs/engine.md, "Defaults")."""
        return self.config.final_average and step >= self.config.steps // self.config.inner_steps

    def momentum_at(self, step: int) -> float:
        """Outer momentum for the fragment's `step`-th outer step (0-based): ramped up linearly
        over `outer_momentum_warmup` steps, so the first, large and noisy pseudo-gradients of a
        run from scratch are not carried on for dozens of steps; with `outer_momentum_decay` D,
        it falls linearly to 0 over the run's last D outer steps (Pier), so the last merges are
        not pushed on by momentum the run has no steps left to correct."""
        mu, warm = self.config.outer_momentum, self.config.outer_momentum_warmup
        if warm > 0:
            mu *= min(1.0, step / warm)
        decay = self.config.outer_momentum_decay
        if decay > 0:
            left = self.config.steps // self.config.inner_steps - step
            mu *= max(0.0, min(1.0, left / decay))
        return mu

    def _prune(self, fragment: int) -> None:
        floor = self.versions[fragment] - self.config.max_staleness
        self.applied = {k for k in self.applied if k[2] != fragment or k[3] >= floor}

    def _fresh_published(self) -> dict[str, torch.Tensor]:
        if self.config.global_compression == "none":
            return self.params  # the same tensors: what learners hold is exactly the global
        return {n: t.clone() for n, t in self.params.items()}

    def _publish(self, fragment: int, old_version: int, new_version: int) -> None:
        """Encode the update old -> new version of a fragment and apply its decoded form to the
        published weights, so that learners adding the same bytes hold the same bits."""
        method = self.config.global_compression
        if method == "none":
            return
        names = self.fragments[fragment]
        change = {n: self.params[n] - self.published[n] for n in names}
        update = GlobalFragment(self.job, fragment, new_version, change, base_version=old_version)
        blob = update.to_bytes(method, density=self.config.compression_density)
        for n, t in decode(blob).items():
            self.published[n].add_(t.float())
        history = self.updates.setdefault(fragment, {})
        history[new_version] = blob
        for v in [v for v in history if v <= new_version - UPDATE_HISTORY]:
            del history[v]

    # -- views ------------------------------------------------------------------------------
    def global_fragment(self, p: int) -> GlobalFragment:
        """The published weights of fragment p at its current version (full, fp32)."""
        return GlobalFragment(
            job=self.job,
            fragment=p,
            version=self.versions[p],
            tensors={n: self.published[n].clone() for n in self.fragments[p]},
        )

    def global_update(self, p: int) -> bytes | None:
        """The encoded update from version v - 1 to the current version v of fragment p, for a
        learner that holds v - 1 (None when global_compression is none or nothing was merged)."""
        return self.updates.get(p, {}).get(self.versions[p])

    def global_updates(self, p: int, held: int) -> list[bytes] | None:
        """The encoded updates that take a learner holding version `held` of fragment p to the
        current version, oldest first; None when one of them is no longer kept (or there are
        none: global_compression is none, or the learner is current)."""
        current = self.versions[p]
        history = self.updates.get(p, {})
        if held >= current or any(v not in history for v in range(held + 1, current + 1)):
            return None
        return [history[v] for v in range(held + 1, current + 1)]

    def global_state(self) -> dict[str, torch.Tensor]:
        return {n: t.clone() for n, t in self.params.items()}

    def expected_shapes(self, p: int) -> dict[str, tuple]:
        return {n: tuple(self.params[n].shape) for n in self.fragments[p]}

    def set_expected_learners(self, n: int) -> None:
        """How many learners are live (a round with all of them pending merges at once)."""
        self.expected_learners = max(1, int(n))

    # -- state ------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {
            "version": STATE_VERSION,
            "job": self.job,
            "params": {n: t.clone() for n, t in self.params.items()},
            "momentum": {n: t.clone() for n, t in self.momentum.items()},
            "versions": dict(self.versions),
            "applied": sorted(self.applied),
            "rejections": dict(self.rejections),
            "merges": self.merges,
            "ema": [self.xi_step.value, self.xi_quorum.value, self.xi_sync.value],
            "expected_learners": self.expected_learners,
            "published": (
                None if self.published is self.params else {n: t.clone() for n, t in self.published.items()}
            ),
            "updates": {
                p: {v: torch.frombuffer(bytearray(b), dtype=torch.uint8) for v, b in history.items()}
                for p, history in self.updates.items()
            },
            "pending": [
                e.contribution.to_state(arrived=e.arrived)
                for rnd in self._rounds.values()
                for e in rnd.pending.values()
            ],
        }

    def load_state_dict(self, state: dict) -> None:
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"syncer state version {state.get('version')!r} is not {STATE_VERSION}")
        if set(state["params"]) != set(self.params):
            raise ValueError("syncer state holds different parameters")
        self._settle(list(range(len(self.fragments))))
        self.params = {}
        self._set_params(state["params"])
        self._set_momentum(state["momentum"])
        self.versions = {int(p): int(v) for p, v in state["versions"].items()}
        self.applied = {tuple(int(x) for x in k) for k in state["applied"]}
        # (states written before issue 36 also hold "incarnations", which nothing read: ignored)
        self.rejections = dict(state["rejections"])
        self.merges = int(state["merges"])
        self.xi_step.value, self.xi_quorum.value, self.xi_sync.value = state["ema"]
        self.expected_learners = int(state["expected_learners"])
        published = state.get("published")
        if self.config.global_compression == "none" or published is None:
            self.published = self._fresh_published()
        else:
            self.published = {n: t.float().clone() for n, t in published.items()}
        self.updates = {}
        if self.config.global_compression != "none":
            for p, history in (state.get("updates") or {}).items():
                if isinstance(history, torch.Tensor):  # written before the history: the newest only
                    history = {self.versions[int(p)]: history}
                self.updates[int(p)] = {int(v): t.numpy().tobytes() for v, t in history.items()}
        self._rounds = {p: _Round() for p in range(len(self.fragments))}
        self._last_arrival = {}
        for d in state["pending"]:
            self.submit(Contribution.from_state(d), now=d["arrived"])
