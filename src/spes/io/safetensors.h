// safetensors: an 8-byte little-endian header length, a JSON header (name -> dtype, shape,
// data_offsets; optional "__metadata__" of string pairs), then raw little-endian data.
// The reader trusts nothing: sizes, offsets, overlaps and dtypes are all checked (the header
// codec is safetensors_header.h, shared with the sync streams).
#pragma once
#include <torch/torch.h>

#include <string>
#include <utility>
#include <vector>

#include "spes/io/safetensors_header.h"

namespace spes {

using NamedTensors = std::vector<std::pair<std::string, torch::Tensor>>;

// Serialises tensors (any device; copied to CPU contiguous) into safetensors bytes.
std::string safetensors_serialize(const NamedTensors& tensors, const Metadata& metadata = {});
// Parses safetensors bytes. `origin` names the source in errors. Tensors are CPU copies.
NamedTensors safetensors_parse(const std::string& bytes, Metadata* metadata = nullptr,
                               const std::string& origin = "safetensors data");
// File versions; save is atomic (temporary file, fsync, rename).
void safetensors_save(const std::string& path, const NamedTensors& tensors,
                      const Metadata& metadata = {});
NamedTensors safetensors_load(const std::string& path, Metadata* metadata = nullptr);

}  // namespace spes
