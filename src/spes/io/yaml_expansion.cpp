// YAML alias expansion counted from the parser's events (see yaml_expansion.h).
#include "spes/io/yaml_expansion.h"

#include <yaml-cpp/eventhandler.h>
#include <yaml-cpp/exceptions.h>
#include <yaml-cpp/mark.h>
#include <yaml-cpp/parser.h>

#include <algorithm>
#include <sstream>
#include <unordered_map>
#include <vector>

#include "spes/common/error.h"

namespace spes {

namespace {

// Counts nodes with aliases expanded: a collection's expanded size is 1 + its children's; an
// alias counts the expanded size its anchor's node had. Sizes saturate at the limit + 1.
class ExpansionCounter : public YAML::EventHandler {
 public:
  explicit ExpansionCounter(int64_t limit) : limit_(limit) {}
  int64_t total() const { return total_; }

  void OnDocumentStart(const YAML::Mark&) override {}
  void OnDocumentEnd() override {}
  void OnNull(const YAML::Mark&, YAML::anchor_t anchor) override { leaf(anchor, 1); }
  void OnAlias(const YAML::Mark&, YAML::anchor_t anchor) override {
    const auto it = sizes_.find(anchor);
    leaf(0, it == sizes_.end() ? 1 : it->second);
  }
  void OnScalar(const YAML::Mark&, const std::string&, YAML::anchor_t anchor,
                const std::string&) override {
    leaf(anchor, 1);
  }
  void OnSequenceStart(const YAML::Mark&, const std::string&, YAML::anchor_t anchor,
                       YAML::EmitterStyle::value) override {
    open_.push_back({anchor, 1});
  }
  void OnSequenceEnd() override { close(); }
  void OnMapStart(const YAML::Mark&, const std::string&, YAML::anchor_t anchor,
                  YAML::EmitterStyle::value) override {
    open_.push_back({anchor, 1});
  }
  void OnMapEnd() override { close(); }

 private:
  struct Open {
    YAML::anchor_t anchor;
    int64_t size;
  };
  int64_t add(int64_t a, int64_t b) const { return std::min(a + b, limit_ + 1); }
  void leaf(YAML::anchor_t anchor, int64_t size) {
    if (anchor) sizes_[anchor] = size;
    if (open_.empty()) total_ = add(total_, size);
    else open_.back().size = add(open_.back().size, size);
  }
  void close() {
    const Open o = open_.back();
    open_.pop_back();
    leaf(o.anchor, o.size);
  }

  int64_t limit_;
  int64_t total_ = 0;
  std::vector<Open> open_;
  std::unordered_map<YAML::anchor_t, int64_t> sizes_;
};

}  // namespace

void check_yaml_expansion(const std::string& text, const std::string& origin,
                          int64_t max_nodes) {
  std::istringstream in(text);
  ExpansionCounter counter(max_nodes);
  try {
    YAML::Parser parser(in);
    while (parser.HandleNextDocument(counter) && counter.total() <= max_nodes) {
    }
  } catch (const YAML::Exception&) {
    return;  // malformed: the loader reports it with its line and column
  }
  SPES_CHECK(counter.total() <= max_nodes, "{}: the YAML would expand to more than {} nodes "
             "once its aliases (*name) are replaced by what their anchors (&name) name, which "
             "no real config needs (an alias bomb?); the file is refused unloaded", origin,
             max_nodes);
}

}  // namespace spes
