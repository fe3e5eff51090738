// Uses an installed spes library from another CMake project: parses a YAML config with the
// reference key names (and sees a typo rejected), builds the tiny MoE model it describes and
// runs one forward pass.
#include <spes/common/error.h>
#include <spes/io/config.h>
#include <spes/model/transformer.h>

#include <iostream>

int main() {
  const spes::Config c = spes::config_parse(
      "model:\n  d_model: 32\n  n_layers: 2\n  n_heads: 4\n  mlp_hidden_size: 64\n"
      "  moe_num_experts: 4\n  vocab_size: 64\n  max_sequence_length: 16\n",
      {"model.moe_top_k=2"}, "consumer.yaml");
  try {
    spes::config_parse("model:\n  d_modle: 5\n", {}, "typo.yaml");
    return 1;
  } catch (const spes::Error& e) {
    std::cout << "rejected: " << e.what() << "\n";
  }
  spes::Transformer model(c.model);
  model.init_weights(1);
  torch::NoGradGuard ng;
  const torch::Tensor logits = model.logits(torch::randint(0, 64, {1, 16}, torch::kInt64));
  std::cout << "spes " << SPES_VERSION << ": " << model.num_params() << " parameters, logits ["
            << logits.size(0) << ", " << logits.size(1) << ", " << logits.size(2) << "]\n";
  return logits.size(2) == 64 && torch::isfinite(logits).all().item<bool>() ? 0 : 1;
}
