// The progress view of `spes launch` fed with the lines its parts print (taken from a real
// quick-start run's logs): what each part's status becomes, which lines are always shown, the
// plain line and the live rows, and the live view's redraw in place with a message above it.
// The views on a real cluster: SyncEndToEnd.LaunchRunsAClusterAndSummarises (plain) and
// SyncEndToEnd.LaunchOnATerminalRedrawsOneLinePerPartInPlace (a pseudo-terminal).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdio>
#include <string>

#include "spes/cluster/launch_status.h"
#include "spes/cluster/launch_view.h"

using namespace spes;
using ::testing::HasSubstr;
using ::testing::Not;

namespace {

const char* kJoined =
    "[2026-12-05 12:47:19.152] [info] node 0: joined at round 0 (step 0), loaded 0 B (fp32), "
    "model sha256 90972c9321426886";
const char* kRound =
    "[2026-12-05 12:47:41.258] [info] node 0: round 2 (step 40): up 32.1 MiB, down 68.1 MiB, "
    "upload 0.08 s, wait 0.26 s, download 0.47 s, merged (alpha 0.01667), sha256 c455f3c57bf35cca";
const char* kStep = "step 282/300 | loss 5.2252 | val 5.556 | 1489 tok/s | ETA 1m11s";
const char* kPublished =
    "[2026-12-05 12:47:40.718] [info] round 2 (step 40) published: 4 nodes, alpha 0.01667, "
    "persist 0.07 s, sha256 c455f3c57bf35cca";

// Everything written to a temporary file.
std::string contents(std::FILE* f) {
  std::fflush(f);
  std::rewind(f);
  std::string s;
  char buf[4096];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, f)) > 0) s.append(buf, n);
  return s;
}

size_t count(const std::string& s, const std::string& what) {
  size_t n = 0;
  for (size_t p = s.find(what); p != std::string::npos; p = s.find(what, p + 1)) ++n;
  return n;
}

}  // namespace

TEST(LaunchStatus, NodeLinesGiveStepLossRoundAndEta) {
  PartStatus st;
  EXPECT_FALSE(update_part_status(st, kJoined));
  EXPECT_EQ(st.round, 0);
  EXPECT_EQ(st.last_event, "joined");
  EXPECT_FALSE(update_part_status(st, kRound));
  EXPECT_EQ(st.round, 2);
  EXPECT_FALSE(update_part_status(st, kStep));
  EXPECT_EQ(st.step, 282);
  EXPECT_EQ(st.total_steps, 300);
  EXPECT_DOUBLE_EQ(st.loss, 5.2252);
  EXPECT_DOUBLE_EQ(st.val_loss, 5.556);
  EXPECT_DOUBLE_EQ(st.tokens_per_s, 1489);
  EXPECT_DOUBLE_EQ(st.eta_s, 71);
  EXPECT_FALSE(update_part_status(st, "step 290/300 | loss 4.5 | 1000 tok/s | ETA 1h02m"));
  EXPECT_DOUBLE_EQ(st.eta_s, 3720);
  EXPECT_DOUBLE_EQ(st.val_loss, 5.556);  // kept from the last evaluation
  // A second rank's lines (--nproc-per-node) do not move the node's status.
  EXPECT_FALSE(update_part_status(st, "[rank 1] step 299/300 | loss 1.0 | 1 tok/s | ETA 0s"));
  EXPECT_EQ(st.step, 290);
}

TEST(LaunchStatus, ServerLinesGiveRoundsAndNodes) {
  PartStatus st;
  st.is_server = true;
  update_part_status(st, "[2026-12-05 12:47:18.964] [info] node 0 joined (incarnation "
                         "901feec5d79aa19a, step 0) at round 0");
  update_part_status(st, "[2026-12-05 12:47:18.978] [info] node 3 joined (incarnation "
                         "c7510e4c7a33cb3f, step 0) at round 0");
  update_part_status(st, kPublished);
  update_part_status(st, "[2026-12-05 12:50:19.997] [info] node 0 left at step 300: finished");
  EXPECT_EQ(st.joined, 2);
  EXPECT_EQ(st.left, 1);
  EXPECT_EQ(st.round, 2);
  EXPECT_EQ(st.round_nodes, 4);
  EXPECT_EQ(st.step, -1);  // a server has no steps
}

TEST(LaunchStatus, WarningsErrorsAndUnknownLinesAreAlwaysShown) {
  EXPECT_FALSE(should_show_line(kJoined));
  EXPECT_FALSE(should_show_line(kStep));
  EXPECT_FALSE(should_show_line("[rank 1] [2026-12-05 12:47:19.152] [info] rank 1 of 2: x"));
  EXPECT_FALSE(should_show_line(""));
  EXPECT_TRUE(should_show_line("[2026-12-05 12:47:17.560] [warning] sync server: no token"));
  EXPECT_TRUE(should_show_line("[2026-12-05 12:47:17.560] [error] node 1: upload refused"));
  EXPECT_TRUE(should_show_line("[rank 1] [2026-12-05 12:47:17.560] [critical] out of memory"));
  EXPECT_TRUE(should_show_line("error: the config's model needs 6 experts per node"));
  EXPECT_TRUE(should_show_line("terminate called after throwing an instance of 'c10::Error'"));
  EXPECT_TRUE(should_show_line("to continue from runs/x/node0/checkpoint run: spes node ..."));
}

TEST(LaunchView, PlainLineSummarisesTheClusterAndShowsWarningsAsTheyCome) {
  std::FILE* f = std::tmpfile();
  ASSERT_NE(f, nullptr);
  LaunchView view(LaunchViewMode::Plain, {"server", "node 0", "node 1"}, 15, 3600, f);
  EXPECT_EQ(view.mode(), LaunchViewMode::Plain);
  EXPECT_THAT(view.plain_line(), HasSubstr("0 of 2 nodes joined"));
  view.line(0, kPublished);
  view.line(1, kStep);
  view.line(2, "step 280/300 | loss 5.0 | 1000 tok/s | ETA 2m00s");
  view.line(2, "[2026-12-05 12:47:17.560] [warning] node 1: slow disk");
  view.tick();  // not due: one line an hour
  const std::string plain = view.plain_line();
  EXPECT_THAT(plain, HasSubstr("round 2/15"));
  EXPECT_THAT(plain, HasSubstr("step 282/300 (nodes 280 to 282)"));
  EXPECT_THAT(plain, HasSubstr("loss 5.1126"));  // the nodes' mean
  EXPECT_THAT(plain, HasSubstr("2489 tok/s"));    // their sum
  EXPECT_THAT(plain, HasSubstr("ETA 2m00s"));     // the slowest node's
  view.finish();
  const std::string out = contents(f);
  EXPECT_EQ(out, "[node 1] [2026-12-05 12:47:17.560] [warning] node 1: slow disk\n" + plain + "\n")
      << out;
  std::fclose(f);
}

TEST(LaunchView, LiveRowsAreRedrawnInPlaceWithMessagesAboveThem) {
  std::FILE* f = std::tmpfile();
  ASSERT_NE(f, nullptr);
  LaunchView view(LaunchViewMode::Live, {"server", "node 0", "node 1"}, 15, 10, f);
  view.message("launch: 2 nodes");
  view.line(0, kPublished);
  view.line(1, kRound);
  view.line(1, kStep);
  const auto rows = view.live_rows();
  ASSERT_EQ(rows.size(), 4u);  // the server, 2 nodes, the whole cluster
  EXPECT_THAT(rows[0], HasSubstr("round 2/15 published (4 nodes)"));
  EXPECT_THAT(rows[1], HasSubstr("282/300 | loss 5.2252 | val 5.556 | 1489 tok/s | round 2/15"));
  EXPECT_THAT(rows[2], HasSubstr("node 1  | starting"));
  view.line(2, "error: something broke");  // shown above the rows, which are drawn again
  view.exited(2, 1);
  EXPECT_THAT(view.live_rows()[2], HasSubstr("exited with code 1"));
  view.finish();
  const std::string out = contents(f);
  // Each draw after the first goes back up over the rows it drew, then clears below.
  EXPECT_EQ(count(out, "\r\x1b[4A"), 2u) << out;  // before "[node 1] error" and the last frame
  EXPECT_THAT(out, HasSubstr("launch: 2 nodes\n"));
  EXPECT_THAT(out, HasSubstr("[node 1] error: something broke\n"));
  EXPECT_LT(out.find("[node 1] error"), out.rfind("exited with code 1"));
  EXPECT_THAT(out, Not(HasSubstr("[node 0]")));  // info and progress lines are not relayed
  std::fclose(f);
}

TEST(LaunchView, AllRelaysEveryLineAndUnknownModesAreRefused) {
  std::FILE* f = std::tmpfile();
  ASSERT_NE(f, nullptr);
  LaunchView view(LaunchViewMode::All, {"server", "node 0"}, 0, 10, f);
  view.line(1, kStep);
  view.finish();
  EXPECT_EQ(contents(f), std::string("[node 0] ") + kStep + "\n");
  std::fclose(f);
  EXPECT_THROW(launch_view_mode_from_string("fancy"), std::exception);
  EXPECT_EQ(launch_view_mode_from_string("plain"), LaunchViewMode::Plain);
  // Not a terminal: auto is plain.
  std::FILE* g = std::tmpfile();
  EXPECT_EQ(resolve_launch_view_mode(LaunchViewMode::Auto, g), LaunchViewMode::Plain);
  std::fclose(g);
}
