"""The syncer's merge as one cache-blocked pass over memory.

A merge reads K pseudo-gradients and writes the merged update, the momentum and the weights.
Done op by op over whole tensors that is about 3K + 6 passes over memory (combine, norms,
cosines, the Nesterov step), so it ran at a fifth of a bare `add_`. Here a fragment lives in
one flat buffer (the syncer's weights and momentum are views of it) and is cut into chunks of
whole tensors of about 1 MiB: every step (copy the K chunks into a reused scratch, combine,
per-tensor norms, the K dot products with the merged update, the outer step) runs on a chunk
while it is in cache, with fused `torch._foreach_*` and flat ops, then the next chunk is read.

Element by element the operations and their order are those of the plain form (the weighted
mean `d_0 w_0 + w_1 d_1 + ...`; torch.optim.SGD's Nesterov step), so the weights come out with
the same bits.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch

from trainer import merge_native

# elements per chunk: K scratch rows + the update + weights + momentum of a chunk stay in cache
CHUNK_ELEMENTS = 1 << 18


def flat_copy(tensors: list[torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One contiguous fp32 buffer holding copies of `tensors`, and a view of it per tensor."""
    flat = torch.empty(sum(t.numel() for t in tensors), dtype=torch.float32)
    views = _views(flat, [t.shape for t in tensors])
    torch._foreach_copy_(views, [t.detach().float() for t in tensors])
    return flat, views


def _views(flat: torch.Tensor, shapes: list[torch.Size]) -> list[torch.Tensor]:
    views, off = [], 0
    for shape in shapes:
        n = math.prod(shape)
        views.append(flat[off:off + n].view(shape))
        off += n
    return views


@dataclass
class Combine:
    """How the K contributions make the merged update of each tensor.

    `alpha[m]` is one weight per contribution (the plain weighted mean) or, with RDA, one per
    contribution and tensor (w_m / ||d_m,i||; w_m for embeddings). With `magnitude` (RDA), each
    non-embedding tensor's direction is rescaled to magnitude[i] (`embedding[i]` false)."""

    alpha: list[float] | list[list[float]]
    magnitude: list[float] | None = None
    embedding: list[bool] | None = None


@dataclass
class OuterStep:
    """theta -= lr * (g + mu b), b = mu b + g (`momentum` None: theta -= lr g; `fresh`: b = g)."""

    lr: float
    mu: float
    momentum: torch.Tensor | None
    fresh: bool = False


class FragmentLayout:
    """The chunks of one fragment's flat buffer and the scratch reused by its merges."""

    def __init__(self, shapes: list[torch.Size], chunk: int = CHUNK_ELEMENTS) -> None:
        self.shapes = [torch.Size(s) for s in shapes]
        sizes = [math.prod(s) for s in self.shapes]
        self.numel = sum(sizes)
        ends = list(itertools.accumulate(sizes))
        self.offsets = [(e - n, e) for n, e in zip(sizes, ends, strict=True)]  # each tensor's slice
        self.chunks: list[tuple[int, int, int, int]] = []  # first tensor, end tensor, start, end
        first, start, off = 0, 0, 0
        for i, n in enumerate(sizes):
            if off + n - start > chunk and i > first:
                self.chunks.append((first, i, start, off))
                first, start = i, off
            off += n
        self.chunks.append((first, len(sizes), start, off))
        self.widest = max(e - s for _, _, s, e in self.chunks)
        self._scratch: dict[int, tuple[torch.Tensor, list[list[list[torch.Tensor]]]]] = {}

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        return _views(flat, self.shapes)

    def scratch(self, k: int) -> tuple[torch.Tensor, list[list[list[torch.Tensor]]]]:
        """A [k, widest chunk] buffer and, per chunk and row, views shaped like the chunk's tensors."""
        if k not in self._scratch:
            buf = torch.empty(k, self.widest, dtype=torch.float32)
            per_chunk = [
                [_views(buf[m, : e - s], self.shapes[i:j]) for m in range(k)]
                for i, j, s, e in self.chunks
            ]
            self._scratch = {k: (buf, per_chunk)}  # one size at a time: K rarely changes
        return self._scratch[k]


@torch.no_grad()
def fused_merge(
    layout: FragmentLayout,
    deltas: list[list[torch.Tensor]],
    combine: Combine,
    acc: torch.Tensor,
    params: torch.Tensor,
    step: OuterStep,
) -> tuple[list[float], list[float]]:
    """Merge `deltas` (K lists of the fragment's tensors) into `acc` (flat), apply the outer
    step to `params` (flat) and return (per-tensor norms of the merged update, the dot product
    of each contribution with it), both taken before the step consumes `acc`.

    Runs as two C passes per tensor (`trainer.merge_native`) where that kernel is built and the
    contributions are contiguous fp32; otherwise op by op, chunk by chunk, below."""
    lib = merge_native.kernel()
    if lib is not None and all(merge_native.usable(t) for d in deltas for t in d):
        n = len(layout.shapes)
        alpha = [[a if isinstance(a, float | int) else a[i] for a in combine.alpha] for i in range(n)]
        return merge_native.native_merge(
            lib, layout.offsets, deltas, alpha, combine.magnitude, combine.embedding,
            acc, params, step.momentum, step.lr, step.mu, step.fresh,
        )
    k = len(deltas)
    buf, rows = layout.scratch(k)
    acc_views = layout.views(acc)
    norms: list[float] = []
    dots = torch.zeros(k, dtype=torch.float64)
    for c, (i, j, s, e) in enumerate(layout.chunks):
        for m in range(k):
            torch._foreach_copy_(rows[c][m], deltas[m][i:j])
        width = e - s
        norms += _combine_chunk(combine, rows[c], buf[:, :width], acc_views[i:j], acc[s:e], i, j)
        dots.add_(torch.mv(buf[:, :width], acc[s:e]))
        _step_chunk(step, acc[s:e], params[s:e], s, e)
    return norms, dots.tolist()


def _combine_chunk(
    combine: Combine,
    rows: list[list[torch.Tensor]],
    flat_rows: torch.Tensor,
    acc_views: list[torch.Tensor],
    acc: torch.Tensor,
    i: int,
    j: int,
) -> list[float]:
    """The merged update of one chunk into `acc`; returns its per-tensor norms."""
    if combine.magnitude is None:  # the plain weighted mean, in the op order of the plain form
        w = combine.alpha
        torch.mul(flat_rows[0], w[0], out=acc)
        for m in range(1, len(w)):
            acc.add_(flat_rows[m], alpha=w[m])
        return torch.stack(torch._foreach_norm(acc_views)).tolist()
    acc.zero_()
    one = torch.ones(())
    ones = [one] * (j - i)
    for m, alpha in enumerate(combine.alpha):
        torch._foreach_addcmul_(acc_views, rows[m], ones, alpha[i:j])
    direction = torch.stack(torch._foreach_norm(acc_views)).tolist()
    scale = [
        1.0 if emb or dn == 0 else mag / dn
        for emb, dn, mag in zip(combine.embedding[i:j], direction, combine.magnitude[i:j], strict=True)
    ]
    torch._foreach_mul_(acc_views, scale)
    return [dn * abs(x) for dn, x in zip(direction, scale, strict=True)]  # ||scale * direction||


def _step_chunk(step: OuterStep, g: torch.Tensor, theta: torch.Tensor, s: int, e: int) -> None:
    if step.momentum is not None:
        b = step.momentum[s:e]
        if step.fresh:
            b.copy_(g)
        else:
            b.mul_(step.mu).add_(g)
        g.add_(b, alpha=step.mu)  # g + mu b, the op order of torch.optim.SGD
    theta.add_(g, alpha=-step.lr)
