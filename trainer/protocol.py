"""The learner <-> syncer protocol: contributions and global fragments on the wire.

Both travel as a safetensors payload (see `trainer.compression`) whose metadata carries a
small JSON header. Nothing is unpickled. `from_bytes` checks, in order: size limit, header
shape, entry sizes against shape and dtype, the wire checksum, the header fields (types and
ranges), the expected tensor names and shapes, and that every value is finite. Any failure
raises `InvalidPayload` and nothing is returned.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from trainer.compression import (
    DEFAULT_DENSITY,
    DEFAULT_MAX_BYTES,
    InvalidPayload,
    decode_with_meta,
    encode,
    tensor_checksum,
)

__all__ = ["Contribution", "GlobalFragment", "InvalidPayload", "tensor_checksum"]

_MAX_INT = 2**62


def _int_field(meta: dict, name: str, lo: int = 0) -> int:
    v = meta.get(name)
    if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= _MAX_INT:
        raise InvalidPayload(f"header field {name!r} must be an integer >= {lo}")
    return v


def _str_field(meta: dict, name: str, max_len: int = 200) -> str:
    v = meta.get(name)
    if not isinstance(v, str) or not 0 < len(v) <= max_len:
        raise InvalidPayload(f"header field {name!r} must be a non-empty string of at most {max_len} chars")
    return v


def _check_expected(tensors: dict[str, torch.Tensor], expected: dict[str, tuple] | None) -> None:
    if expected is None:
        return
    if set(tensors) != set(expected):
        missing = sorted(set(expected) - set(tensors))
        extra = sorted(set(tensors) - set(expected))
        raise InvalidPayload(f"tensor names differ (missing {missing[:3]}, unexpected {extra[:3]})")
    for name, shape in expected.items():
        if tuple(tensors[name].shape) != tuple(shape):
            raise InvalidPayload(f"tensor {name!r}: shape {tuple(tensors[name].shape)} != {tuple(shape)}")


@dataclass
class Contribution:
    """A learner's pseudo-gradient for one fragment: global_at_base_version - local."""

    job: str
    learner: int
    incarnation: int
    fragment: int
    base_version: int
    tokens: int
    inner_steps: int
    tensors: dict[str, torch.Tensor]
    checksum: str = ""
    wire_bytes: int = field(default=0, compare=False)
    # a CUDA event while the tensors are still being copied to host memory (the learner's side
    # stream); `wait()` blocks on it and then takes the checksum
    ready: Any = field(default=None, compare=False, repr=False)
    # (method, density, entries): the sender's own top-k of `tensors` (`compression.sparsify`), which
    # `tensors` is the dense form of; `to_bytes` with that method sends these entries as they are
    sparse: Any = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if not self.checksum and self.ready is None:
            self.checksum = tensor_checksum(self.tensors)

    def wait(self) -> Contribution:
        """Block until the tensors are in place (a no-op unless a device copy is in flight)."""
        if self.ready is not None:
            self.ready.synchronize()
            self.ready = None
        if not self.checksum:
            self.checksum = tensor_checksum(self.tensors)
        return self

    @property
    def key(self) -> tuple[int, int, int, int]:
        return (self.learner, self.incarnation, self.fragment, self.base_version)

    def header(self) -> dict:
        return {"kind": "contribution", "job": self.job, "learner": self.learner,
                "incarnation": self.incarnation, "fragment": self.fragment,
                "base_version": self.base_version, "tokens": self.tokens, "inner_steps": self.inner_steps}

    def to_state(self, **extra) -> dict:
        """In-process form for learner / syncer `state_dict()` (the checkpoint codec packs it)."""
        self.wait()
        return dict(self.header(), tensors=self.tensors, checksum=self.checksum, **extra)

    @classmethod
    def from_state(cls, d: dict) -> Contribution:
        return cls(job=d["job"], learner=d["learner"], incarnation=d["incarnation"],
                   fragment=d["fragment"], base_version=d["base_version"], tokens=d["tokens"],
                   inner_steps=d["inner_steps"], tensors=d["tensors"], checksum=d["checksum"])

    def to_bytes(self, compression: str = "none", density: float | None = None) -> bytes:
        self.wait()
        if self.sparse is not None and self.sparse[0] == compression:
            method, own_density, entries = self.sparse
            return encode(self.tensors, method, meta=self.header(), density=own_density, sparse=entries)
        return encode(self.tensors, compression, meta=self.header(),
                      density=DEFAULT_DENSITY if density is None else density)

    @classmethod
    def from_bytes(cls, blob: bytes, expected: dict[str, tuple] | None = None,
                   max_bytes: int = DEFAULT_MAX_BYTES) -> Contribution:
        tensors, meta = decode_with_meta(blob, max_bytes)
        if not isinstance(meta, dict) or meta.get("kind") != "contribution":
            raise InvalidPayload("not a contribution")
        _check_expected(tensors, expected)
        c = cls(job=_str_field(meta, "job"), learner=_int_field(meta, "learner"),
                incarnation=_int_field(meta, "incarnation"), fragment=_int_field(meta, "fragment"),
                base_version=_int_field(meta, "base_version"), tokens=_int_field(meta, "tokens", 1),
                inner_steps=_int_field(meta, "inner_steps", 1),
                tensors={k: v.float() for k, v in tensors.items()})
        c.wire_bytes = len(blob)
        return c


@dataclass
class GlobalFragment:
    """The syncer's weights of one fragment at one version.

    With `base_version` set it is an *update*: the tensors are the change from the published
    weights at `base_version` to those at `version`, so a learner holding exactly that version
    adds them (it travels compressed; see `Syncer.global_update`)."""

    job: str
    fragment: int
    version: int
    tensors: dict[str, torch.Tensor]
    base_version: int | None = None

    @property
    def is_update(self) -> bool:
        return self.base_version is not None

    def header(self) -> dict:
        h = {"kind": "global", "job": self.job, "fragment": self.fragment, "version": self.version}
        if self.base_version is not None:
            h["base_version"] = self.base_version
        return h

    def to_bytes(self, compression: str = "none", density: float = DEFAULT_DENSITY) -> bytes:
        return encode(self.tensors, compression, meta=self.header(), density=density)

    @classmethod
    def from_bytes(cls, blob: bytes, expected: dict[str, tuple] | None = None,
                   max_bytes: int = DEFAULT_MAX_BYTES) -> GlobalFragment:
        tensors, meta = decode_with_meta(blob, max_bytes)
        if not isinstance(meta, dict) or meta.get("kind") != "global":
            raise InvalidPayload("not a global fragment")
        _check_expected(tensors, expected)
        version = _int_field(meta, "version")
        base_version = None
        if "base_version" in meta:
            base_version = _int_field(meta, "base_version")
            if base_version >= version:
                raise InvalidPayload("header field 'base_version' must be below 'version'")
        return cls(job=_str_field(meta, "job"), fragment=_int_field(meta, "fragment"), version=version,
                   tensors={k: v.float() for k, v in tensors.items()}, base_version=base_version)
