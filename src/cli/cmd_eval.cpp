// `spes eval`: scores a checkpoint on multiple-choice tasks (OLMo requests.jsonl.gz format) and
// optionally on validation perplexity; prints one JSON object per task.
#include <nlohmann/json.hpp>

#include <filesystem>
#include <iostream>

#include "cli/command.h"
#include "spes/common/bundled_assets.h"
#include "spes/common/error.h"
#include "spes/common/strings.h"
#include "spes/eval/multiple_choice.h"
#include "spes/train/device.h"
#include "spes/train/loaded_model.h"

namespace {
namespace fs = std::filesystem;

struct EvalArgs {
  std::string checkpoint, tasks = "all", eval_dir;  // eval_dir empty: the bundled tasks
  int64_t limit = 0;
  int threads = 0;
};

void run_eval(const EvalArgs& a) {
  spes::LoadedModel m = spes::load_model_from_checkpoint(a.checkpoint);
  SPES_CHECK(m.tokenizer, "{}: no tokenizer found in the checkpoint or its config's data",
             a.checkpoint);
  m.config.threads = a.threads;
  spes::configure_threads(m.config);
  const std::string eval_dir = a.eval_dir.empty() ? spes::bundled_asset("eval") : a.eval_dir;
  std::vector<std::string> tasks;
  if (a.tasks == "all") {
    SPES_CHECK(fs::is_directory(eval_dir), "--eval-dir '{}' is not a directory", eval_dir);
    for (const auto& e : fs::directory_iterator(eval_dir))
      if (fs::exists(e.path() / "requests.jsonl.gz")) tasks.push_back(e.path().filename());
    std::sort(tasks.begin(), tasks.end());
  } else {
    tasks = spes::split(a.tasks, ',');
  }
  SPES_CHECK(!tasks.empty(), "no tasks found under '{}'", eval_dir);
  for (const auto& t : tasks) {
    std::string path = t;
    if (!fs::exists(path)) path = eval_dir + "/" + t + "/requests.jsonl.gz";
    SPES_CHECK(fs::exists(path), "task '{}': no file '{}' (use --eval-dir)", t, path);
    const auto docs = spes::mc_read_requests(path);
    const auto r = spes::mc_evaluate(*m.model, *m.tokenizer, t, docs, a.limit);
    std::cout << nlohmann::json{{"task", r.task}, {"documents", r.documents}, {"acc", r.acc},
                                {"acc_per_char", r.acc_per_char},
                                {"acc_per_token", r.acc_per_token}}
                     .dump()
              << std::endl;
  }
}

spes::cli::SubcommandRegistrar register_eval("eval", "Score a checkpoint on multiple-choice tasks",
                                   [](CLI::App& sub) {
  auto a = std::make_shared<EvalArgs>();
  sub.add_option("--checkpoint", a->checkpoint, "Checkpoint directory")->required();
  sub.add_option("--tasks", a->tasks, "Comma-separated task names or requests files, or all");
  sub.add_option("--eval-dir", a->eval_dir,
                 "Directory with <task>/requests.jsonl.gz (default: the bundled tasks, assets/eval)");
  sub.add_option("--limit", a->limit, "Documents per task (0: all)");
  sub.add_option("--threads", a->threads, "CPU threads (0: all cores)");
  sub.callback([a] { run_eval(*a); });
});

}  // namespace
