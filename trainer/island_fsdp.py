"""FSDP2 islands (`inner_parallelism: fsdp`): each rank of a learner holds a shard of its weights.

The model runs under `torch.distributed.fsdp.fully_shard` (one unit per transformer block and
one for the whole loss), so every parameter, gradient and AdamW moment is a DTensor cut along
its first dimension, rank r holding rows [r c, (r+1) c) with c = ceil(rows / W). The inner step
is FSDP's own (all-gather before use, reduce-scatter of the gradients).

The protocol stays whole-tensor and on rank 0, as for DDP islands: **rank 0 gathers**. When it
contributes a fragment it gathers the fragment's shards (one flat `gather` to rank 0: the other
ranks receive nothing), computes the pseudo-gradient once and sends it, so exactly-once
accounting and fencing are the learner's, unchanged. Rank 0 keeps the fragment bases whole (the
protocol's), every rank keeps its shard of them (the proximal pull of the inner step).
Why not each rank sending its own shard: see docs/runtime.md ("FSDP2"), measured.

Every collective a follower joins outside FSDP's own step is announced by rank 0 with a
3-integer command (op, argument, bytes), so a follower is always either inside a step or waiting
for the next command, and the two sides can never call different collectives:
  STEP    run one inner step            LOSS   average the step's loss over the ranks
  GATHER  fragment `arg` to rank 0      SET    fragment `arg`'s weights and base from rank 0
  STATE   whole weights and moments     LOAD   a learner state of `bytes` bytes (resume)
  STOP    leave
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor

from trainer.island import IslandLearner, _Loss
from trainer.learner import Learner, StepResult
from trainer.optimizers import make_optimizer
from trainer.protocol import GlobalFragment

STOP, STEP, LOSS, GATHER, SET, STATE, LOAD = range(7)


def shard_rows(rows: int, world: int) -> list[tuple[int, int]]:
    """(first row, rows) of each rank's shard of a tensor of `rows` rows, as FSDP2 cuts it
    (torch.chunk: ceil(rows / world) each, the last ranks short or empty)."""
    size = -(-rows // world)
    return [(min(r * size, rows), max(0, min(size, rows - r * size))) for r in range(world)]


class ShardedIsland(IslandLearner):
    """One rank of an FSDP2 island; the leader drives the followers with commands (module doc)."""

    parallelism = "fsdp"

    # ------------------------------------------------------------------ setup
    def _wrap(self) -> None:
        if self.config.inner_optimizer == "muon":  # the spec refuses it; the engine CLI too
            raise ValueError("inner_optimizer muon orthogonalises whole matrices; fsdp shards them: use ddp")
        group = self.group if self.group is not None else dist.group.WORLD
        mesh = DeviceMesh.from_group(group, self.device.type)
        root = _Loss(self.model)
        for block in getattr(self.model, "blocks", ()):
            fully_shard(block, mesh=mesh)
        fully_shard(root, mesh=mesh)  # the root's forward is the loss: its hooks run on every step
        self.forward_loss = root
        # fully_shard replaced the parameters by DTensors: the engine's views follow
        self.params = dict(self.model.named_parameters())
        self._param_list = [self.params[n] for names in self.fragments for n in names]
        self.optimizer = make_optimizer(self.model, self.config, self.device)
        self._rows = {n: shard_rows(p.shape[0], self.world) for n, p in self.params.items()}
        for n, p in self.params.items():
            if tuple(p.to_local().shape[:1]) != (self._rows[n][self.rank][1],):
                raise RuntimeError(f"FSDP cut {n} otherwise than expected ({tuple(p.to_local().shape)})")
        self._base_local: dict[int, dict[str, torch.Tensor]] = {}
        self._keep_base()

    def _mine(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's rows of a whole tensor."""
        first, rows = shard_rows(full.shape[0], self.world)[self.rank]
        return full.narrow(0, first, rows)

    def _keep_base(self) -> None:
        """This rank's shard of every fragment base; only the leader keeps them whole."""
        self._base_local = {p: {n: self._mine(t).clone() for n, t in d.items()} for p, d in self.base.items()}
        if not self.is_leader:
            self.base = {p: {} for p in self.base}

    # ------------------------------------------------------------------ commands
    def _send(self, op: int, arg: int = 0, nbytes: int = 0) -> None:
        self._bcast(torch.tensor([op, arg, nbytes], dtype=torch.int64, device=self.comm))

    def _receive(self) -> tuple[int, int, int]:
        head = self._bcast(torch.zeros(3, dtype=torch.int64, device=self.comm))
        op, arg, nbytes = (int(v) for v in head.tolist())
        return op, arg, nbytes

    def follow(self) -> int:
        steps = 0
        while True:
            op, arg, nbytes = self._receive()
            if op == STOP:
                return steps
            if op == STEP:
                Learner.step(self)
                steps += 1
            elif op == LOSS:
                self._mean_loss(self.last_loss)
            elif op == GATHER:
                self._gather(self.fragments[arg])
            elif op == SET:
                self._set_fragment(arg, None)
            elif op == STATE:
                self._full_weights()
            elif op == LOAD:
                self._load_blob(nbytes, None)
            else:
                raise RuntimeError(f"unknown island command {op}")

    def stop_followers(self) -> None:
        if self.is_leader and not self.closed:
            self.closed = True
            self._send(STOP)

    # ------------------------------------------------------------------ steps
    def step(self) -> StepResult:
        self._send(STEP)
        res = Learner.step(self)  # may gather fragments to contribute (GATHER commands)
        self._send(LOSS)
        self.last_loss = self._mean_loss(res.loss)
        return StepResult(loss=self.last_loss, tokens=res.tokens, step=res.step)

    def _mean_loss(self, loss: float) -> float:
        t = torch.tensor([loss], dtype=torch.float64, device=self.comm)
        dist.all_reduce(t, group=self.group)
        return float(t.item()) / self.world

    @torch.no_grad()
    def _pull_towards_base(self, rate: float) -> None:
        local = [self.params[n].to_local() for names in self.fragments for n in names]
        base = [self._base_local[p][n] for p, names in enumerate(self.fragments) for n in names]
        if any(b.dtype != x.dtype for b, x in zip(base, local, strict=True)):
            base = [b.to(x.dtype) for b, x in zip(base, local, strict=True)]
        torch._foreach_lerp_(local, base, rate)

    # ------------------------------------------------------------------ fragments
    @torch.no_grad()
    def _gather(self, names: list[str]) -> dict[str, torch.Tensor] | None:
        """The named parameters whole, in fp32, on the leader (None on the others): one flat
        gather of every rank's shards, padded to the longest."""
        def numel(n: str, r: int) -> int:
            shape = self.params[n].shape
            return self._rows[n][r][1] * (shape[1:].numel() if len(shape) > 1 else 1)

        sizes = [sum(numel(n, r) for n in names) for r in range(self.world)]
        flat = torch.zeros(max(sizes), dtype=torch.float32, device=self.comm)
        mine = [self.params[n].to_local().reshape(-1).float() for n in names]
        if mine:
            flat[:sizes[self.rank]].copy_(torch.cat(mine))
        if not self.is_leader:
            dist.gather(flat, dst=self.leader, group=self.group)
            return None
        parts = [torch.empty_like(flat) for _ in range(self.world)]
        dist.gather(flat, gather_list=parts, dst=self.leader, group=self.group)
        out, offsets = {}, [0] * self.world
        for n in names:
            shape = self.params[n].shape
            pieces = []
            for r in range(self.world):
                k = numel(n, r)
                pieces.append(parts[r][offsets[r]:offsets[r] + k].view(-1, *shape[1:]))
                offsets[r] += k
            out[n] = torch.cat(pieces).to(self.device)
        return out

    def _gather_fragment(self, p: int) -> dict[str, torch.Tensor]:
        self._send(GATHER, p)
        return self._gather(self.fragments[p])

    @torch.no_grad()
    def _snapshot(self, p: int) -> list[torch.Tensor]:
        whole = self._gather_fragment(p)
        names = self.fragments[p]
        snap = self._snapshots.get(p)
        if snap is None:
            snap = self._snapshots[p] = [torch.empty(self.params[n].shape, dtype=torch.float32,
                                                     device=self.device) for n in names]
        torch._foreach_copy_(snap, [whole[n] for n in names])
        return snap

    @torch.no_grad()
    def adopt(self, g: GlobalFragment) -> bool:
        """Learner.adopt on the fragment's whole weights (gathered), then every rank takes its
        shard of the result and of the new base."""
        p = g.fragment
        if not 0 <= p < len(self.fragments) or g.version <= self.adopted_versions[p]:
            return Learner.adopt(self, g)  # refused, or not newer: nothing to gather
        names = self.fragments[p]
        whole = self._gather_fragment(p)
        live = {n: self.params[n] for n in names}
        self.params.update(whole)
        try:
            changed = Learner.adopt(self, g)
        finally:
            self.params.update(live)
        if changed:
            self._send(SET, p)
            self._set_fragment(p, whole)
        return changed

    @torch.no_grad()
    def _set_fragment(self, p: int, whole: dict[str, torch.Tensor] | None) -> None:
        """The leader's weights (`whole`, as adopted) and base of fragment p: each rank keeps its shard."""
        names = self.fragments[p]
        if self.is_leader:
            tensors = [whole[n] for n in names] + [self.base[p][n] for n in names]
            flat = torch.cat([t.reshape(-1).float() for t in tensors]).to(self.comm)
        else:
            flat = torch.empty(2 * sum(self.params[n].numel() for n in names), dtype=torch.float32,
                               device=self.comm)
        self._bcast(flat)
        off = 0
        for target in ("param", "base"):
            for n in names:
                shape = self.params[n].shape
                full = flat[off:off + shape.numel()].view(shape)
                off += shape.numel()
                dst = self.params[n].to_local() if target == "param" else self._base_local[p][n]
                dst.copy_(self._mine(full).to(dst.device, dst.dtype))

    # ------------------------------------------------------------------ state
    def _weights_state(self) -> dict:
        """Whole weights and moments, gathered (checkpoints: rare); the same dicts a one-device
        learner writes, so its checkpoints read alike."""
        self._send(STATE)
        return self._full_weights()

    @torch.no_grad()
    def _full_weights(self) -> dict:
        def whole(v):
            if isinstance(v, DTensor):
                v = v.full_tensor()  # a collective: every rank, in the same order
                return v.detach().cpu().clone() if self.is_leader else None
            return v.detach().cpu().clone() if isinstance(v, torch.Tensor) else v

        model = {k: whole(v) for k, v in self.model.state_dict().items()}
        opt = self.optimizer.state_dict()
        opt["state"] = {i: {k: whole(v) for k, v in s.items()} for i, s in opt["state"].items()}
        return {"model": model, "optimizer": opt}

    def load_state_dict(self, state: dict) -> None:
        """Resume: the leader sends the whole state to its followers, every rank keeps its shards."""
        from trainer.runtime import codec

        blob = codec.pack(state)
        self._send(LOAD, 0, len(blob))
        self._load_blob(len(blob), blob)

    def _load_blob(self, nbytes: int, blob: bytes | None) -> None:
        if self.is_leader:
            buf = torch.frombuffer(bytearray(blob), dtype=torch.uint8).to(self.comm)
        else:
            buf = torch.empty(nbytes, dtype=torch.uint8, device=self.comm)
        self._bcast(buf)
        if self.is_leader:
            from trainer.runtime import codec

            Learner.load_state_dict(self, codec.unpack(blob))
        else:
            self._load_bytes(bytes(buf.cpu().numpy().tobytes()))
        self._keep_base()

    @torch.no_grad()
    def _load_weights(self, model: dict, optimizer: dict) -> None:
        own = self.model.state_dict()
        if set(own) != set(model):
            raise ValueError("checkpoint's model does not match this model's parameters")
        for k, v in own.items():
            src = model[k].to(self.device)
            if isinstance(v, DTensor):
                v.to_local().copy_(self._mine(src).to(v.dtype))
            else:
                v.copy_(src)
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        state = {}
        for i, s in optimizer["state"].items():
            param = params[int(i)]
            state[i] = {k: self._shard_like(param, v) for k, v in s.items()}
        self.optimizer.load_state_dict({**optimizer, "state": state})

    def _shard_like(self, param, value):
        if isinstance(param, DTensor) and isinstance(value, torch.Tensor) and value.shape == param.shape \
                and value.dim() > 0:
            return distribute_tensor(value.to(self.device), param.device_mesh, param.placements,
                                     src_data_rank=None)  # every rank has it whole: no communication
        return value
