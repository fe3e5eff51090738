// The node memory estimate (model/memory_estimate.h) against figures worked out by hand: what
// frozen experts, the sync client's state and bf16 autocast add or save, and each term of the
// activations. tests/model/memory_measured_test.cpp compares it with a real step's tensors.
#include <gtest/gtest.h>

#include "tiny_model_config.h"
#include "spes/model/memory_estimate.h"
#include "spes/model/param_counts.h"
#include "spes/common/error.h"

namespace spes {
namespace {

using spes::testing::tiny_spes_config;

TEST(MemoryEstimate, FrozenExpertsHaveNoGradientsOrMoments) {
  Config cfg = tiny_spes_config();
  cfg.precision = "fp32";
  const ParamCounts node = param_counts(cfg, 0);
  NodeMemory m = node_memory(cfg, node);
  EXPECT_EQ(m.weights_by_dtype.size(), 1u);
  EXPECT_EQ(m.weights_by_dtype.at("fp32"), 4 * node.total);
  EXPECT_EQ(m.gradients, 4 * node.trainable);
  EXPECT_EQ(m.adam_moments, 8 * node.trainable);
  EXPECT_LT(node.trainable, node.total);
  EXPECT_EQ(m.total(), m.weights() + m.gradients + m.adam_moments + m.activations);
  EXPECT_EQ(m.sync_state, 0);  // fp32 blocking rounds keep nothing between them
  // Compressed deltas: the upload base and residual, fp32 per trainable value; overlap adds a
  // copy of every weight and of the trainable ones.
  Config sync = cfg;
  sync.spes_config.transfer.compression = "int8";
  EXPECT_EQ(node_memory(sync, node).sync_state, 8 * node.trainable);
  sync.spes_config.timing.overlap = true;
  const NodeMemory o = node_memory(sync, node);
  EXPECT_EQ(o.sync_state, 8 * node.trainable + 4 * node.total + 4 * node.trainable);
  EXPECT_EQ(o.total(), m.total() + o.sync_state);
  // Centralized: everything trains; the weights stay, gradients and moments grow by 12 bytes
  // for each value the SPES node froze.
  cfg.spes_config.mode = "centralized";
  const NodeMemory all = node_memory(cfg, param_counts(cfg, 0));
  EXPECT_EQ(all.weights(), m.weights());
  EXPECT_EQ(all.gradients + all.adam_moments - m.gradients - m.adam_moments,
            12 * (node.total - node.trainable));
  // bf16 autocast adds the bf16 copies of the weights and halves the activation values.
  cfg.precision = "amp_bf16";
  const NodeMemory bf = node_memory(cfg, param_counts(cfg, 0));
  EXPECT_EQ(bf.weights_by_dtype.at("bf16"), 2 * node.total);
  EXPECT_LT(bf.activations, all.activations);
}

// What a server sizes a node's share with (issue 38): a node training k experts per layer
// costs what node_memory says for a node of the config's map that trains k, in fp32 and
// amp_bf16 (frozen experts in bf16), and each expert more adds its gradient and moments (and,
// with frozen bf16 storage, the fp32 master it now needs).
TEST(MemoryEstimate, NodeTrainingKExpertsPerLayerEqualsTheNodeOfAMapWithK) {
  Config cfg = tiny_spes_config();  // 2 nodes, 2 of the 4 experts each
  cfg.model.mlp_hidden_size = 32;     // F = 16: grouped experts under amp_bf16
  cfg.spes_config.transfer.dtype = "bf16";  // frozen ones stored in bf16
  for (const char* precision : {"fp32", "amp_bf16"}) {
    Config at = cfg;
    at.precision = precision;
    const NodeMemory node = node_memory(at, param_counts(at, 1));
    const NodeMemory k2 = node_memory_training(cfg, 2, at.precision);
    EXPECT_EQ(k2.total(), node.total()) << precision;
    EXPECT_EQ(k2.weights_by_dtype, node.weights_by_dtype) << precision;
    EXPECT_EQ(param_counts_training(at, 2).trainable, param_counts(at, 1).trainable);
    const int64_t expert = 3 * 16 * 16;  // F x D values, three tensors
    const int64_t L = 2;
    const NodeMemory k3 = node_memory_training(cfg, 3, at.precision);
    const bool bf16 = std::string(precision) == "amp_bf16";
    EXPECT_EQ(k3.total() - k2.total(), L * expert * (4 + 8 + (bf16 ? 4 : 0))) << precision;
  }
  EXPECT_EQ(param_counts_training(cfg, 0).trainable, param_counts_training(cfg, 0).shared);
  EXPECT_THROW(param_counts_training(cfg, 5), Error);
  EXPECT_THROW(param_counts_training(cfg, -1), Error);
}

// What the server turns a node's declared memory into (issue 38 item 5): in fp32 a node of the
// tiny run needs 4 bytes per weight, 12 (gradient + both moments) per shared value and the
// activations of a micro-batch, and each expert per layer more adds 12 bytes per value of the
// L experts; the conversion gives the largest k that fits.
TEST(MemoryEstimate, DeclaredMemoryBecomesTheExpertsPerLayerItHolds) {
  Config cfg = tiny_spes_config();
  cfg.precision = "fp32";
  const ModelConfig& m = cfg.model;
  const int64_t E = m.moe_num_experts, L = m.n_layers;
  const ParamCounts none = param_counts_training(cfg, 0);
  const double base = 4.0 * static_cast<double>(none.total) +
                      12.0 * static_cast<double>(none.shared) +
                      static_cast<double>(activation_bytes(activation_shape(cfg)));
  const double per_expert = 12.0 * static_cast<double>(L * 3 * m.ffn_hidden_size() * m.d_model);
  EXPECT_EQ(static_cast<double>(node_memory_training(cfg, 0, Precision::Fp32).total()), base);
  for (int64_t k = 0; k <= E; ++k) {
    const double need = base + static_cast<double>(k) * per_expert;
    EXPECT_EQ(experts_within_memory(cfg, need, Precision::Fp32), k);
    EXPECT_EQ(experts_within_memory(cfg, need - 1, Precision::Fp32), k - 1);
  }
  EXPECT_EQ(experts_within_memory(cfg, 1e18, Precision::Fp32), E);
  EXPECT_EQ(experts_within_memory(cfg, 0, Precision::Fp32), -1);
  // At another precision the same bytes are judged with that precision's estimate.
  const double amp = static_cast<double>(node_memory_training(cfg, 1, Precision::AmpBf16).total());
  EXPECT_EQ(experts_within_memory(cfg, amp, Precision::AmpBf16), 1);
}

TEST(MemoryEstimate, ActivationsFollowTheDocumentedTerms) {
  ActivationShape s;
  s.micro_batch = 2, s.seq = 8, s.d_model = 16, s.layers = 2, s.heads = 4, s.kv_heads = 2;
  s.experts = 4, s.top_k = 2, s.ffn_hidden = 12, s.vocab = 32, s.value_bytes = 4;
  // Per token and layer: attention 5*16 + 3*8 + 4 + 1 = 109; MoE 2*16 + 1 + 2*4 +
  // 2*(2*16 + 3*12) = 177; head 2*16 + 1 = 33; logits 2 x 32 fp32 values per token.
  const int64_t per_token = 2 * (109 + 177) + 33;
  EXPECT_EQ(activation_bytes(s), 16 * (per_token * 4 + 2 * 32 * 4));
  ActivationShape twice = s;
  twice.micro_batch = 4;
  EXPECT_EQ(activation_bytes(twice), 2 * activation_bytes(s));  // linear in the tokens
  // Checkpointing every block: each keeps its input (16 values), one is recomputed in full.
  ActivationShape ckpt = s;
  ckpt.checkpoint_every = 1;
  EXPECT_EQ(activation_bytes(ckpt), 16 * ((2 * 16 + (109 + 177) + 33) * 4 + 2 * 32 * 4));
  ckpt.checkpoint_every = 2;  // block 0 only
  EXPECT_EQ(activation_bytes(ckpt), 16 * ((16 + 2 * (109 + 177) + 33) * 4 + 2 * 32 * 4));
  // The chunked head holds one chunk of rows of logits.
  ActivationShape chunked = s;
  chunked.logits_chunk_rows = 4;
  EXPECT_EQ(activation_bytes(chunked), 16 * per_token * 4 + 4 * 2 * 32 * 4);
  // A dense block: one slot, no router.
  ActivationShape dense = s;
  dense.experts = 0, dense.top_k = 1;
  EXPECT_EQ(activation_bytes(dense),
            16 * ((2 * (109 + 2 * 16 + 1 + (2 * 16 + 3 * 12)) + 33) * 4 + 2 * 32 * 4));
  // From a config: the micro-batch, the sequence and the model's shape.
  Config cfg;
  cfg.model = spes::testing::tiny_model_config();
  cfg.device_train_microbatch_size = 2;
  const ActivationShape from = activation_shape(cfg);
  EXPECT_EQ(from.micro_batch, 2);
  EXPECT_EQ(from.seq, 8);
  EXPECT_EQ(from.ffn_hidden, 12);
  EXPECT_EQ(from.vocab, 32);
  EXPECT_EQ(from.experts, 4);
}

}  // namespace
}  // namespace spes
