# Independent reference of the top-k sparse delta codec (src/spes/sync/wire/topk_kernels.h):
# reads fp32 deltas and previous values from raw files and writes what numpy computes.
#   topk_reference.py DELTA.f32 PREV.f32 CHUNK DENSITY BITS OUT_PREFIX
# Per chunk of CHUNK values: k = max(1, min(len, ceil(DENSITY x len))); the k nonzero values of
# largest magnitude (equal magnitudes: the lower position first); scale = max|selected| /
# 2^(BITS-1) in fp32; magnitude = rint(|v| / scale) clipped to at most 2^(BITS-1), and an entry
# whose magnitude rounds to 0 is not sent; deq = +- magnitude x scale (fp32). Writes OUT_PREFIX.deq.f32 (dense, 0 where nothing is sent) and
# .rebuilt.f32 (prev + deq where sent, prev elsewhere, fp32 adds).
import math
import sys

import numpy as np

d = np.fromfile(sys.argv[1], dtype=np.float32)
prev = np.fromfile(sys.argv[2], dtype=np.float32)
chunk, density, bits, out = int(sys.argv[3]), float(sys.argv[4]), int(sys.argv[5]), sys.argv[6]
levels = np.float32(2 ** (bits - 1))
deq = np.zeros_like(d)
rebuilt = prev.copy()
for lo in range(0, d.size, chunk):
    x = d[lo:lo + chunk]
    k = max(1, min(x.size, math.ceil(density * x.size)))
    nz = np.nonzero(x != 0)[0]
    # lexsort: last key is primary: magnitude descending, then position ascending
    order = np.lexsort((nz, -np.abs(x[nz]).astype(np.float64)))
    sel = np.sort(nz[order[:k]])
    if sel.size == 0:
        continue
    scale = np.float32(np.max(np.abs(x[sel]))) / levels
    if not scale > 0:
        continue
    mag = np.minimum(np.rint(np.abs(x[sel]) / scale), levels).astype(np.float32)
    sel, mag = sel[mag >= 1], mag[mag >= 1]
    v = (mag * scale).astype(np.float32)
    v = np.where(x[sel] < 0, -v, v).astype(np.float32)
    deq[lo + sel] = v
    rebuilt[lo + sel] = (prev[lo + sel] + v).astype(np.float32)
deq.tofile(out + ".deq.f32")
rebuilt.tofile(out + ".rebuilt.f32")
