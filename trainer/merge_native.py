"""The syncer's merge as a two-pass C loop, built on first use with the system's C compiler.

Done with torch ops, even cache-blocked (`trainer.fused`), the merge runs at about a third of
a plain `add_` over the same tensors: every op is one more pass and the K dot products and the
Nesterov step cost as much as the combine. Here each tensor takes two passes: (1) the weighted
sum of the K contributions, its squared norm and the K dot products with it, block by block
in L1; (2) the scale (RDA), the Nesterov step and the weights. That is the memory traffic of
about K + 6 tensor passes, against 3K for the K-pass `add_` it is measured against.

Every element is rounded as torch rounds it: a multiply-add is fused exactly where torch's
vector kernels fuse one (`add_(x, alpha=a)` is an FMA, `mul_` then `add_` is not; the file is
built with `-ffp-contract=off` so the compiler fuses nothing else) and RDA's scale comes from
torch's own norm, so the weights and the momentum come out with the torch path's bits
(tests/trainer/test_merge_native.py). Only the reported norms and dot products (health
metrics) are summed in another order.

Nothing in a job spec reaches this module: the source is this file's constant, the compiler is
`$CC` or `cc` from the operator's environment, and the library is cached per source hash under
`$DILOCO_NATIVE_DIR` (default `~/.cache/diloco-platform/native`). Without a compiler, or with
`DILOCO_NATIVE_MERGE=0`, `kernel()` returns None and the syncer keeps the torch path.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import torch

SOURCE = r"""
#include <math.h>
#include <stdint.h>

#define BLK 512

/* u = the K contributions combined as torch combines them: `fused` (the weighted mean)
   u = d0 a0, then u = fma(a_k, d_k, u) as add_(d, alpha=a) does; otherwise (RDA's addcmul)
   u = u + (a_k d_k) rounded twice. out[0] += sum u^2, out[1 + k] += sum d_k u. */
void diloco_combine(int64_t n, int32_t k, const float *const *d, const float *alpha,
                    int32_t fused, float *u, double *out) {
    for (int64_t j0 = 0; j0 < n; j0 += BLK) {
        int64_t m = n - j0 < BLK ? n - j0 : BLK;
        float *ub = u + j0;
        const float *d0 = d[0] + j0;
        float a0 = alpha[0];
        for (int64_t j = 0; j < m; j++) ub[j] = d0[j] * a0;
        for (int32_t c = 1; c < k; c++) {
            const float *dc = d[c] + j0;
            float ac = alpha[c];
            if (fused)
                for (int64_t j = 0; j < m; j++) ub[j] = fmaf(ac, dc[j], ub[j]);
            else
                for (int64_t j = 0; j < m; j++) ub[j] = ub[j] + ac * dc[j];
        }
        float ss = 0.0f;
        #pragma omp simd reduction(+:ss)
        for (int64_t j = 0; j < m; j++) ss += ub[j] * ub[j];
        out[0] += ss;
        for (int32_t c = 0; c < k; c++) {
            const float *dc = d[c] + j0;
            float dot = 0.0f;
            #pragma omp simd reduction(+:dot)
            for (int64_t j = 0; j < m; j++) dot += dc[j] * ub[j];
            out[1 + c] += dot;
        }
    }
}

/* torch.optim.SGD's step in torch's roundings: g = u scale; mode 0: theta = fma(-lr, g, theta);
   1: b = g; 2: b = (b mu) + g; then (1, 2) g = fma(mu, b, g), theta = fma(-lr, g, theta).
   g is left in u, as the torch path leaves it. */
void diloco_step(int64_t n, float *u, float *b, float *theta, float scale, float mu, float lr,
                 int32_t mode) {
    float nlr = -lr;
    if (mode == 0) {
        for (int64_t j = 0; j < n; j++) {
            float g = u[j] * scale;
            u[j] = g;
            theta[j] = fmaf(nlr, g, theta[j]);
        }
        return;
    }
    for (int64_t j = 0; j < n; j++) {
        float g = u[j] * scale;
        float bj = mode == 1 ? g : b[j] * mu + g;
        b[j] = bj;
        g = fmaf(mu, bj, g);
        u[j] = g;
        theta[j] = fmaf(nlr, g, theta[j]);
    }
}
"""

_lock = threading.Lock()
_loaded: list[ctypes.CDLL | None] = []


def _cache_dir() -> Path:
    default = Path.home() / ".cache" / "diloco-platform" / "native"
    return Path(os.environ.get("DILOCO_NATIVE_DIR", default))


def _build(target: Path) -> None:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise OSError("no C compiler")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        src = Path(tmp) / "merge.c"
        src.write_text(SOURCE)
        out = Path(tmp) / target.name
        flags = ["-O3", "-ffp-contract=off", "-fopenmp-simd", "-fno-math-errno", "-shared", "-fPIC"]
        try:  # this CPU's vector width; the cache key holds its flags, so no other CPU loads it
            subprocess.run([cc, *flags, "-march=native", str(src), "-o", str(out)],
                           check=True, capture_output=True, timeout=120)
        except subprocess.CalledProcessError:
            subprocess.run([cc, *flags, str(src), "-o", str(out)],
                           check=True, capture_output=True, timeout=120)
        os.replace(out, target)  # atomic: a concurrent builder's file is as good as ours


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return ""


def _load() -> ctypes.CDLL | None:
    machine = SOURCE + sys.platform + os.uname().machine + _cpu_flags()
    key = hashlib.sha256(machine.encode()).hexdigest()[:16]
    target = _cache_dir() / f"merge-{key}.so"
    try:
        if not target.exists():
            _build(target)
        lib = ctypes.CDLL(str(target))
    except (OSError, subprocess.SubprocessError):
        return None
    i64, i32, f32 = ctypes.c_int64, ctypes.c_int32, ctypes.c_float
    ptr = ctypes.c_void_p
    lib.diloco_combine.argtypes = [i64, i32, ptr, ptr, i32, ptr, ptr]
    lib.diloco_combine.restype = None
    lib.diloco_step.argtypes = [i64, ptr, ptr, ptr, f32, f32, f32, i32]
    lib.diloco_step.restype = None
    return lib


def kernel() -> ctypes.CDLL | None:
    """The compiled merge, or None where it is switched off or cannot be built."""
    if os.environ.get("DILOCO_NATIVE_MERGE", "1") == "0":
        return None
    with _lock:
        if not _loaded:
            _loaded.append(_load())
        return _loaded[0]


def usable(t: torch.Tensor) -> bool:
    """Whether the C loop can read `t` in place: fp32, contiguous, in host memory."""
    return t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous()


@torch.no_grad()
def native_merge(
    lib: ctypes.CDLL,
    offsets: list[tuple[int, int]],
    deltas: list[list[torch.Tensor]],
    alpha: list[list[float]],
    magnitude: list[float] | None,
    embedding: list[bool] | None,
    acc: torch.Tensor,
    params: torch.Tensor,
    momentum: torch.Tensor | None,
    lr: float,
    mu: float,
    fresh: bool,
) -> tuple[list[float], list[float]]:
    """`trainer.fused.fused_merge` in two C passes per tensor; `alpha[i][m]` is contribution m's
    weight for tensor i, `offsets[i]` the tensor's (start, end) in the flat buffers."""
    k = len(deltas)
    mode = 0 if momentum is None else (1 if fresh else 2)
    ptrs = (ctypes.c_void_p * k)()
    weights = (ctypes.c_float * k)()
    out = (ctypes.c_double * (k + 1))()
    acc_p, par_p = acc.data_ptr(), params.data_ptr()
    mom_p = momentum.data_ptr() if momentum is not None else None
    norms: list[float] = []
    dots = [0.0] * k
    for i, (s, e) in enumerate(offsets):
        n = e - s
        for m in range(k):
            ptrs[m] = deltas[m][i].data_ptr()
            weights[m] = alpha[i][m]
        ctypes.memset(out, 0, ctypes.sizeof(out))
        lib.diloco_combine(n, k, ptrs, weights, int(magnitude is None), acc_p + 4 * s, out)
        direction = out[0] ** 0.5
        scale = 1.0
        if magnitude is not None:  # the scale from torch's own norm, so the weights keep its bits
            direction = float(torch.linalg.vector_norm(acc[s:e]))
            if not embedding[i] and direction > 0:
                scale = magnitude[i] / direction
        lib.diloco_step(n, acc_p + 4 * s, None if mom_p is None else mom_p + 4 * s, par_p + 4 * s,
                        scale, mu, lr, mode)
        norms.append(direction * abs(scale))
        for m in range(k):
            dots[m] += scale * out[1 + m]
    return norms, dots
