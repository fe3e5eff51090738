# Independent reference of the compressed-delta codec (src/spes/sync/wire/delta_kernels.h):
# reads fp32 deltas and previous values from raw files, writes what numpy / PyTorch compute.
#   delta_reference.py DELTA.f32 PREV.f32 BLOCK OUT_PREFIX
# Writes OUT_PREFIX.q.i8, .scales.f32 (int8: scale = max|d|/127 per block, q = rint(d/scale)
# clamped to [-127, 127], 0 where the scale is 0), .rebuilt.f32 (prev + q * scale, fp32 ops),
# .bf16.u16 (torch's round-to-nearest-even bf16 bits), .rebuilt_bf16.f32 (prev + bf16 value).
import sys

import numpy as np
import torch

d = np.fromfile(sys.argv[1], dtype=np.float32)
prev = np.fromfile(sys.argv[2], dtype=np.float32)
block = int(sys.argv[3])
out = sys.argv[4]
n = d.size
blocks = (n + block - 1) // block
q = np.zeros(n, dtype=np.int8)
scales = np.zeros(blocks, dtype=np.float32)
rebuilt = np.zeros(n, dtype=np.float32)
for b in range(blocks):
    x = d[b * block:(b + 1) * block]
    s = np.float32(np.max(np.abs(x))) / np.float32(127.0)
    scales[b] = s
    if s > 0:
        v = np.clip(np.rint(x / s), -127, 127)
    else:
        v = np.zeros_like(x)
    q[b * block:(b + 1) * block] = v.astype(np.int8)
    rebuilt[b * block:(b + 1) * block] = (
        prev[b * block:(b + 1) * block] + q[b * block:(b + 1) * block].astype(np.float32) * s)
q.tofile(out + ".q.i8")
scales.tofile(out + ".scales.f32")
rebuilt.tofile(out + ".rebuilt.f32")
bf = torch.from_numpy(d.copy()).to(torch.bfloat16)
bf.view(torch.int16).numpy().astype(np.int16).tofile(out + ".bf16.u16")
(torch.from_numpy(prev.copy()) + bf.to(torch.float32)).numpy().tofile(out + ".rebuilt_bf16.f32")
