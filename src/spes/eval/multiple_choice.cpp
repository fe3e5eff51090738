// Multiple-choice scoring (see multiple_choice.h). Context and continuation are tokenized
// separately and concatenated (as OLMo does); sequences longer than the model's window are cut
// from the left of the context.
#include "spes/eval/multiple_choice.h"

#include <nlohmann/json.hpp>
#include <zlib.h>

#include <map>

#include "spes/common/error.h"
#include "spes/common/strings.h"

namespace spes {

static std::string read_maybe_gz(const std::string& path) {
  gzFile f = gzopen(path.c_str(), "rb");
  SPES_CHECK(f, "cannot open '{}'", path);
  std::string out;
  char buf[1 << 16];
  int n;
  while ((n = gzread(f, buf, sizeof buf)) > 0) out.append(buf, n);
  int err = 0;
  const char* msg = gzerror(f, &err);
  const bool bad = n < 0 || (err != Z_OK && err != Z_STREAM_END);
  std::string why = bad ? msg : "";
  gzclose(f);
  SPES_CHECK(!bad, "'{}' is not a readable gzip/text file ({})", path, why);
  return out;
}

std::vector<McDocument> mc_read_requests(const std::string& path) {
  const std::string text = read_maybe_gz(path);
  std::map<int64_t, McDocument> docs;
  int64_t line_no = 0;
  for (const auto& line : split(text, '\n')) {
    ++line_no;
    if (trim(line).empty()) continue;
    try {
      auto j = nlohmann::json::parse(line);
      const int64_t doc_id = j.at("doc_id").get<int64_t>();
      const int64_t idx = j.at("idx").get<int64_t>();
      McDocument& d = docs[doc_id];
      d.doc_id = doc_id;
      d.gold = j.at("label").get<int64_t>();
      SPES_CHECK(idx >= 0 && idx < 64, "{}:{}: choice index {} out of range", path, line_no, idx);
      if (static_cast<int64_t>(d.choices.size()) <= idx) d.choices.resize(idx + 1);
      d.choices[idx] = {j.at("request").at("context").get<std::string>(),
                        j.at("request").at("continuation").get<std::string>()};
    } catch (const nlohmann::json::exception& e) {
      fail("{}:{}: not an OLMo request line ({})", path, line_no, e.what());
    }
  }
  std::vector<McDocument> out;
  for (auto& [id, d] : docs) {
    SPES_CHECK(d.gold >= 0 && d.gold < static_cast<int64_t>(d.choices.size()),
               "{}: document {} has gold label {} but {} choices", path, id, d.gold,
               d.choices.size());
    out.push_back(std::move(d));
  }
  SPES_CHECK(!out.empty(), "{}: no requests found", path);
  return out;
}

std::vector<double> mc_choice_logprobs(const Transformer& model, const Tokenizer& tok,
                                       const McDocument& doc, std::vector<int64_t>* n_tokens) {
  torch::NoGradGuard ng;
  const int64_t window = model.config().max_sequence_length;
  std::vector<std::vector<int64_t>> seqs;
  std::vector<int64_t> cont_len;
  int64_t max_len = 0;
  for (const auto& c : doc.choices) {
    std::vector<int64_t> ctx = tok.encode(c.context);
    std::vector<int64_t> cont = tok.encode(c.continuation);
    if (cont.empty()) cont.push_back(tok.eos_id());
    if (cont.size() > static_cast<size_t>(window - 1)) cont.resize(window - 1);
    if (ctx.empty()) ctx.push_back(tok.eos_id());  // condition on a document start
    std::vector<int64_t> s(ctx);
    s.insert(s.end(), cont.begin(), cont.end());
    if (static_cast<int64_t>(s.size()) > window) s.erase(s.begin(), s.end() - window);
    cont_len.push_back(static_cast<int64_t>(cont.size()));
    max_len = std::max<int64_t>(max_len, s.size());
    seqs.push_back(std::move(s));
  }
  // Right padding: causal attention keeps padded positions from affecting real ones.
  torch::Tensor batch = torch::full({static_cast<int64_t>(seqs.size()), max_len}, tok.eos_id(),
                                    torch::kInt64);
  for (size_t i = 0; i < seqs.size(); ++i)
    batch[i].narrow(0, 0, seqs[i].size()).copy_(torch::tensor(seqs[i], torch::kInt64));
  torch::Tensor logp = torch::log_softmax(model.logits(batch).to(torch::kFloat32), -1);
  std::vector<double> out;
  for (size_t i = 0; i < seqs.size(); ++i) {
    // Position t-1 predicts token t: gather the continuation tokens' log-probabilities at once.
    const int64_t len = seqs[i].size(), first = len - cont_len[i];
    torch::Tensor targets =
        batch[i].narrow(0, first, cont_len[i]).unsqueeze(1).to(logp.device());
    out.push_back(logp[i].narrow(0, first - 1, cont_len[i]).gather(1, targets).sum().item<double>());
  }
  if (n_tokens) *n_tokens = cont_len;
  return out;
}

McResult mc_evaluate(const Transformer& model, const Tokenizer& tok, const std::string& task,
                     const std::vector<McDocument>& docs, int64_t limit) {
  McResult r;
  r.task = task;
  int64_t correct = 0, correct_char = 0, correct_tok = 0;
  const size_t n = limit > 0 ? std::min<size_t>(limit, docs.size()) : docs.size();
  for (size_t d = 0; d < n; ++d) {
    std::vector<int64_t> ntok;
    const auto lp = mc_choice_logprobs(model, tok, docs[d], &ntok);
    auto argmax = [&](auto score) {
      int64_t best = 0;
      for (size_t i = 1; i < lp.size(); ++i)
        if (score(i) > score(best)) best = static_cast<int64_t>(i);
      return best;
    };
    correct += argmax([&](size_t i) { return lp[i]; }) == docs[d].gold;
    correct_char += argmax([&](size_t i) {
      return lp[i] / std::max<size_t>(1, docs[d].choices[i].continuation.size());
    }) == docs[d].gold;
    correct_tok += argmax([&](size_t i) { return lp[i] / std::max<int64_t>(1, ntok[i]); }) ==
                   docs[d].gold;
  }
  r.documents = static_cast<int64_t>(n);
  if (n > 0) {
    r.acc = static_cast<double>(correct) / n;
    r.acc_per_char = static_cast<double>(correct_char) / n;
    r.acc_per_token = static_cast<double>(correct_tok) / n;
  }
  return r;
}

}  // namespace spes
