from __future__ import annotations

import json
import subprocess
import sys

import pytest

from trainer.config import ConfigError, TrainConfig
from trainer.spec import JobSpec


def test_from_spec_takes_the_job_settings():
    spec = JobSpec(learners=6, inner_steps=30, fragments=3, outer_lr=0.5, compression="int4", eval_interval=2)
    cfg = TrainConfig.from_spec(spec)
    assert (cfg.learners, cfg.inner_steps, cfg.fragments, cfg.quorum) == (6, 30, 3, 3)
    assert (cfg.outer_lr, cfg.compression, cfg.eval_every) == (0.5, "int4", 2)
    assert TrainConfig.from_spec(spec, device="cpu", quorum=1).quorum == 1


def test_bad_settings_name_the_field():
    with pytest.raises(ConfigError) as exc:
        TrainConfig(learners=2, quorum=3, outer_momentum=1.5, compression="zip")
    assert set(exc.value.errors) == {"quorum", "outer_momentum", "compression"}
    with pytest.raises(ConfigError, match="fragments"):
        TrainConfig(inner_steps=2, fragments=3)
    with pytest.raises(ConfigError, match="inner_prox"):
        TrainConfig(inner_prox=-1)
    with pytest.raises(ConfigError, match="inner_prox"):
        TrainConfig(inner_lr=3e-3, inner_prox=400)  # would pull past the global weights


def test_dict_roundtrip():
    cfg = TrainConfig(learners=3, quorum=2, betas=(0.8, 0.9))
    assert TrainConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    with pytest.raises(ConfigError, match="unknown"):
        TrainConfig.from_dict({"bogus": 1})


def test_perf_bench_prints_and_writes_json(tmp_path, cache_dir):
    out = tmp_path / "perf.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "trainer.perf",
            "--steps",
            "3",
            "--repeats",
            "2",
            "--syncer-model",
            "tiny",
            "--batch-size",
            "2",
            "--seq-len",
            "16",
            "--cache-dir",
            str(cache_dir),
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert "learner overhead" in proc.stdout and "plain torch add_" in proc.stdout
    figures = json.loads(out.read_text())
    assert figures["syncer"]["merge_gbps"] > 0 and figures["learner"]["bare_ms_median"] > 0


def test_perf_learner_bench_on_a_device_with_bf16(tmp_path, cache_dir):
    """The prepared GPU check (bench/gpu_check.sh) runs this with --device cuda; here on the CPU."""
    out = tmp_path / "perf.json"
    proc = subprocess.run(
        [sys.executable, "-m", "trainer.perf", "--device", "cpu", "--bf16", "--no-syncer", "--steps", "3",
         "--batch-size", "2", "--seq-len", "16", "--cache-dir", str(cache_dir), "--json", str(out)],
        capture_output=True, text=True, timeout=300, check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert "bf16 autocast" in proc.stdout and "tokens/s bare / Learner" in proc.stdout
    assert "syncer merge" not in proc.stdout
    figures = json.loads(out.read_text())
    learner = figures["learner"]
    assert figures["syncer"] is None and learner["bf16"] is True and learner["device"] == "cpu"
    assert learner["bare_tokens_per_s"] > 0 and learner["learner_tokens_per_s"] > 0
