// The model's size checked against the machine before anything is allocated: a config (or
// `--set model.n_layers=1000000`) describing a model larger than the machine's memory used to
// allocate layer after layer (5.2 GB) before failing somewhere. The weights' size comes from
// the closed-form count (param_counts.h, model_values: 4 bytes per value, the fp32 master
// weights every command that builds a model holds) and is compared with the memory this
// process may use (physical memory, or the cgroup's memory.max when smaller), for models built
// in the machine's memory (CPU; not a GPU's, not the meta device). Above it, the
// command stops with an error naming the size, the memory and the settings to change, before
// it writes or allocates anything. The full training footprint is memory_estimate.h's (shown
// by `spes config`), not checked here: a model that fits only for inference is still built.
#pragma once
#include <cstdint>
#include <string>

#include "spes/io/config.h"

namespace spes {

// Bytes of memory this process may use: the smaller of physical memory and a cgroup v2 limit
// (0 when neither can be read).
uint64_t machine_memory_bytes();

// Throws spes::Error (naming `origin`) when the fp32 weights of `m` alone exceed
// `memory_bytes` (default: machine_memory_bytes(); 0 means unknown, then nothing is checked).
void check_model_fits_memory(const ModelConfig& m, const std::string& origin,
                             uint64_t memory_bytes = machine_memory_bytes());

}  // namespace spes
