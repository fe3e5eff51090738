// Reports and plots: tick choice and chart geometry by hand, the SPES.md formulas against
// counts worked out from the model's dimensions, and run-directory readers against small
// hand-written metrics files.
#include <gtest/gtest.h>

#include <fstream>
#include <regex>

#include "../data/data_test_util.h"
#include "../model/tiny_model_config.h"
#include "interop/cli_run.h"
#include "spes/common/error.h"
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

TEST(TransferFormula, MatchesCountsFromTheDimensions) {
  Config cfg = spes::testing::tiny_spes_config();
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
  Config cfg = spes::testing::tiny_spes_config();
  const int64_t n = transfer_formula(cfg, 0).trainable_numel();
  const int64_t down = transfer_formula(cfg, 0).download_bytes() / 4;  // values (fp32)
  const int64_t all = transfer_formula(cfg, 0).total_numel();
  // Down: the averaged shared tensors, then the other owners' experts (counted apart).
  const int64_t shared = transfer_formula(cfg, 0).shared_numel, others = down - shared;
  auto int8_bytes = [](int64_t v) { return v + 4 * ((v + 255) / 256); };
  cfg.spes_config.transfer.compression = "int8";
  const TransferFormula q = transfer_formula(cfg, 0);
  EXPECT_EQ(q.upload_bytes(), n + 4 * ((n + 255) / 256));  // 1 byte + a scale per 256 values
  EXPECT_EQ(q.download_bytes(), int8_bytes(shared) + int8_bytes(others));  // the round's delta
  EXPECT_EQ(q.download_merge_bytes(), all + 4 * ((all + 255) / 256));
  cfg.spes_config.transfer.compression = "bf16";
  EXPECT_EQ(transfer_formula(cfg, 0).upload_bytes(), 2 * n);
  EXPECT_EQ(transfer_formula(cfg, 0).download_bytes(), 2 * down);
  // topk: the codec's expected payload, both ways, with the config's density and bits.
  cfg.spes_config.transfer.compression = "topk";
  cfg.spes_config.transfer.topk_density = 0.02;
  cfg.spes_config.transfer.topk_bits = 3;
  const TransferFormula t = transfer_formula(cfg, 0);
  EXPECT_EQ(t.upload_bytes(),
            static_cast<int64_t>(sync::topk_expected_bytes(n, sync::TopkParams{0.02, 3})));
  auto topk_bytes = [](int64_t v, double density) {
    return static_cast<int64_t>(sync::topk_expected_bytes(v, sync::TopkParams{density, 3}));
  };
  EXPECT_EQ(t.download_bytes(), topk_bytes(shared, 0.02) + topk_bytes(others, 0.02));
  EXPECT_LT(t.upload_bytes() * 50, 4 * n);  // 2% of the values at about 10 bits each
  // A denser way down: the averaged tensors (and a merge round's everything) at its density,
  // the other owners' experts as uploaded; the upload does not change.
  cfg.spes_config.transfer.topk_down_density = 0.08;
  const TransferFormula w = transfer_formula(cfg, 0);
  EXPECT_EQ(w.upload_bytes(), t.upload_bytes());
  EXPECT_EQ(w.download_bytes(), topk_bytes(shared, 0.08) + topk_bytes(others, 0.02));
  EXPECT_EQ(w.download_merge_bytes(), topk_bytes(all, 0.08));
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

// The x tick labels of an SVG chart (the centred texts under the plot, less the axis label).
std::vector<std::string> x_tick_labels(const std::string& svg, const std::string& axis_label) {
  std::vector<std::string> ticks;
  const std::regex text(R"re(<text x="[0-9.]+" y="[0-9.]+" text-anchor="middle">([^<]*)</text>)re");
  for (std::sregex_iterator it(svg.begin(), svg.end(), text), e; it != e; ++it)
    if ((*it)[1] != axis_label) ticks.push_back((*it)[1]);
  return ticks;
}

TEST(RunPlots, RoundAndTokenAxesTickAtWholeNumbers) {
  // Three rounds and runs of a few tokens: nice steps alone would put ticks at 1.5 and 2.5.
  spes::test::TempDir dir;
  for (const char* run : {"a", "b"}) {
    write_lines(dir.path / run / "node0/metrics.jsonl",
                {R"({"step":1,"tokens":2,"loss":5,"val_loss":5.5})",
                 R"({"step":2,"tokens":4,"loss":4,"val_loss":4.5})"});
    write_lines(dir.path / run / "server/rounds.jsonl",
                {R"({"round":1,"bytes_in":1048576,"seconds":1,"alpha":0})",
                 R"({"round":2,"bytes_in":1048576,"seconds":2,"alpha":0})",
                 R"({"round":3,"bytes_in":1048576,"seconds":1,"alpha":0.1})"});
  }
  const auto one = spes::interop_test::run_spes(dir, {"plot", dir.file("a")});
  ASSERT_EQ(one.code, 0) << one.err;
  const auto several = spes::interop_test::run_spes(
      dir, {"plot", dir.file("a"), dir.file("b"), "--out", dir.file("both.svg"), "--smooth", "1"});
  ASSERT_EQ(several.code, 0) << several.err;
  const std::vector<std::pair<std::string, std::string>> charts = {
      {dir.file("a/plots/rounds.svg"), "round"},
      {dir.file("a/plots/round_time.svg"), "round"},
      {dir.file("a/plots/loss.svg"), "tokens (whole cluster)"},
      {dir.file("both.svg"), "tokens (whole cluster)"}};
  for (const auto& [path, axis] : charts) {
    const auto ticks = x_tick_labels(spes::interop_test::slurp(path), axis);
    EXPECT_GE(ticks.size(), 2u) << path;
    for (const auto& t : ticks)
      EXPECT_TRUE(std::regex_match(t, std::regex("-?[0-9]+"))) << path << ": tick " << t;
  }
}

TEST(RunPlots, TheLegendOfSeveralRunsFitsInTheChart) {
  // Long run names (directories as users name them) and more runs than the default height
  // has legend rows for: every label must end inside the chart, every row above its bottom.
  spes::test::TempDir dir;
  std::vector<std::string> args = {"plot"};
  std::vector<std::string> labels;
  for (int i = 0; i < 24; ++i) {
    const std::string run =
        fmt::format("olmoe-4node-compressed-overlap-lr3e-4-warmup100-{:02d}", i);
    write_lines(dir.path / run / "metrics.jsonl",
                {fmt::format(R"({{"step":1,"tokens":1000,"loss":5,"val_loss":{}}})", 5 + i * 0.01),
                 fmt::format(R"({{"step":2,"tokens":2000,"loss":4,"val_loss":{}}})",
                             4 + i * 0.01)});
    args.push_back(dir.file(run));
    labels.push_back(run);
  }
  args.insert(args.end(), {"--out", dir.file("all.svg")});
  const auto r = spes::interop_test::run_spes(dir, args);
  ASSERT_EQ(r.code, 0) << r.err;
  const std::string svg = spes::interop_test::slurp(dir.file("all.svg"));
  std::smatch size;
  const std::regex svg_size(R"re(<svg [^>]*width="([0-9]+)" height="([0-9]+)")re");
  ASSERT_TRUE(std::regex_search(svg, size, svg_size));
  const double width = std::stod(size[1]), height = std::stod(size[2]);
  // 12 px DejaVu Sans: lower case, digits and '-' advance at most 0.65 em (7.8 px).
  size_t found = 0;
  const std::regex text(R"re(<text x="([0-9.]+)" y="([0-9.]+)">([^<]*)</text>)re");
  for (std::sregex_iterator it(svg.begin(), svg.end(), text), e; it != e; ++it) {
    const std::string label = (*it)[3];
    if (std::find(labels.begin(), labels.end(), label) == labels.end()) continue;
    ++found;
    EXPECT_LE(std::stod((*it)[1]) + 7.8 * label.size(), width) << label;
    EXPECT_LE(std::stod((*it)[2]), height - 4) << label;
  }
  EXPECT_EQ(found, labels.size());
}

// The ownership-epoch marks of an SVG chart: (x of the dashed line, label).
std::vector<std::pair<double, std::string>> epoch_marks_of(const std::string& svg) {
  std::vector<std::pair<double, std::string>> marks;
  const std::regex mark(R"re(<g class="mark"><line x1="([0-9.]+)"[^>]*/><text [^>]*>([^<]*)</text></g>)re");
  for (std::sregex_iterator it(svg.begin(), svg.end(), mark), e; it != e; ++it)
    marks.emplace_back(std::stod((*it)[1]), (*it)[2]);
  return marks;
}

// The x of the dots (markers) of an SVG chart.
std::vector<double> dot_xs(const std::string& svg) {
  std::vector<double> xs;
  const std::regex dot(R"re(<circle cx="([0-9.]+)")re");
  for (std::sregex_iterator it(svg.begin(), svg.end(), dot), e; it != e; ++it)
    xs.push_back(std::stod((*it)[1]));
  return xs;
}

TEST(RunPlots, EveryChartOfARunMarksTheRoundsThatStartAnOwnershipEpoch) {
  // Round 3 (step 6) handed node 3's experts 6 and 7 to nodes 0 and 1: epoch 1 from round 4.
  // Each chart marks it where its own x axis puts it: round 4 (rounds charts), step 6
  // (similarity), the cluster tokens at step 6 (loss), each where a data point of that x lies.
  spes::test::TempDir dir;
  for (const char* run : {"elastic", "fixed"}) {
    for (int node = 0; node < 2; ++node) {
      std::vector<std::string> lines;
      for (int step = 2; step <= 10; step += 2)
        lines.push_back(fmt::format(R"({{"step":{},"tokens":{},"loss":{},"val_loss":{}}})", step,
                                    100 * step, 6 - 0.1 * step, 6.5 - 0.1 * step));
      write_lines(dir.path / run / fmt::format("node{}/metrics.jsonl", node), lines);
    }
    std::vector<std::string> rounds;
    for (int r = 1; r <= 5; ++r) {
      std::string extra;
      if (std::string(run) == "elastic" && r == 3)
        extra = R"(,"ownership_next":{"epoch":1,"from_round":4,"fingerprint":"f"},"handoffs":[)"
                R"({"layer":0,"expert":6,"from":3,"to":0,"why":"killed","round":4},)"
                R"({"layer":0,"expert":7,"from":3,"to":1,"why":"killed","round":4}])";
      rounds.push_back(fmt::format(R"({{"round":{},"step":{},"bytes_in":1048576,"seconds":1,)"
                                   R"("alpha":0,"gate_cos":[0.5]{}}})",
                                   r, 2 * r, extra));
    }
    write_lines(dir.path / run / "server/rounds.jsonl", rounds);
    const auto plotted = spes::interop_test::run_spes(dir, {"plot", dir.file(run)});
    ASSERT_EQ(plotted.code, 0) << plotted.err;
  }
  // round_time.svg: dots of seconds and alpha at rounds 1..5; the others: one dot per x.
  const std::vector<std::pair<std::string, size_t>> charts = {
      {"rounds.svg", 3}, {"round_time.svg", 3}, {"expert_similarity.svg", 2}, {"loss.svg", 2}};
  for (const auto& [chart, dot] : charts) {
    const std::string svg = spes::interop_test::slurp(dir.file("elastic/plots/" + chart));
    const auto marks = epoch_marks_of(svg);
    ASSERT_EQ(marks.size(), 1u) << chart << "\n" << svg;
    EXPECT_EQ(marks[0].second, "epoch 1: 2 experts 3-&gt;0,1") << chart;
    const std::vector<double> xs = dot_xs(svg);
    ASSERT_GT(xs.size(), dot) << chart;
    EXPECT_NEAR(marks[0].first, xs[dot], 0.11) << chart << ": the mark is not at the dot of its x";
    EXPECT_TRUE(epoch_marks_of(spes::interop_test::slurp(dir.file("fixed/plots/" + chart))).empty())
        << chart << " of a run without handoffs";
  }
}

}  // namespace
}  // namespace spes::report
