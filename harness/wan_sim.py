"""The simulator configured as the WAN benchmark's fleet: three one-device pools whose inner step
takes the measured time, links at the shaped rate, the same model, budget and strategies. Its
figures are a model-based estimate, printed beside the measured ones, never mixed with them.

What it leaves out (so where the two differ, look here first): the pools share this machine's two
cores (a measured step is slower while another learner steps); TCP and tbf (the simulator's link is
a FIFO at the nominal rate with no header overhead or slow start); the platform's own latencies
(Celery dispatch, heartbeats, the syncer's database commits, evaluation on the syncer's core).
"""
from __future__ import annotations

from dataclasses import replace

from trainer.config import TrainConfig
from trainer.models import build_model, param_count
from trainer.sim.fleet import DeclaredModel, PoolProfile
from trainer.sim.runner import SimSpec, run_strategy

SITES = ("s1", "s2", "s3")
ACCELERATOR = "cpu"  # the catalogue's CPU entry; speed_factor makes its step the measured one


def simulate(mbit: float, step_time_s: float, steps: int, seed: int,
             inner_steps: int = 20) -> dict[str, dict]:
    """ddp (the data-parallel baseline: gradients all-reduced each step), diloco and decoupled on
    the fleet; each row has time_to_target_s (to ddp's final loss x 1.01), bytes_per_token and
    final_val_loss."""
    from trainer import catalogue

    batch, seq = 8, 32
    n = param_count(build_model("tiny", seq_len=seq))
    model = DeclaredModel("tiny", float(n), tokens_per_step=batch * seq, grad_bytes_per_param=4.0)
    acc = catalogue.get(ACCELERATOR)
    full_speed = model.tokens_per_step * model.flops_per_token / (acc.peak_bf16_tflops * 1e12 * acc.mfu)
    pools = [PoolProfile(s, ACCELERATOR, mbit / 1000.0, latency_ms=0.1, speed_factor=full_speed / step_time_s)
             for s in SITES]
    train = TrainConfig(model="tiny", learners=3, batch_size=batch, seq_len=seq, steps=steps, warmup_steps=4,
                        inner_steps=inner_steps, seed=seed, eval_batches=8)
    spec = SimSpec("wan-real", pools, list(SITES), [1, 1, 1], model, train, seed=seed, eval_points=8,
                   max_overrun=3.0)
    out = {"ddp": run_strategy(spec, "ddp")}
    target = out["ddp"]["final_val_loss"] * 1.01
    for strategy, cfg in (("diloco", replace(train, quorum=3, fragments=1)), ("decoupled", train)):
        out[strategy] = run_strategy(replace(spec, train=cfg, target_loss=target), strategy)
    out["ddp"] = run_strategy(replace(spec, target_loss=target), "ddp")
    return {k: {"time_to_target_s": v.get("time_to_target_s"), "bytes_per_token": v.get("bytes_per_token"),
                "final_val_loss": v.get("final_val_loss"), "time_s": v.get("time_s")} for k, v in out.items()}
