"""Compression of pseudo-gradients and global fragments, and the tensor wire format.

A payload is a safetensors file (never pickle) whose `__metadata__` says how to read it:
`format=diloco-tensors`, `version`, `method`, `block`, `tensors` (JSON: name -> shape and
original dtype), `wire_checksum` (XXH3-128 of the encoded entries, `xxh3:<hex>`; a bare hex
digest is the BLAKE2b-128 of payloads written before, still accepted) and an optional `meta`
(JSON, used by `trainer.protocol` for the contribution header).

Speed (a 12B model's fp32 contribution is 48 GB): the checksum hashes each tensor's own memory
(no copy) with XXH3, about 30x faster than BLAKE2b and a corruption check, not a signature
(the blob store and the channel are authenticated elsewhere); finiteness is one fused
`torch._foreach_norm` (a NaN or Inf makes the norm non-finite; only then is the tensor
checked element-wise, since a huge finite tensor can overflow its norm). Encoding writes the
safetensors layout itself (`_safetensors_bytes`): the header, then each tensor's own memory
joined once into the result, where `safetensors.torch.save` copies every byte twice (into its
buffer, then into a Python bytes) at about half the speed; safetensors' own loader reads it
(tests/trainer/test_compression.py). Decoding copies each entry once out of the immutable blob.

Methods
  none   the tensors as they are (float32 stays float32): bit-exact.
  bf16   bfloat16 (8 significant bits): relative error <= 2**-8 per element.
  int8   symmetric blockwise absmax scaling, 128 values per block, q in [-127, 127], fp32 scales.
  int4   symmetric blockwise absmax scaling, 32 values per block, q in [-7, 7], two values
         per byte, fp32 scales (5 bits per value in all: 6.4x smaller than fp32).
  topk2  sparse: per chunk of SPARSE_CHUNK values (the tail chunk shorter) the k = ceil(density x
  topk4  chunk) largest |values|, each sent as its offset in the chunk (uint16, ascending) and a 2- or
         4-bit code q in [0, L], L = 2**bits - 1, for (2q - L) * scale / L with scale the chunk's
         largest |value| (fp32): midrise levels, no zero (an unsent value is the zero). At the
         default density 0.02: 2.25 (topk2) / 2.5 (topk4) bytes per sent value plus 4 per chunk,
         about 0.047 / 0.052 bytes per value, 85x / 77x smaller than fp32 (12x / 11x smaller than
         int4). Metadata `block` is the chunk, `density` the density. What a sender leaves out is
         large: the learner keeps it and adds it to its next contribution (error feedback,
         `trainer.learner`), the syncer keeps it in `params - published` for global updates.

Error bound of the blockwise methods: each value is off by at most half a step,
|e| <= absmax_block / (2 qmax). As absmax_block <= ||x_block||, the relative L2 error of a
whole tensor is at most sqrt(block) / (2 qmax): 0.40 for int4 (block 32), 0.045 for int8
(block 128). For Gaussian-like pseudo-gradients the measured error is far lower, about
0.09 for int4 and 0.004 for int8 (see `compression_error` and tests/trainer).
"""
from __future__ import annotations

import hashlib
import json
import math
import struct
import sys

import torch
import xxhash
from safetensors.torch import load as st_load

SPARSE_BITS = {"topk2": 2, "topk4": 4}
METHODS = ("none", "bf16", "int8", "int4", *SPARSE_BITS)
SPARSE_CHUNK = 4096          # values per top-k chunk (offsets travel as uint16: at most 65536)
DEFAULT_DENSITY = 0.02       # share of each chunk a sparse method sends
MAX_DENSITY = 0.5            # above that a dense method costs less than offsets + codes
BLOCK = {"int8": 128, "int4": 32}
QMAX = {"int8": 127, "int4": 7}
FORMAT = "diloco-tensors"
VERSION = "1"
DEFAULT_MAX_BYTES = 4 * 2**30
MAX_HEADER = 16 * 2**20
_FLOAT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_ST_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "I8": torch.int8,
              "U8": torch.uint8, "U16": torch.uint16}
_ST_NAMES = {v: k for k, v in _ST_DTYPES.items()}


class InvalidPayload(ValueError):
    """A blob that is not a well-formed, finite, consistent payload."""


def error_bound(method: str) -> float:
    """Worst-case relative L2 error of one tensor round trip."""
    if method == "none":
        return 0.0
    if method == "bf16":
        return 2.0**-8
    if method in SPARSE_BITS:
        return 1.0  # what is not sent is the error: bounded only through error feedback
    return math.sqrt(BLOCK[method]) / (2 * QMAX[method])


def _dtype_name(dtype: torch.dtype) -> str:
    for k, v in _FLOAT_DTYPES.items():
        if v == dtype:
            return k
    raise InvalidPayload(f"unsupported dtype {dtype}")


_QUANT_CHUNK = 8192  # blocks quantized at a time: the fp32 temporaries stay small and in cache
# Added to a float v with |v| < 2**22, 1.5 * 2**23 leaves round(v) (half to even, as torch.round)
# in the low mantissa bits: the low byte of the sum's bits is round(v) + offset, mod 256. So one
# add rounds, offsets and converts, where round_, clamp_, add_ and a cast took four passes.
_ROUNDING_MAGIC = 1.5 * 2**23
_POOL_MAX = 1 << 16  # tensors up to this many values are quantized together, in one call
# The byte tricks of _quantize and _dequantize read a value's low byte first.
assert sys.byteorder == "little", "trainer.compression assumes a little-endian host"


def _quantize(x: torch.Tensor, method: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Blockwise absmax quantization: per block scale = max |x| / qmax, values round(x / scale).

    Chunk by chunk, so the temporaries stay in cache: |x| and its block maxima, x / scale plus
    the rounding constant, then the low byte of each float's bits (int4: two per byte, the first
    in the low nibble, each stored + 8). |x / scale| <= qmax up to one rounding of the division,
    so no value needs a clamp."""
    block, qmax = BLOCK[method], QMAX[method]
    flat = x.detach().reshape(-1).float()
    n = flat.numel()
    nblocks = max(1, -(-n // block))
    if n == nblocks * block:
        blocks = flat.view(nblocks, block)  # no padded copy
    else:
        padded = torch.zeros(nblocks * block, dtype=torch.float32)
        padded[:n] = flat
        blocks = padded.view(nblocks, block)
    int4 = method == "int4"
    offset = 8 if int4 else 0  # int8: the low byte of round(v) is its two's complement already
    scale = torch.empty(nblocks, dtype=torch.float32)
    out = torch.empty(nblocks * block // (2 if int4 else 1), dtype=torch.uint8 if int4 else torch.int8)
    low = out.view(torch.uint8)
    scratch = torch.empty(min(nblocks, _QUANT_CHUNK), block)
    for lo in range(0, nblocks, _QUANT_CHUNK):
        hi = min(nblocks, lo + _QUANT_CHUNK)
        s, chunk, sc = scratch[: hi - lo], blocks[lo:hi], scale[lo:hi]
        torch.amax(torch.abs(chunk, out=s), dim=1, out=sc).div_(qmax)
        torch.div(chunk, torch.where(sc > 0, sc, 1.0)[:, None], out=s).add_(_ROUNDING_MAGIC + offset)
        raw = s.view(-1).view(torch.uint8)  # little-endian: byte 0 of each float is the value
        if int4:
            pairs = raw.view(-1, 8)
            torch.add(pairs[:, 0], pairs[:, 4], alpha=16, out=low[lo * block // 2:hi * block // 2])
        else:
            low[lo * block:hi * block].copy_(raw.view(-1, 4)[:, 0])
    return out, scale


def _quantize_all(tensors: dict[str, torch.Tensor], method: str) -> dict[str, tuple[torch.Tensor, ...]]:
    """`_quantize` of each tensor; the small ones whose size is a whole number of blocks are
    quantized as one (their blocks never mix), so a model's many norms and biases do not each
    pay the per-call cost. Their results are views into the pooled output."""
    block = BLOCK[method]
    pooled = [n for n, t in tensors.items() if 0 < t.numel() <= _POOL_MAX and t.numel() % block == 0]
    alone = set(tensors) - set(pooled)
    out = {n: _quantize(t, method) for n, t in tensors.items() if n in alone}
    if pooled:
        q, s = _quantize(torch.cat([tensors[n].detach().reshape(-1).float() for n in pooled]), method)
        per_byte = 2 if method == "int4" else 1
        at = 0
        for n in pooled:
            k = tensors[n].numel() // block
            out[n] = (q[at * block // per_byte:(at + k) * block // per_byte], s[at:at + k])
            at += k
    return out


def _dequantize(q: torch.Tensor, scale: torch.Tensor, method: str, shape: list[int]) -> torch.Tensor:
    """(v - offset) * scale per block, a chunk at a time while it is in cache. int4 unpacks each
    byte b = lo + 16 hi in int16 as (b | b << 4) & 0x0F0F, whose two bytes are lo and hi in
    order: contiguous integer operations where two strided nibble copies were twice as slow."""
    block = BLOCK[method]
    nblocks = scale.numel()
    out = torch.empty(nblocks * block, dtype=torch.float32)
    rows = out.view(nblocks, block)
    chunk = min(nblocks, _QUANT_CHUNK) * block // 2
    wide, spread = (torch.empty(chunk if method == "int4" else 0, dtype=torch.int16) for _ in range(2))
    for lo in range(0, nblocks, _QUANT_CHUNK):
        hi = min(nblocks, lo + _QUANT_CHUNK)
        if method == "int4":  # exact before the product: small integers in fp32
            n = (hi - lo) * block // 2
            b, w = wide[:n], spread[:n]
            b.copy_(q[lo * block // 2:hi * block // 2])
            torch.bitwise_left_shift(b, 4, out=w).bitwise_or_(b).bitwise_and_(0x0F0F)
            rows[lo:hi].view(-1).copy_(w.view(torch.uint8))
            rows[lo:hi].sub_(8)
        else:
            rows[lo:hi].copy_(q[lo * block:hi * block].view(-1, block))
        rows[lo:hi].mul_(scale[lo:hi, None])
    return out[: math.prod(shape)].view(shape)


# -- sparse (top-k) methods --------------------------------------------------------------------
def check_density(density: object) -> float:
    """`density` as a float in (0, MAX_DENSITY], else ValueError."""
    if isinstance(density, bool) or not isinstance(density, int | float) or not 0 < density <= MAX_DENSITY:
        raise ValueError(f"density must be a number in (0, {MAX_DENSITY}]")
    return float(density)


def _chunk_k(length: int, density: float) -> int:
    """Values sent of a chunk of `length` values: ceil(density x length), at least 1."""
    return min(length, max(1, math.ceil(density * length)))


def _groups(numel: int, density: float, chunk: int) -> list[tuple[int, int, int, int]]:
    """(start, chunks, chunk length, k) of the whole chunks, then of the shorter tail chunk."""
    full, tail = divmod(numel, chunk)
    out = [(0, full, chunk, _chunk_k(chunk, density))] if full else []
    if tail:
        out.append((full * chunk, 1, tail, _chunk_k(tail, density)))
    return out


def sparse_sizes(numel: int, density: float, chunk: int = SPARSE_CHUNK) -> tuple[int, int]:
    """(values sent, chunks) of a tensor of `numel` values."""
    groups = _groups(numel, density, chunk)
    return sum(rows * k for _, rows, _, k in groups), sum(rows for _, rows, _, _ in groups)


def _pack(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes (uint8, < 2**bits) packed 8 // bits to a byte, the first in the low bits; zero padded."""
    per = 8 // bits
    pad = -q.numel() % per
    if pad:
        q = torch.cat([q, torch.zeros(pad, dtype=torch.uint8, device=q.device)])
    lanes = q.view(-1, per)
    out = lanes[:, 0].clone()
    for j in range(1, per):
        out.bitwise_or_(lanes[:, j] << (bits * j))
    return out


def _unpack(packed: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    per = 8 // bits
    mask = (1 << bits) - 1
    lanes = torch.stack([(packed >> (bits * j)) & mask for j in range(per)], dim=1)
    return lanes.reshape(-1)[:count]


def _levels(q: torch.Tensor, scale: torch.Tensor, bits: int) -> torch.Tensor:
    """(2q - L) * (scale / L) of each row of codes: the encoder's view of what it sent and the
    decoder's result are this same expression, so both hold the same bits."""
    top = (1 << bits) - 1
    return (q.float() * 2 - top) * (scale / top)[:, None]


def sparsify(tensors: dict[str, torch.Tensor], method: str,
             density: float = DEFAULT_DENSITY) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Wire entries of a sparse method: name -> (offsets uint16, packed codes uint8, scales fp32),
    in host memory. Works where the tensors are (a device's top-k); deterministic."""
    bits = SPARSE_BITS[method]
    density = check_density(density)
    top = (1 << bits) - 1
    out = {}
    for name, t in tensors.items():
        flat = t.detach().reshape(-1).float()
        idx, codes, scales = [], [], []
        for start, rows, length, k in _groups(flat.numel(), density, SPARSE_CHUNK):
            block = flat[start:start + rows * length].view(rows, length)
            pick = torch.topk(block.abs(), k, dim=1, sorted=False).indices.sort(dim=1).values
            vals = torch.gather(block, 1, pick)
            scale = vals.abs().amax(dim=1)
            unit = vals / torch.where(scale > 0, scale, 1.0)[:, None]
            q = torch.round((unit * top + top) * 0.5).clamp_(0, top).to(torch.uint8)
            idx.append(pick.reshape(-1).to(torch.int32))
            codes.append(q.reshape(-1))
            scales.append(scale)
        dev = flat.device
        i = torch.cat(idx) if idx else torch.empty(0, dtype=torch.int32, device=dev)
        q = torch.cat(codes) if codes else torch.empty(0, dtype=torch.uint8, device=dev)
        s = torch.cat(scales) if scales else torch.empty(0, dtype=torch.float32, device=dev)
        out[name] = (i.cpu().to(torch.uint16), _pack(q, bits).cpu(), s.cpu())
    return out


def densify(entries: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]], shapes: dict[str, list],
            method: str, density: float = DEFAULT_DENSITY,
            device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """The dense fp32 tensors that sparse entries stand for (zeros where nothing was sent). The
    entries must be well formed (`decode` checks them first)."""
    bits = SPARSE_BITS[method]
    out = {}
    for name, (idx, packed, scale) in entries.items():
        shape = list(shapes[name])
        numel = math.prod(shape)
        dense = torch.zeros(numel, dtype=torch.float32, device=device)
        count, _ = sparse_sizes(numel, density)
        q = _unpack(packed.to(device), bits, count)
        offsets = idx.to(device=device, dtype=torch.int64)
        scale = scale.to(device)
        at = row = 0
        for start, rows, length, k in _groups(numel, density, SPARSE_CHUNK):
            n = rows * k
            vals = _levels(q[at:at + n].view(rows, k), scale[row:row + rows], bits)
            firsts = start + length * torch.arange(rows, device=device)
            pos = offsets[at:at + n].view(rows, k) + firsts[:, None]
            dense[pos.reshape(-1)] = vals.reshape(-1)
            at, row = at + n, row + rows
        out[name] = dense.view(shape)
    return out


def _sparse_check(entries: dict, spec: dict, method: str, density: float, chunk: int,
                  allow_nonfinite: bool) -> dict:
    """The (offsets, codes, scales) of every tensor, checked: dtypes, counts, offsets inside their
    chunk and strictly ascending (so no duplicates), zero padding bits, scales >= 0 and finite."""
    bits = SPARSE_BITS[method]
    out = {}
    for name, info in spec.items():
        numel = math.prod(info["shape"])
        count, nchunks = sparse_sizes(numel, density, chunk)
        i, q, s = (entries.get(f"{k}/{name}") for k in ("i", "q", "s"))
        if (i is None or q is None or s is None or i.dtype != torch.uint16 or q.dtype != torch.uint8
                or s.dtype != torch.float32):
            raise InvalidPayload(f"tensor {name!r}: sparse entries missing or of the wrong dtype")
        if list(i.shape) != [count] or list(q.shape) != [-(-count * bits // 8)] or list(s.shape) != [nchunks]:
            raise InvalidPayload(f"tensor {name!r}: sparse entries hold the wrong number of values "
                                 f"({count} offsets, {nchunks} chunks expected)")
        offsets = i.to(torch.int32)
        at = 0
        for _, rows, length, k in _groups(numel, density, chunk):
            block = offsets[at:at + rows * k].view(rows, k)
            at += rows * k
            if bool((block >= length).any()):
                raise InvalidPayload(f"tensor {name!r}: sparse offset out of its chunk")
            if k > 1 and not bool((block[:, 1:] > block[:, :-1]).all()):
                raise InvalidPayload(f"tensor {name!r}: sparse offsets not strictly ascending in a chunk "
                                     "(unsorted or duplicate)")
        spare = q.numel() * 8 // bits - count
        if spare and bool(_unpack(q[-1:], bits, 8 // bits)[8 // bits - spare:].any()):
            raise InvalidPayload(f"tensor {name!r}: padding bits of the codes are not zero")
        if not allow_nonfinite and not bool(torch.isfinite(s).all()):
            raise InvalidPayload(f"tensor {name!r}: non-finite scale (NaN/Inf)")
        if bool((s < 0).any()):
            raise InvalidPayload(f"tensor {name!r}: negative scale")
        out[name] = (i, q, s)
    return out


def _sparse_params(md: dict) -> tuple[float, int]:
    """(density, chunk) of a sparse payload's metadata."""
    try:
        density = check_density(float(md.get("density", "")))
        chunk = int(md.get("block", ""))
    except ValueError as exc:
        raise InvalidPayload(f"sparse payload: bad density or chunk ({exc})") from exc
    if not 1 <= chunk <= 65536:
        raise InvalidPayload("sparse payload: chunk must be in [1, 65536]")
    if chunk != SPARSE_CHUNK:
        raise InvalidPayload(f"sparse payload: chunk {chunk} is not {SPARSE_CHUNK}")
    return density, chunk


def _entries(tensors: dict[str, torch.Tensor], method: str, density: float = DEFAULT_DENSITY,
             sparse: dict | None = None) -> tuple[dict[str, torch.Tensor], dict]:
    if method not in METHODS:
        raise ValueError(f"unknown compression {method!r}: use one of {', '.join(METHODS)}")
    if method in SPARSE_BITS:
        return _sparse_entries(tensors, method, density, sparse)
    entries: dict[str, torch.Tensor] = {}
    spec: dict[str, dict] = {}
    host = {name: t.detach().cpu() for name, t in tensors.items()}
    quantized = _quantize_all(host, method) if method in BLOCK else {}
    for name in sorted(host):
        t = host[name]
        spec[name] = {"shape": list(t.shape), "dtype": _dtype_name(t.dtype)}
        if method == "none":
            t = t.contiguous()
            if t.untyped_storage().nbytes() != t.numel() * t.element_size():
                t = t.clone()  # a view into a larger storage: safetensors wants its own
            entries[f"t/{name}"] = t
        elif method == "bf16":
            entries[f"t/{name}"] = t.to(torch.bfloat16).contiguous()
        else:
            q, s = quantized[name]
            entries[f"q/{name}"] = q
            entries[f"s/{name}"] = s
    return entries, spec


def _sparse_entries(tensors: dict[str, torch.Tensor], method: str, density: float,
                    sparse: dict | None) -> tuple[dict[str, torch.Tensor], dict]:
    """Entries i/, q/, s/ per tensor: `sparse` when given (the sender's own `sparsify` of these
    tensors, so it is not selected twice), else `sparsify(tensors)`."""
    if sparse is None:
        sparse = sparsify(tensors, method, density)
    if set(sparse) != set(tensors):
        raise ValueError("sparse entries do not name the tensors")
    entries: dict[str, torch.Tensor] = {}
    spec: dict[str, dict] = {}
    for name in sorted(tensors):
        t = tensors[name]
        spec[name] = {"shape": list(t.shape), "dtype": _dtype_name(t.dtype)}
        for key, e in zip("iqs", sparse[name], strict=True):
            entries[f"{key}/{name}"] = e.contiguous()
    return entries, spec


CHECKSUM_PREFIX = "xxh3:"


def _digest(entries: dict[str, torch.Tensor], h) -> str:
    for name in sorted(entries):
        t = entries[name]
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        if t.numel():
            h.update(_raw(t))
    return h.hexdigest()


def _raw(t: torch.Tensor) -> memoryview:
    """The tensor's bytes, without a copy when it is contiguous in host memory."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().data


def entries_checksum(entries: dict[str, torch.Tensor]) -> str:
    """XXH3-128 of names, dtypes, shapes and bytes, in name order."""
    return CHECKSUM_PREFIX + _digest(entries, xxhash.xxh3_128())


def checksum_matches(entries: dict[str, torch.Tensor], expected: object) -> bool:
    """Whether `expected` is the checksum of `entries` (XXH3, or BLAKE2b for older payloads)."""
    if not isinstance(expected, str):
        return False
    if expected.startswith(CHECKSUM_PREFIX):
        return entries_checksum(entries) == expected
    return _digest(entries, hashlib.blake2b(digest_size=16)) == expected


def tensor_checksum(tensors: dict[str, torch.Tensor]) -> str:
    """XXH3-128 of names, dtypes, shapes and bytes, in name order."""
    return entries_checksum(tensors)


def nonfinite_index(tensors: list[torch.Tensor], norms: list[torch.Tensor] | None = None) -> int | None:
    """Index of the first tensor holding NaN or Inf, or None. One fused L2-norm pass (pass
    `norms` when they are computed already); a non-finite norm is confirmed element-wise."""
    floats = [i for i, t in enumerate(tensors) if t.is_floating_point() and t.numel()]
    if not floats:
        return None
    if norms is None:
        norms = torch._foreach_norm([tensors[i] for i in floats])
    else:
        norms = [norms[i] for i in floats]
    finite = torch.isfinite(torch.stack(norms))
    if bool(finite.all()):
        return None
    for j in torch.nonzero(~finite).reshape(-1).tolist():
        if not bool(torch.isfinite(tensors[floats[j]]).all()):
            return floats[j]
    return None


def encode(tensors: dict[str, torch.Tensor], method: str = "none", meta: dict | None = None,
           density: float = DEFAULT_DENSITY, sparse: dict | None = None) -> bytes:
    """The payload of `tensors`. Sparse methods send `density` of each chunk; `sparse` is the
    sender's `sparsify(tensors, method, density)` when it has it already."""
    entries, spec = _entries(tensors, method, density, sparse)
    metadata = {
        "format": FORMAT, "version": VERSION, "method": method,
        "block": str(SPARSE_CHUNK if method in SPARSE_BITS else BLOCK.get(method, 0)),
        "tensors": json.dumps(spec, separators=(",", ":")),
        "wire_checksum": entries_checksum(entries),
    }
    if method in SPARSE_BITS:
        metadata["density"] = repr(check_density(density))
    if meta is not None:
        metadata["meta"] = json.dumps(meta, separators=(",", ":"), sort_keys=True)
    return _safetensors_bytes(entries, metadata)


def _safetensors_bytes(entries: dict[str, torch.Tensor], metadata: dict[str, str]) -> bytes:
    """The safetensors file of `entries` (contiguous CPU tensors) in name order: an 8-byte
    little-endian header length, the JSON header padded with spaces to 8 bytes, then the data,
    each tensor's bytes copied once into the result."""
    header: dict[str, dict] = {"__metadata__": metadata}
    parts: list[memoryview] = []
    off = 0
    for name in sorted(entries):
        t = entries[name]
        size = t.numel() * t.element_size()
        header[name] = {"dtype": _ST_NAMES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [off, off + size]}
        if size:
            parts.append(_raw(t))
        off += size
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    return b"".join([struct.pack("<Q", len(head)), head, *parts])


def read_header(blob: bytes, max_bytes: int = DEFAULT_MAX_BYTES) -> dict:
    """Parse and check the safetensors header without touching the tensor data."""
    if not isinstance(blob, bytes | bytearray | memoryview):
        raise InvalidPayload("payload must be bytes")
    if len(blob) > max_bytes:
        raise InvalidPayload(f"payload of {len(blob)} bytes exceeds the limit of {max_bytes}")
    if len(blob) < 10:
        raise InvalidPayload("payload too short")
    (hlen,) = struct.unpack("<Q", bytes(blob[:8]))
    if hlen > MAX_HEADER or 8 + hlen > len(blob):
        raise InvalidPayload("payload header length out of range")
    try:
        header = json.loads(bytes(blob[8:8 + hlen]))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InvalidPayload(f"payload header is not JSON: {exc}") from exc
    if not isinstance(header, dict):
        raise InvalidPayload("payload header is not an object")
    data_len = len(blob) - 8 - hlen
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(info, dict) or info.get("dtype") not in _ST_DTYPES:
            raise InvalidPayload(f"entry {name!r}: unsupported dtype")
        off = info.get("data_offsets")
        shape = info.get("shape")
        if (not isinstance(off, list) or len(off) != 2 or not all(isinstance(o, int) for o in off)
                or not isinstance(shape, list) or not all(isinstance(s, int) and s >= 0 for s in shape)):
            raise InvalidPayload(f"entry {name!r}: malformed")
        size = _ST_DTYPES[info["dtype"]].itemsize * math.prod(shape)
        if not 0 <= off[0] <= off[1] <= data_len or off[1] - off[0] != size:
            raise InvalidPayload(f"entry {name!r}: size does not match its shape and dtype")
    meta = header.get("__metadata__")
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise InvalidPayload("not a diloco tensor payload")
    if meta.get("version") != VERSION:
        raise InvalidPayload(f"unsupported payload version {meta.get('version')!r}")
    if meta.get("method") not in METHODS:
        raise InvalidPayload(f"unknown compression {meta.get('method')!r}")
    return header


def _parse_metadata(md: dict) -> tuple[dict, dict | None]:
    try:
        spec = json.loads(md.get("tensors", ""))
        meta = json.loads(md["meta"]) if "meta" in md else None
    except json.JSONDecodeError as exc:
        raise InvalidPayload("payload metadata is not JSON") from exc
    if not isinstance(spec, dict):
        raise InvalidPayload("payload tensor list is malformed")
    for name, info in spec.items():
        if (not isinstance(info, dict) or info.get("dtype") not in _FLOAT_DTYPES
                or not isinstance(info.get("shape"), list)
                or not all(isinstance(s, int) and s >= 0 for s in info["shape"])):
            raise InvalidPayload(f"tensor {name!r}: malformed description")
    return spec, meta


def _load_entries(blob: bytes) -> dict[str, torch.Tensor]:
    """The safetensors entries, each copied once out of the blob (no copy of the blob itself)."""
    try:
        return st_load(blob if isinstance(blob, bytes) else bytes(blob))
    except Exception as exc:  # safetensors raises its own error types
        raise InvalidPayload(f"payload is not valid safetensors: {exc}") from exc


def _plain_tensor(entries: dict, name: str, info: dict, method: str) -> torch.Tensor:
    t = entries.get(f"t/{name}")
    want = _FLOAT_DTYPES[info["dtype"]] if method == "none" else torch.bfloat16
    if t is None or t.dtype != want or list(t.shape) != info["shape"]:
        raise InvalidPayload(f"tensor {name!r}: missing or wrong dtype/shape")
    return t if method == "none" else t.float()


def _quantized_pair(entries: dict, name: str, info: dict, method: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The (values, scales) entries of `name`, checked for presence, dtype and shape."""
    block = BLOCK[method]
    nblocks = max(1, -(-math.prod(info["shape"]) // block))
    q, s = entries.get(f"q/{name}"), entries.get(f"s/{name}")
    qlen = nblocks * block // (2 if method == "int4" else 1)
    qdtype = torch.uint8 if method == "int4" else torch.int8
    if (q is None or s is None or q.dtype != qdtype or s.dtype != torch.float32
            or list(q.shape) != [qlen] or list(s.shape) != [nblocks]):
        raise InvalidPayload(f"tensor {name!r}: quantized entries missing or malformed")
    return q, s


def _check_values(pairs: dict[str, tuple[torch.Tensor, torch.Tensor]], method: str,
                  allow_nonfinite: bool) -> None:
    """Every scale >= 0 (and finite unless allowed), no int8 value at -128: tested over all the
    tensors at once, then tensor by tensor only to name the first bad one."""
    def bad(q: torch.Tensor, s: torch.Tensor) -> str | None:
        if method == "int8" and bool((q == -128).any()):
            return "value out of the quantization range"
        if not allow_nonfinite and not bool(torch.isfinite(s).all()):
            return "non-finite scale (NaN/Inf)"
        if bool((s < 0).any()):
            return "negative scale"
        return None

    if not pairs or bad(*(torch.cat([p[i] for p in pairs.values()]) for i in (0, 1))) is None:
        return
    for name, (q, s) in pairs.items():
        if (reason := bad(q, s)) is not None:
            raise InvalidPayload(f"tensor {name!r}: {reason}")


def _quantized_tensors(entries: dict, spec: dict, method: str,
                       allow_nonfinite: bool) -> dict[str, torch.Tensor]:
    """Validate and dequantize every tensor; the small ones that `_quantize_all` pooled are
    dequantized as one, in one call, and returned as views into it."""
    pairs = {name: _quantized_pair(entries, name, info, method) for name, info in spec.items()}
    _check_values(pairs, method, allow_nonfinite)
    block = BLOCK[method]
    size = {name: math.prod(info["shape"]) for name, info in spec.items()}
    pooled = [n for n in spec if 0 < size[n] <= _POOL_MAX and size[n] % block == 0]
    alone = set(spec) - set(pooled)
    out = {n: _dequantize(*pairs[n], method, spec[n]["shape"]) for n in spec if n in alone}
    if pooled:
        q, s = (torch.cat([pairs[n][i] for n in pooled]) for i in (0, 1))
        whole = _dequantize(q, s, method, [sum(size[n] for n in pooled)])
        at = 0
        for n in pooled:
            out[n] = whole[at:at + size[n]].view(spec[n]["shape"])
            at += size[n]
    return {n: out[n] for n in spec}


def _entry_keys(spec: dict, method: str) -> set[str]:
    if method in ("none", "bf16"):
        return {f"t/{name}" for name in spec}
    if method in SPARSE_BITS:
        return {f"{k}/{name}" for name in spec for k in ("i", "q", "s")}
    return {f"{k}/{name}" for name in spec for k in ("q", "s")}


def decode_with_meta(blob: bytes, max_bytes: int = DEFAULT_MAX_BYTES,
                     allow_nonfinite: bool = False) -> tuple[dict[str, torch.Tensor], dict | None]:
    """Validate and decode a payload. Returns (tensors, meta). Raises InvalidPayload."""
    header = read_header(blob, max_bytes)
    md = header["__metadata__"]
    method = md["method"]
    spec, meta = _parse_metadata(md)
    entries = _load_entries(blob)
    if not checksum_matches(entries, md.get("wire_checksum")):
        raise InvalidPayload("checksum mismatch")
    if method in ("none", "bf16"):
        out = {name: _plain_tensor(entries, name, info, method) for name, info in spec.items()}
    elif method in SPARSE_BITS:
        density, chunk = _sparse_params(md)
        checked = _sparse_check(entries, spec, method, density, chunk, allow_nonfinite)
        out = densify(checked, {n: info["shape"] for n, info in spec.items()}, method, density)
    else:
        out = _quantized_tensors(entries, spec, method, allow_nonfinite)
    if set(entries) != _entry_keys(spec, method):
        raise InvalidPayload("payload holds unexpected entries")
    if not allow_nonfinite:
        names = list(out)
        bad = nonfinite_index([out[n] for n in names])
        if bad is not None:
            raise InvalidPayload(f"tensor {names[bad]!r}: holds NaN or Inf")
    return out, meta


def decode(blob: bytes, max_bytes: int = DEFAULT_MAX_BYTES) -> dict[str, torch.Tensor]:
    return decode_with_meta(blob, max_bytes)[0]


def roundtrip(tensors: dict[str, torch.Tensor], method: str) -> dict[str, torch.Tensor]:
    return decode(encode(tensors, method))


def compression_error(tensors: dict[str, torch.Tensor], method: str) -> float:
    """Relative L2 error ||decode(encode(x)) - x|| / ||x|| over all tensors together."""
    back = roundtrip(tensors, method)
    num = sum(float((back[n].float() - t.float()).pow(2).sum()) for n, t in tensors.items())
    den = sum(float(t.float().pow(2).sum()) for t in tensors.values())
    return math.sqrt(num / den) if den > 0 else math.sqrt(num)


def payload_bytes(numel: int, method: str, density: float = DEFAULT_DENSITY) -> int:
    """Approximate wire size of `numel` fp32 values (without header)."""
    if method in SPARSE_BITS:
        count, nchunks = sparse_sizes(numel, density)
        return 2 * count + -(-count * SPARSE_BITS[method] // 8) + 4 * nchunks
    if method == "none":
        return 4 * numel
    if method == "bf16":
        return 2 * numel
    block = BLOCK[method]
    nblocks = -(-numel // block)
    return nblocks * (block // (2 if method == "int4" else 1)) + 4 * nblocks
