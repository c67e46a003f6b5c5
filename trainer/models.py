"""Models: a byte-level GPT (nanoGPT-style decoder) in three sizes, plus a factory hook.

`build_model(name, seq_len, seed)` returns an `nn.Module` whose `forward(x)` gives logits and
whose `loss(x, y)` gives the mean next-token cross-entropy in nats. `name` is a preset
(`tiny` ~1M parameters, `small` ~10M, `base` ~100M) or `package.module:factory`, where the
factory returns either a module with a `.loss(x, y)` method or a `(module, loss_fn)` pair.
"""
from __future__ import annotations

import contextlib
import importlib
import inspect
import math
import re
import threading
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from trainer.placement import ModelFigures, model_figures

BYTE_VOCAB = 256
_FACTORY_RE = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")


@dataclass(frozen=True)
class GPTConfig:
    n_layer: int
    n_head: int
    n_embd: int
    vocab_size: int = BYTE_VOCAB
    seq_len: int = 64


PRESETS: dict[str, GPTConfig] = {
    "tiny": GPTConfig(n_layer=4, n_head=4, n_embd=128),     # ~0.8M + positions
    "small": GPTConfig(n_layer=6, n_head=6, n_embd=384),    # ~10.7M
    "base": GPTConfig(n_layer=14, n_head=12, n_embd=768),   # ~99M
}


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q = q.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)
        k = k.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)
        v = v.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).contiguous().view(b, t, c))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.n_embd)
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.proj(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """Decoder-only transformer; the output head is tied to the token embedding."""

    embedding_names = ("wte.weight", "wpe.weight")

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.seq_len, cfg.n_embd)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight
        self.apply(self._init)
        for name, p in self.named_parameters():
            if name.endswith("proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        if t > self.cfg.seq_len:
            raise ValueError(f"sequence of {t} tokens exceeds the model's context of {self.cfg.seq_len}")
        pos = torch.arange(t, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = self(x)
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), y.reshape(-1))


class _WithLoss(nn.Module):
    """Wraps a factory's (module, loss_fn) pair into a module with `.loss`."""

    def __init__(self, module: nn.Module, loss_fn) -> None:
        super().__init__()
        self.inner = module
        self._loss_fn = loss_fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self._loss_fn(self.inner(x), y)


def is_factory(name: str) -> bool:
    return bool(_FACTORY_RE.match(name))


def _load_factory(name: str):
    mod_name, _, attr = name.partition(":")
    try:
        module = importlib.import_module(mod_name)
    except ImportError as exc:
        raise ValueError(f"model factory {name!r}: cannot import {mod_name!r} ({exc})") from exc
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise ValueError(f"model factory {name!r}: {mod_name} has no callable {attr!r}")
    return factory


# The generator torch's initialisers draw from is the process's global one: two threads building
# at once (the syncer worker runs every job's syncer as a thread) would interleave their draws
# and both get weights no seed describes. One build at a time per process.
_BUILD_LOCK = threading.Lock()


def build_model(name: str, seq_len: int = 64, seed: int = 0, vocab_size: int = BYTE_VOCAB) -> nn.Module:
    """Build a model with a deterministic initialisation (does not touch the global RNG)."""
    with _BUILD_LOCK, torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if name in PRESETS:
            p = PRESETS[name]
            return GPT(GPTConfig(p.n_layer, p.n_head, p.n_embd, vocab_size=vocab_size, seq_len=seq_len))
        if not is_factory(name):
            raise ValueError(f"unknown model {name!r}: use one of {', '.join(PRESETS)} "
                             "or 'package.module:factory'")
        factory = _load_factory(name)
        params = inspect.signature(factory).parameters
        kwargs = {k: v for k, v in (("seq_len", seq_len), ("vocab_size", vocab_size)) if k in params}
        out = factory(**kwargs)
    if isinstance(out, tuple) and len(out) == 2 and isinstance(out[0], nn.Module) and callable(out[1]):
        out = _WithLoss(out[0], out[1])
    if not isinstance(out, nn.Module) or not callable(getattr(out, "loss", None)):
        raise ValueError(f"model factory {name!r} must return an nn.Module with .loss(x, y) "
                         "or (module, loss_fn)")
    return out


def param_count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def preset_param_count(name: str, seq_len: int = 64, vocab_size: int = BYTE_VOCAB) -> int:
    p = PRESETS[name]
    d, layers = p.n_embd, p.n_layer
    per_block = 4 * d + (3 * d * d + 3 * d) + (d * d + d) + (4 * d * d + 4 * d) + (4 * d * d + d)
    return vocab_size * d + seq_len * d + layers * per_block + 2 * d


def model_params(name: str, seq_len: int = 64) -> int:
    if name in PRESETS:
        return preset_param_count(name, seq_len)
    return param_count(build_model(name, seq_len=seq_len))


def job_model_figures(name: str, batch_size: int, seq_len: int, fragments: int = 1) -> ModelFigures:
    """The placement figures of a job's model (trainer.placement.model_figures): the one estimate
    the dry run and the coordinator share, so the preview shows what the coordinator will do."""
    return model_figures(model_params(name, seq_len), batch_size, seq_len, fragments)


def model_memory_gib(name: str, seq_len: int = 64, batch_size: int = 0) -> float:
    """Training footprint estimate of one learner (see trainer.placement.model_figures)."""
    return job_model_figures(name, batch_size, seq_len).memory_gib


def model_flops_per_token(name: str, seq_len: int = 64) -> float:
    """Training FLOPs per token (forward + backward), the usual 6 N estimate."""
    return 6.0 * model_params(name, seq_len)


def set_flush_denormal(device: torch.device, enabled: bool = True) -> bool:
    """Flush subnormal floats to zero on the CPU (x86 with SSE3, arm64), process-wide: on CPUs that
    handle them in microcode a weight or moment in the subnormal range slows every op touching it
    (issue 41 measured 106 against 58 ms per inner step; this project's AMD EPYC shows no cost:
    docs/benchmarks.md, "Subnormals"), and their values are below anything fp32 training resolves.
    Returns whether it took effect (False on other devices, or where unsupported)."""
    if device.type != "cpu":
        return False
    return bool(torch.set_flush_denormal(enabled)) and enabled


def pick_device(preference: str = "auto") -> torch.device:
    """`auto` picks the first available of cuda, xpu, mps, xla, cpu; a named device must exist."""
    pref = (preference or "auto").lower()
    order = ["cuda", "xpu", "mps", "xla", "cpu"]
    if pref != "auto" and pref.split(":")[0] not in order:
        raise ValueError(f"unknown device {preference!r}: use auto or one of {', '.join(order)}")

    def available(kind: str) -> bool:
        if kind == "cuda":
            return torch.cuda.is_available()
        if kind == "xpu":
            return hasattr(torch, "xpu") and torch.xpu.is_available()
        if kind == "mps":
            return hasattr(torch.backends, "mps") and torch.backends.mps.is_available()
        if kind == "xla":
            try:
                importlib.import_module("torch_xla")
            except ImportError:
                return False
            return True
        return kind == "cpu"

    if pref == "auto":
        for kind in order:
            if available(kind):
                return _device(kind)
    kind = pref.split(":")[0]
    if not available(kind):
        raise ValueError(f"device {preference!r} is not available on this machine")
    return _device(pref)


def _device(kind: str) -> torch.device:
    if kind.startswith("xla"):
        import torch_xla.core.xla_model as xm  # noqa: PLC0415 - optional dependency

        return xm.xla_device()
    return torch.device(kind)


def autocast(device: torch.device, enabled: bool):
    """bf16 autocast context (a no-op when disabled)."""
    if not enabled:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
