// The model's closed-form size against the machine's memory (see model_size_guard.h).
#include "spes/model/model_size_guard.h"

#include <unistd.h>

#include <algorithm>
#include <fstream>
#include <string>

#include "spes/common/error.h"
#include "spes/model/param_counts.h"

namespace spes {

uint64_t machine_memory_bytes() {
  const long pages = ::sysconf(_SC_PHYS_PAGES), page = ::sysconf(_SC_PAGE_SIZE);
  uint64_t bytes = pages > 0 && page > 0 ? static_cast<uint64_t>(pages) * static_cast<uint64_t>(page)
                                         : 0;
  std::ifstream cg("/sys/fs/cgroup/memory.max");
  std::string limit;
  if (cg >> limit && !limit.empty() &&
      std::all_of(limit.begin(), limit.end(), [](char c) { return c >= '0' && c <= '9'; })) {
    const uint64_t l = std::stoull(limit);
    if (l > 0 && (bytes == 0 || l < bytes)) bytes = l;
  }
  return bytes;
}

void check_model_fits_memory(const ModelConfig& m, const std::string& origin,
                             uint64_t memory_bytes) {
  if (memory_bytes == 0) return;
  const double values = model_values(m);
  const double bytes = 4.0 * values;
  constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;
  SPES_CHECK(bytes <= static_cast<double>(memory_bytes),
             "{}: the model has {:.4g} parameters, {:.1f} GiB as fp32 weights alone, more than "
             "this machine's {:.1f} GiB of memory; make it smaller (model.n_layers={}, "
             "d_model={}, mlp_hidden_size={}, moe_num_experts={}, vocab_size={}) or run it on a "
             "machine with more memory (`spes config` shows what a node needs)", origin, values,
             bytes / kGiB, static_cast<double>(memory_bytes) / kGiB, m.n_layers, m.d_model,
             m.mlp_hidden_size, m.moe_num_experts, m.vocab_size);
}

}  // namespace spes
