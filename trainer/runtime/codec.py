"""Nested state dicts (tensors, numbers, strings, dicts with int keys, tuples, sets) <-> bytes.

Tensors go into a safetensors body; the structure is JSON in the safetensors metadata. No
pickle anywhere, so a checkpoint read back from a shared store cannot execute code.
"""
from __future__ import annotations

import base64
import json
import struct
from typing import Any

import numpy as np
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

MAX_HEADER = 64 * 1024 * 1024


class CodecError(ValueError):
    pass


def pack(obj: Any, extra_metadata: dict[str, str] | None = None, copy: bool = True) -> bytes:
    """Bytes of `obj`. safetensors writes each tensor's memory straight into the result, so no
    tensor is cloned first (`copy` is kept for callers; nothing is serialised later here)."""
    tensors, meta = encode(obj, extra_metadata, copy=False)
    return save(tensors, meta)


def save(tensors: dict[str, torch.Tensor], meta: dict[str, str]) -> bytes:
    return st_save(tensors, metadata=meta)


def encode(obj: Any, extra_metadata: dict[str, str] | None = None,
           copy: bool = True) -> tuple[dict[str, torch.Tensor], dict]:
    """Copy every tensor out of `obj` (safe to serialise later, elsewhere) and describe the rest."""
    tensors: dict[str, torch.Tensor] = {}
    seen: set[int] = set()

    def enc(o: Any) -> Any:
        if isinstance(o, torch.Tensor):
            name = f"t{len(tensors)}"
            t = o.detach().to("cpu").contiguous()
            # safetensors refuses tensors that share memory: views of a larger buffer and repeats
            shared = t.untyped_storage().nbytes() != t.numel() * t.element_size() or t.data_ptr() in seen
            tensors[name] = t.clone() if copy or (shared and t.numel()) else t
            seen.add(t.data_ptr())
            return {"__t__": name}
        if isinstance(o, np.ndarray):
            name = f"t{len(tensors)}"
            tensors[name] = torch.from_numpy(np.ascontiguousarray(o).copy())
            return {"__np__": name}
        if isinstance(o, dict):
            return {"__d__": [[enc(k), enc(v)] for k, v in o.items()]}
        if isinstance(o, tuple):
            return {"__tup__": [enc(v) for v in o]}
        if isinstance(o, set | frozenset):
            return {"__set__": [enc(v) for v in sorted(o, key=repr)]}
        if isinstance(o, list):
            return [enc(v) for v in o]
        if isinstance(o, bytes | bytearray):
            return {"__b__": base64.b64encode(bytes(o)).decode()}
        if isinstance(o, np.generic):
            return o.item()
        if o is None or isinstance(o, bool | int | float | str):
            return o
        raise CodecError(f"cannot encode {type(o).__name__}")

    meta = {"state": json.dumps(enc(obj)), **(extra_metadata or {})}
    return tensors, meta


def metadata(blob: bytes) -> dict[str, str]:
    if len(blob) < 8:
        raise CodecError("truncated blob")
    (n,) = struct.unpack("<Q", blob[:8])
    if n > MAX_HEADER or 8 + n > len(blob):
        raise CodecError("bad safetensors header length")
    try:
        header = json.loads(blob[8:8 + n])
    except ValueError as exc:
        raise CodecError(f"bad safetensors header: {exc}") from None
    return header.get("__metadata__") or {}


def unpack(blob: bytes) -> Any:
    meta = metadata(blob)
    if "state" not in meta:
        raise CodecError("not a packed state (no 'state' metadata)")
    tensors = st_load(bytes(blob))

    def dec(o: Any) -> Any:
        if isinstance(o, list):
            return [dec(v) for v in o]
        if isinstance(o, dict):
            if "__t__" in o:
                return tensors[o["__t__"]]
            if "__np__" in o:
                return tensors[o["__np__"]].numpy()
            if "__d__" in o:
                return {_hashable(dec(k)): dec(v) for k, v in o["__d__"]}
            if "__tup__" in o:
                return tuple(dec(v) for v in o["__tup__"])
            if "__set__" in o:
                return {_hashable(dec(v)) for v in o["__set__"]}
            if "__b__" in o:
                return base64.b64decode(o["__b__"])
            raise CodecError("unknown tag in packed state")
        return o

    return dec(json.loads(meta["state"]))


def _hashable(v: Any) -> Any:
    return tuple(_hashable(x) for x in v) if isinstance(v, list) else v
