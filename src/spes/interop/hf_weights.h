// Hugging Face weight files: model.safetensors, or shards model-0000i-of-0000n.safetensors listed
// in model.safetensors.index.json ({"metadata": {"total_size"}, "weight_map": name -> file}).
// Reading checks that the index and the shards agree (every listed tensor present in its shard,
// no tensor in two places); writing tags each file {"format": "pt"} as transformers expects.
// Leaves out: pickle checkpoints (pytorch_model.bin) are refused, never unpickled.
#pragma once
#include <torch/torch.h>

#include <string>
#include <vector>

#include "spes/io/safetensors.h"

namespace spes {

// Every tensor of the HF directory `dir`, in file order, in its stored dtype.
NamedTensors hf_read_weights(const std::string& dir);

// Writes `tensors` converted to `dtype` into `dir` (which must exist): one model.safetensors
// when they fit in max_shard_bytes, else shards plus the index. Returns the file names written.
std::vector<std::string> hf_write_weights(const std::string& dir, const NamedTensors& tensors,
                                          torch::ScalarType dtype, int64_t max_shard_bytes);

// "5GB" (10^9), "500MB", "2GiB" (2^30), "1024KiB", "123" (bytes) -> bytes. `what` names the
// option in errors.
int64_t parse_byte_size(const std::string& s, const std::string& what);

// "float32" | "bfloat16" | "float16" (also fp32, bf16, fp16) -> dtype, and back (torch_dtype).
torch::ScalarType hf_dtype_from_name(const std::string& name);
std::string hf_dtype_name(torch::ScalarType t);

}  // namespace spes
