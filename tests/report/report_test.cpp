// Reports and plots: tick choice and chart geometry by hand, the SPES.md formulas, parameter
// counts and node memory against counts worked out from the model's dimensions, and run-directory
// readers against small hand-written metrics files.
#include <gtest/gtest.h>

#include <fstream>

#include "../data/data_test_util.h"
#include "../model/tiny_model_config.h"
#include "spes/common/error.h"
#include "spes/report/memory_formula.h"
#include "spes/report/param_counts.h"
#include "spes/report/run_compare.h"
#include "spes/report/run_data.h"
#include "spes/report/svg_chart.h"
#include "spes/report/transfer_formula.h"

namespace spes::report {
namespace {

TEST(SvgChart, NiceTicksAreRoundSteps) {
  EXPECT_EQ(nice_ticks(0, 1, 6), (std::vector<double>{0, 0.2, 0.4, 0.6000000000000001, 0.8, 1}));
  EXPECT_EQ(nice_ticks(3.7, 9.2, 8), (std::vector<double>{4, 5, 6, 7, 8, 9}));
  EXPECT_EQ(nice_ticks(0, 800000, 5), (std::vector<double>{0, 200000, 400000, 600000, 800000}));
  EXPECT_EQ(tick_label(1200000), "1.2M");
  EXPECT_EQ(tick_label(400000), "400k");
  EXPECT_EQ(tick_label(3.5), "3.5");
  EXPECT_EQ(tick_label(0.02), "0.02");
}

TEST(SvgChart, PointsLandWhereTheAxesSay) {
  // Plot area: x from 78 to 820-190=630 (552 px), y from 42 to 460-56=404 (362 px). y range
  // [0, 1] is padded by 4% on each side: [-0.04, 1.04].
  Series s{"a<b", {0, 10}, {0, 1}, false};
  const std::string svg = render_line_chart({s}, ChartOptions{});
  const double y0 = 42 + (1 - (0 + 0.04) / 1.08) * 362, y1 = 42 + (1 - (1 + 0.04) / 1.08) * 362;
  EXPECT_NE(svg.find(fmt::format("points=\"78.0,{:.1f} 630.0,{:.1f} \"", y0, y1)),
            std::string::npos)
      << svg;
  EXPECT_NE(svg.find("a&lt;b"), std::string::npos);  // labels are escaped
  EXPECT_EQ(svg.rfind("<svg", 0), 0u);
}

TEST(SvgChart, RefusesAChartWithNothingToDraw) {
  Series s{"nan", {1, 2}, {NAN, NAN}, false};
  EXPECT_THROW(render_line_chart({s}, ChartOptions{}), Error);
  Series bad{"ragged", {1, 2}, {1}, false};
  EXPECT_THROW(render_line_chart({bad}, ChartOptions{}), Error);
}

// The tiny model (d 16, 2 layers, 4 experts top-2, F 12, V 32) as a SPES run of 2 nodes.
Config tiny_spes_config() {
  Config cfg;
  cfg.model = spes::testing::tiny_model_config();
  cfg.spes_config.mode = "spes";
  cfg.spes_config.num_peers = 2;
  return cfg;
}

TEST(TransferFormula, MatchesCountsFromTheDimensions) {
  Config cfg = tiny_spes_config();
  const int64_t d = 16, L = 2, E = 4, F = 12, V = 32;
  const int64_t expert = 3 * d * F;                         // gate, up, down
  const int64_t X = L * E * expert;
  const int64_t per_layer = 4 * d * d /* q k v o */ + 2 * d /* q_norm, k_norm */ +
                            2 * d /* two RMSNorms */ + E * d /* router */;
  const int64_t S = 2 * V * d /* embedding, head */ + d /* final norm */ + L * per_layer;
  const TransferFormula f = transfer_formula(cfg, 1);
  EXPECT_EQ(f.expert_numel, X);
  EXPECT_EQ(f.shared_numel, S);
  EXPECT_EQ(f.own_expert_numel, L * 2 * expert);  // node 1 owns experts 2 and 3
  EXPECT_EQ(f.grad_and_optimizer_bytes(), 12 * (S + L * 2 * expert));
  EXPECT_EQ(f.upload_bytes(), 4 * (S + L * 2 * expert));
  EXPECT_EQ(f.download_bytes(), 4 * (S + X - L * 2 * expert));
  EXPECT_EQ(f.download_merge_bytes(), 4 * (S + X));

  cfg.spes_config.mode = "fedavg";
  cfg.spes_config.transfer.dtype = "bf16";
  const TransferFormula g = transfer_formula(cfg, 1);
  EXPECT_EQ(g.upload_bytes(), 2 * (S + X));
  EXPECT_EQ(g.download_bytes(), 2 * (S + X));
  EXPECT_EQ(g.grad_and_optimizer_bytes(), 12 * (S + X));
}

TEST(TransferFormula, CompressedUploadsAndDownloadsCountTheirEncoding) {
  Config cfg = tiny_spes_config();
  const int64_t n = transfer_formula(cfg, 0).trainable_numel();
  const int64_t down = transfer_formula(cfg, 0).download_bytes() / 4;  // values (fp32)
  const int64_t all = transfer_formula(cfg, 0).total_numel();
  cfg.spes_config.transfer.compression = "int8";
  const TransferFormula q = transfer_formula(cfg, 0);
  EXPECT_EQ(q.upload_bytes(), n + 4 * ((n + 255) / 256));  // 1 byte + a scale per 256 values
  EXPECT_EQ(q.download_bytes(), down + 4 * ((down + 255) / 256));  // the round's delta
  EXPECT_EQ(q.download_merge_bytes(), all + 4 * ((all + 255) / 256));
  cfg.spes_config.transfer.compression = "bf16";
  EXPECT_EQ(transfer_formula(cfg, 0).upload_bytes(), 2 * n);
  EXPECT_EQ(transfer_formula(cfg, 0).download_bytes(), 2 * down);
}

TEST(ParamCounts, MatchCountsFromTheDimensions) {
  Config cfg = tiny_spes_config();
  const int64_t d = 16, L = 2, E = 4, F = 12, V = 32;
  const int64_t expert = 3 * d * F, X = L * E * expert;
  const int64_t S = 2 * V * d + d + L * (4 * d * d + 2 * d + 2 * d + E * d);
  const ParamCounts c = param_counts(cfg, 1);
  EXPECT_EQ(c.total, S + X);
  EXPECT_EQ(c.shared, S);
  EXPECT_EQ(c.experts, X);
  EXPECT_EQ(c.own_experts, L * 2 * expert);
  EXPECT_EQ(c.trainable, S + L * 2 * expert);
  EXPECT_EQ(c.active_per_token, S + L * 2 * expert);  // top-2 of 4
  cfg.frozen_experts = {"*:2"};  // frozen on every node: neither trained nor owned-and-trained
  EXPECT_EQ(param_counts(cfg, 1).trainable, S + L * expert);
  cfg.model.embedding_size = 40;  // padded rows in the embedding and the head
  EXPECT_EQ(param_counts(cfg, 1).total, S + X + 2 * 8 * d);
}

TEST(MemoryFormula, FrozenExpertsHaveNoGradientsOrMoments) {
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

TEST(MemoryFormula, ActivationsFollowTheDocumentedTerms) {
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

void write_lines(const std::filesystem::path& p, const std::vector<std::string>& lines) {
  std::filesystem::create_directories(p.parent_path());
  std::ofstream out(p);
  for (const auto& l : lines) out << l << "\n";
}

TEST(RunData, ClusterCurvesUseClusterTokensAndSplitMergeRounds) {
  spes::test::TempDir dir;
  const auto d = dir.path;
  write_lines(d / "node0/metrics.jsonl",
              {R"({"step":1,"tokens":100,"loss":5,"peak_rss_mb":10,"memory":{"trainable_numel":7,"grad_bytes":28,"optimizer_state_bytes":56}})",
               R"({"step":2,"tokens":200,"loss":4,"val_loss":4.5,"peak_rss_mb":12,"sync":{"round":1,"bytes_up":1000,"bytes_down":3000,"alpha":0}})",
               R"({"step":4,"tokens":400,"loss":3,"val_loss":3.5,"peak_rss_mb":11,"sync":{"round":2,"bytes_up":1000,"bytes_up_sent":900,"bytes_down":5000,"bytes_down_wire":4000,"alpha":0.05}})"});
  write_lines(d / "node1/metrics.jsonl",
              {R"({"step":1,"tokens":100,"loss":7,"peak_rss_mb":20})",
               R"({"step":2,"tokens":200,"loss":6,"val_loss":4.5,"peak_rss_mb":21})",
               R"({"step":4,"tokens":400,"loss":5,"val_loss":3.5,"peak_rss_mb":19})"});
  write_lines(d / "server/rounds.jsonl", {R"({"round":1,"peak_rss_mb":30})",
                                          R"({"round":2,"peak_rss_mb":33})"});
  const RunData run = load_run(d.string(), "x");
  EXPECT_TRUE(run.cluster);
  ASSERT_EQ(run.nodes.size(), 2u);
  const Series val = val_loss_series(run);
  EXPECT_EQ(val.x, (std::vector<double>{400, 800}));
  EXPECT_EQ(val.y, (std::vector<double>{4.5, 3.5}));
  const Series tr = train_loss_series(run, -1, 2);  // means 6, 5, 4; moving average of 2
  EXPECT_EQ(tr.x, (std::vector<double>{200, 400, 800}));
  EXPECT_EQ(tr.y, (std::vector<double>{6, 5.5, 4.5}));
  const RunSummary s = summarize(run);
  EXPECT_EQ(s.tokens, 800);
  EXPECT_EQ(s.steps, 4);
  EXPECT_DOUBLE_EQ(s.final_val_loss, 3.5);
  EXPECT_DOUBLE_EQ(s.peak_rss_mb, 21);
  EXPECT_DOUBLE_EQ(s.server_peak_rss_mb, 33);
  EXPECT_EQ(s.rounds, 2);
  // Bytes on the wire: coded sizes where a record has them (round 2), else stream sizes.
  EXPECT_DOUBLE_EQ(s.bytes_up, 950);
  EXPECT_DOUBLE_EQ(s.bytes_down_plain, 3000);
  EXPECT_DOUBLE_EQ(s.bytes_down_merge, 4000);
  EXPECT_EQ(s.grad_bytes, 28);
  EXPECT_EQ(s.optimizer_state_bytes, 56);
  const std::string table = markdown_comparison({run});
  EXPECT_NE(table.find("| x | - | 2 | 800 | 3.5000 | 21 MiB |"), std::string::npos) << table;
}

TEST(RunData, RefusesADirectoryWithoutARun) {
  spes::test::TempDir dir;
  try {
    load_run(dir.path.string());
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("not a run directory"), std::string::npos);
  }
}

}  // namespace
}  // namespace spes::report
