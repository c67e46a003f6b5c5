"""How many inner steps make the demo job train for about N minutes on this machine.

A fixed budget is wrong everywhere: 60 steps end before a newcomer opens the page on a
laptop, and thousands take an hour on a busy one. So the demo times a few inner steps of
the job's model here, with one thread like a learner, and sizes `steps` for the slowest
slot the job will get (the demo pools throttle their learners by `speed_factor`).
"""
from __future__ import annotations

import time

# syncing, evaluation, checkpoints and the other processes sharing the CPU: measured against
# the bare step time on a 4-core laptop with the demo fleet, rounded up
OVERHEAD = 1.5
MAX_STEPS = 100_000


def measure_step_s(model: str, batch_size: int, seq_len: int, steps: int = 6) -> float:
    """Seconds per inner step (forward, backward, AdamW) of `model` on one CPU thread."""
    import torch

    from trainer.models import BYTE_VOCAB, build_model

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        net = build_model(model, seq_len=seq_len)
        opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
        x = torch.randint(0, BYTE_VOCAB, (batch_size, seq_len))
        y = torch.randint(0, BYTE_VOCAB, (batch_size, seq_len))

        def step() -> None:
            net.loss(x, y).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        step()  # first-call allocations
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        return (time.perf_counter() - t0) / steps
    finally:
        torch.set_num_threads(threads)


def sized_for(spec: dict, minutes: float, slot_speeds: list[float],
              step_s: float | None = None) -> tuple[dict, str]:
    """`spec` with `steps` (and the eval/checkpoint cadence) for about `minutes` of training,
    and a line saying so. `slot_speeds`: the fleet's slots, fastest first."""
    learners = int(spec.get("learners") or 1)
    batch, seq = int(spec.get("batch_size") or 16), int(spec.get("seq_len") or 64)
    if step_s is None:
        step_s = measure_step_s(str(spec.get("model") or "tiny"), batch, seq)
    used = slot_speeds[:learners] or [1.0]
    slowest = max(0.01, min(used))
    per_step = step_s / slowest * OVERHEAD
    steps = int(min(MAX_STEPS, max(int(spec.get("steps") or 1), minutes * 60 / per_step)))
    h, p = int(spec.get("inner_steps") or 20), int(spec.get("fragments") or 1)
    outer = steps * p / max(1, h)  # about one merge per fragment per round of H steps
    out = {**spec, "steps": steps,
           "eval_interval": max(int(spec.get("eval_interval") or 1), int(outer // 60)),
           "checkpoint_interval": max(int(spec.get("checkpoint_interval") or 1), int(outer // 12))}
    out["name"] = f"{spec.get('name') or 'demo'} ({minutes:g} min)"[:100]
    note = (f"one inner step of {spec.get('model', 'tiny')} takes {step_s * 1000:.0f} ms here; "
            f"{steps} steps per learner (slowest slot at {slowest:g}x) train for about {minutes:g} min")
    return out, note
