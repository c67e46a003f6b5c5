"""Checkpoint bytes: nested state dicts (learner, syncer) <-> one safetensors payload.

Tensors go into safetensors entries; everything else (ints, floats, strings, lists, tuples,
dicts with int or str keys, None, bools) goes into a JSON skeleton in the metadata, with
tensors replaced by references. No pickle, so a checkpoint read from shared storage cannot
run code.
"""
from __future__ import annotations

import json
import struct
from typing import Any

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

FORMAT = "diloco-state"


class CheckpointError(ValueError):
    pass


def _pack(obj: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(obj, torch.Tensor):
        key = f"t{len(tensors)}"
        tensors[key] = obj.detach().cpu().contiguous().clone()
        return {"__tensor__": key}
    if isinstance(obj, dict):
        return {"__dict__": [[_pack(k, tensors), _pack(v, tensors)] for k, v in obj.items()]}
    if isinstance(obj, tuple):
        return {"__tuple__": [_pack(v, tensors) for v in obj]}
    if isinstance(obj, list):
        return [_pack(v, tensors) for v in obj]
    if obj is None or isinstance(obj, bool | int | float | str):
        if isinstance(obj, float) and obj != obj:
            return {"__float__": "nan"}
        return obj
    raise CheckpointError(f"cannot store a {type(obj).__name__} in a checkpoint")


def _unpack(obj: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(obj, list):
        return [_unpack(v, tensors) for v in obj]
    if isinstance(obj, dict):
        if "__tensor__" in obj:
            try:
                return tensors[obj["__tensor__"]]
            except KeyError as exc:
                raise CheckpointError("checkpoint references a missing tensor") from exc
        if "__dict__" in obj:
            return {_unpack(k, tensors): _unpack(v, tensors) for k, v in obj["__dict__"]}
        if "__tuple__" in obj:
            return tuple(_unpack(v, tensors) for v in obj["__tuple__"])
        if "__float__" in obj:
            return float(obj["__float__"])
        raise CheckpointError("malformed checkpoint skeleton")
    return obj


def state_to_bytes(state: dict) -> bytes:
    tensors: dict[str, torch.Tensor] = {}
    skeleton = _pack(state, tensors)
    return st_save(tensors, metadata={"format": FORMAT, "state": json.dumps(skeleton, separators=(",", ":"))})


def state_from_bytes(blob: bytes) -> dict:
    try:
        tensors = st_load(bytes(blob))
        (hlen,) = struct.unpack("<Q", bytes(blob[:8]))
        meta = json.loads(bytes(blob[8:8 + hlen])).get("__metadata__") or {}
    except Exception as exc:
        raise CheckpointError(f"not a checkpoint: {exc}") from exc
    if meta.get("format") != FORMAT:
        raise CheckpointError("not a diloco checkpoint")
    return _unpack(json.loads(meta["state"]), tensors)
