// The model shape of the sync benchmarks (bench/sync_bench, bench/topk_bench): by default the
// d_model 512 shape of bench/train_bench (about 117M parameters, 8 experts), its command-line
// options (--d-model, --layers, --heads, --experts, --hidden, --vocab) and the model section
// of a config built from it.
#pragma once
#include <cstdint>
#include <string>

#include "spes/io/config.h"

namespace spes::bench {

struct SyncShape {
  int64_t d_model = 512, n_layers = 8, n_heads = 8, experts = 8, top_k = 2, hidden = 1024;
  int64_t vocab = 8192, seq = 256;

  // Takes option `k` with value `v` when it is one of the shape's; false otherwise.
  bool parse(const std::string& k, const std::string& v) {
    int64_t* field = k == "--d-model" ? &d_model : k == "--layers" ? &n_layers
                     : k == "--heads" ? &n_heads : k == "--experts" ? &experts
                     : k == "--hidden" ? &hidden : k == "--vocab" ? &vocab : nullptr;
    if (!field) return false;
    *field = std::stoll(v);
    return true;
  }

  void apply(spes::Config& c) const {
    c.model.d_model = d_model;
    c.model.n_layers = n_layers;
    c.model.n_heads = n_heads;
    c.model.moe_num_experts = experts;
    c.model.moe_top_k = top_k;
    c.model.set_ffn_hidden_size(hidden);
    c.model.vocab_size = vocab;
    c.model.max_sequence_length = seq;
  }
};

}  // namespace spes::bench
