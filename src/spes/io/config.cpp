// YAML <-> Config. Parsing walks the field list of each struct (visit()), so every known key is
// read in one place; the reference's other keys are handled first (io/reference_keys.h); keys
// left over are reported with the nearest known key as a suggestion.
#include "spes/io/config.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <spdlog/spdlog.h>
#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <limits>
#include <set>
#include <sstream>

#include "spes/common/error.h"
#include "spes/common/strings.h"
#include "spes/io/reference_keys.h"
#include "spes/io/yaml_expansion.h"

namespace spes {
namespace {

template <class T> std::string type_name();
template <> std::string type_name<int64_t>() { return "an integer"; }
template <> std::string type_name<double>() { return "a number"; }
template <> std::string type_name<bool>() { return "true or false"; }
template <> std::string type_name<std::string>() { return "a string"; }
template <> std::string type_name<std::vector<double>>() { return "a list of numbers"; }
template <> std::string type_name<std::vector<std::string>>() { return "a list of strings"; }
template <> std::string type_name<std::vector<std::vector<int64_t>>>() {
  return "a list of lists of integers";
}
template <class T, class = void> struct TypeName {
  static std::string get() { return type_name<T>(); }
};
template <class T> struct TypeName<T, std::enable_if_t<NamedSetting<T>::value>> {
  static std::string get() { return T::allowed(); }
};

// Reads fields from a YAML map, remembering which keys were used.
struct Reader {
  const YAML::Node& node;
  std::string prefix;
  const std::string& origin;
  std::set<std::string>* used;

  template <class T> void operator()(const char* key, T& field) {
    const YAML::Node v = node[key];
    if (!v) return;
    used->insert(prefix + key);
    try {
      read(v, field);
    } catch (const YAML::Exception&) {
      fail("{}: key '{}{}' must be {}, found '{}'", origin, prefix, key, TypeName<T>::get(),
           YAML::Dump(v));
    } catch (const Error& e) {  // a name a NamedSetting refuses: "must be a or b, found 'c'"
      fail("{}: {}{} {}", origin, prefix, key, e.what());
    }
  }
  template <class S> void section(const char* key, S& s) {
    const YAML::Node v = node[key];
    if (!v) return;
    used->insert(prefix + key);
    SPES_CHECK(v.IsMap(), "{}: '{}{}' must be a mapping of keys, found '{}'", origin, prefix, key,
               YAML::Dump(v));
    Reader sub{v, prefix + key + ".", origin, used};
    s.visit(sub);
  }
  static void read(const YAML::Node& v, bool& f) { f = v.as<bool>(); }
  static void read(const YAML::Node& v, std::string& f) {
    if (!v.IsScalar()) throw YAML::BadConversion(v.Mark());
    f = v.as<std::string>();
  }
  // A Choice or another NamedSetting: one scalar, parsed by the type ("must be ..., found").
  template <class T, std::enable_if_t<NamedSetting<T>::value, int> = 0>
  static void read(const YAML::Node& v, T& f) {
    if (!v.IsScalar()) throw YAML::BadConversion(v.Mark());
    f = T(v.as<std::string>());
  }
  static void read(const YAML::Node& v, int64_t& f) { f = v.as<int64_t>(); }
  static void read(const YAML::Node& v, double& f) { f = v.as<double>(); }
  static void read(const YAML::Node& v, std::vector<std::string>& f) {
    if (v.IsScalar()) { f = {v.as<std::string>()}; return; }
    f = v.as<std::vector<std::string>>();
  }
  static void read(const YAML::Node& v, std::vector<double>& f) { f = v.as<std::vector<double>>(); }
  static void read(const YAML::Node& v, std::vector<std::vector<int64_t>>& f) {
    if (!v.IsSequence()) throw YAML::BadConversion(v.Mark());
    f.clear();
    if (v.size() > 0 && v[0].IsScalar()) {  // a single row: the same owners in every layer
      f.push_back(v.as<std::vector<int64_t>>());
    } else {
      f = v.as<std::vector<std::vector<int64_t>>>();
    }
  }
};

// Writes fields to a YAML emitter.
struct Writer {
  YAML::Emitter& out;
  template <class T> void operator()(const char* key, const T& field) {
    out << YAML::Key << key << YAML::Value;
    write(field);
  }
  template <class S> void section(const char* key, S& s) {
    out << YAML::Key << key << YAML::Value << YAML::BeginMap;
    s.visit(*this);
    out << YAML::EndMap;
  }
  // Text plain where YAML allows it (max_duration: 300, not "300"); yaml-cpp quotes what would
  // read back as something else (empty, null).
  void write(const std::string& s) { out << s; }
  template <class T, std::enable_if_t<NamedSetting<T>::value, int> = 0>
  void write(const T& c) { write(c.name()); }
  // Numbers as written: the shortest text that reads back as the same double (0.1, not
  // 0.10000000000000001).
  void write(double d) {
    if (std::isfinite(d))
      out << fmt::format("{}", d);
    else
      out << YAML::Precision(17) << d;
  }
  void write(const std::vector<double>& v) {
    out << YAML::Flow << YAML::BeginSeq;
    for (double d : v) write(d);
    out << YAML::EndSeq;
  }
  template <class T, std::enable_if_t<!NamedSetting<T>::value, int> = 0>
  void write(const T& v) { out << YAML::Flow << v; }
};

// Deepest nesting of keys accepted (the config's own keys are at most 3 names deep).
constexpr size_t kMaxKeyDepth = 16;

// Lists every known key (dotted) of the config.
struct KeyLister {
  std::string prefix;
  std::vector<std::string>* keys;
  template <class T> void operator()(const char* key, T&) { keys->push_back(prefix + key); }
  template <class S> void section(const char* key, S& s) {
    keys->push_back(prefix + key);
    KeyLister sub{prefix + key + ".", keys};
    s.visit(sub);
  }
};

std::vector<std::string> known_keys() {
  Config c;
  std::vector<std::string> keys;
  KeyLister l{"", &keys};
  c.visit(l);
  return keys;
}

void collect_keys(const YAML::Node& n, const std::string& prefix, const std::string& origin,
                  std::vector<std::string>* out, size_t depth = 1) {
  SPES_CHECK(depth <= kMaxKeyDepth, "{}: mappings nested more than {} deep under '{}...'; "
             "config keys are a few names deep (model.d_model)", origin, kMaxKeyDepth,
             prefix.substr(0, 200));
  for (auto it = n.begin(); it != n.end(); ++it) {
    // A key that is itself a list or a mapping ("? [a, b]: 1", "{a: 1}: 2") names nothing.
    SPES_CHECK(it->first.IsScalar(), "{}: a key under '{}' is not a plain name (found '{}'); "
               "config keys are names like model.d_model", origin,
               prefix.empty() ? "the top level" : prefix.substr(0, prefix.size() - 1),
               YAML::Dump(it->first));
    std::string k = prefix + it->first.as<std::string>();
    out->push_back(k);
    if (it->second.IsMap()) collect_keys(it->second, k + ".", origin, out, depth + 1);
  }
}

void apply_override(YAML::Node& root, const std::string& kv) {
  auto eq = kv.find('=');
  SPES_CHECK(eq != std::string::npos && eq > 0,
             "--set '{}': expected key=value, e.g. --set model.d_model=512", kv);
  std::string key = kv.substr(0, eq), value = kv.substr(eq + 1);
  YAML::Node parsed;
  check_yaml_expansion(value, fmt::format("--set '{}'", key));
  try {
    parsed = value.empty() ? YAML::Node(std::string()) : YAML::Load(value);
  } catch (const YAML::Exception& e) {
    fail("--set '{}': value is not valid YAML ({})", kv, e.msg);
  }
  auto parts = split(key, '.');
  // Keys are a few plain names deep (model.d_model); a long chain of dots would only build a
  // deep, meaningless tree (and deep trees exhaust the stack when walked).
  SPES_CHECK(parts.size() <= kMaxKeyDepth &&
                 std::none_of(parts.begin(), parts.end(),
                              [](const std::string& p) { return p.empty(); }),
             "--set '{}': '{}' is not a config key (dot-separated names, e.g. model.d_model)",
             kv.size() > 200 ? kv.substr(0, 200) + "..." : kv,
             key.size() > 200 ? key.substr(0, 200) + "..." : key);
  // yaml-cpp nodes are handles: walk down with a chain of nodes kept alive.
  std::vector<YAML::Node> chain{root};
  for (size_t i = 0; i + 1 < parts.size(); ++i) {
    YAML::Node next = chain.back()[parts[i]];
    if (!next.IsMap()) {
      chain.back()[parts[i]] = YAML::Node(YAML::NodeType::Map);
      next = chain.back()[parts[i]];
    }
    chain.push_back(next);
  }
  chain.back()[parts.back()] = parsed;
}

}  // namespace

namespace {

// A count as OLMo reads max_duration: digits, or a number in exponent notation ("2e12", which
// OLMo turns into an integer through float); -1 for anything else or a negative count.
int64_t parse_count(const std::string& s) {
  try {
    size_t pos = 0;
    const int64_t n = std::stoll(s, &pos);
    if (pos == s.size()) return n >= 0 ? n : -1;
    const double x = std::stod(s, &pos);
    if (pos == s.size() && x >= 0 && x < 9.2e18) return static_cast<int64_t>(x);
  } catch (const std::exception&) {
  }
  return -1;
}

}  // namespace

int64_t Config::total_steps() const {
  const std::string& d = max_duration;
  auto ends_with = [&](const std::string& s) {
    return d.size() > s.size() && d.compare(d.size() - s.size(), s.size(), s) == 0;
  };
  if (ends_with("T")) {
    const int64_t tokens = parse_count(d.substr(0, d.size() - 1));
    const int64_t per = tokens_per_step();  // > 0 and without overflow (config_validate)
    if (tokens >= 0) return tokens / per + (tokens % per > 0 ? 1 : 0);  // rounded up
  } else {
    const int64_t steps = parse_count(ends_with("ba") ? d.substr(0, d.size() - 2) : d);
    if (steps >= 0) return steps;
  }
  fail("config: max_duration '{}' is not a step count; use e.g. 1000, 1000ba, 2000000T or "
       "2e12T (OLMo's epochs, 'ep', are not supported)", d);
}

namespace {

Config parse_yaml_config(const std::string& yaml_text, const std::vector<std::string>& overrides,
                         const std::string& origin, std::vector<std::string>* ignored_out) {
  YAML::Node root;
  check_yaml_expansion(yaml_text, origin);
  try {
    root = YAML::Load(yaml_text);
  } catch (const YAML::ParserException& e) {
    fail("{}: malformed YAML at line {}, column {}: {}", origin, e.mark.line + 1,
         e.mark.column + 1, e.msg);
  }
  if (root.IsNull()) root = YAML::Node(YAML::NodeType::Map);
  SPES_CHECK(root.IsMap(), "{}: the top level must be a mapping of keys", origin);
  for (const auto& kv : overrides) apply_override(root, kv);
  // Check the nesting before anything walks the tree.
  std::vector<std::string> present;
  collect_keys(root, "", origin, &present);
  const std::vector<std::string> ignored = reference_keys_resolve(root, origin);

  Config c;
  std::set<std::string> used;
  Reader r{root, "", origin, &used};
  c.visit(r);

  present.clear();
  collect_keys(root, "", origin, &present);
  std::vector<std::string> known = known_keys();
  for (const auto& k : reference_key_names()) known.push_back(k);
  for (const auto& k : present) {
    if (used.count(k)) continue;
    fail("{}: unknown key '{}'{}", origin, k, suggestion_suffix(k, known));
  }
  config_validate(c, origin);
  if (!ignored.empty())
    spdlog::warn("{}: ignoring {} operational reference key{} (no effect on the model or the "
                 "method here; docs/INTEROP.md): {}", origin, ignored.size(),
                 ignored.size() == 1 ? "" : "s", fmt::join(ignored, ", "));
  if (ignored_out) *ignored_out = ignored;
  return c;
}

}  // namespace

Config config_parse(const std::string& yaml_text, const std::vector<std::string>& overrides,
                    const std::string& origin, std::vector<std::string>* ignored_keys) {
  try {
    return parse_yaml_config(yaml_text, overrides, origin, ignored_keys);
  } catch (const YAML::Exception& e) {
    // Every case we know of has its own message above; this names anything yaml-cpp still
    // refuses instead of letting its exception escape.
    fail("{}: the YAML cannot be read as a config ({}); check the keys and values near that "
         "place", origin, e.what());
  }
}

Config config_load(const std::string& path, const std::vector<std::string>& overrides,
                   std::vector<std::string>* ignored_keys) {
  if (path.empty())
    return config_parse(builtin_default_config_yaml(), overrides,
                        "built-in default config (configs/default.yaml)", ignored_keys);
  std::ifstream f(path);
  SPES_CHECK(f.good(), "config file '{}' cannot be read (does it exist?)", path);
  std::stringstream ss;
  ss << f.rdbuf();
  return config_parse(ss.str(), overrides, path, ignored_keys);
}

std::string config_to_yaml(const Config& c) {
  YAML::Emitter out;
  out << YAML::BeginMap;
  Writer w{out};
  const_cast<Config&>(c).visit(w);
  out << YAML::EndMap;
  return std::string(out.c_str()) + "\n";
}

namespace {

// Each check below names the key, the rule and what it found; `o` names the config.
void check_positive(const std::string& o, const char* key, int64_t v) {
  SPES_CHECK(v > 0, "{}: {} must be positive, found {}", o, key, v);
}

void validate_model(const ModelConfig& m, const std::string& o) {
  check_positive(o, "model.d_model", m.d_model);
  check_positive(o, "model.n_layers", m.n_layers);
  check_positive(o, "model.n_heads", m.n_heads);
  SPES_CHECK(m.mlp_hidden_size >= 0, "{}: model.mlp_hidden_size must be positive (or 0/null: "
             "mlp_ratio x d_model), found {}", o, m.mlp_hidden_size);
  if (m.mlp_hidden_size == 0) check_positive(o, "model.mlp_ratio", m.mlp_ratio);
  SPES_CHECK(m.swiglu_input_size() % 2 == 0 && m.swiglu_input_size() >= 2,
             "{}: the SwiGLU width {} ({}) must be even: gate and up take half each, so the "
             "expert hidden size F is half of it (OLMo's meaning of model.mlp_hidden_size)", o,
             m.swiglu_input_size(), m.mlp_hidden_size > 0 ? "model.mlp_hidden_size"
                                                          : "model.mlp_ratio x model.d_model");
  check_positive(o, "model.vocab_size", m.vocab_size);
  SPES_CHECK(m.embedding_size == 0 || m.embedding_size >= m.vocab_size,
             "{}: model.embedding_size ({}) pads the vocabulary and must be at least "
             "model.vocab_size ({}), or 0/null for no padding", o, m.embedding_size,
             m.vocab_size);
  check_positive(o, "model.max_sequence_length", m.max_sequence_length);
  SPES_CHECK(m.d_model % m.n_heads == 0,
             "{}: model.d_model ({}) must be divisible by model.n_heads ({})", o, m.d_model,
             m.n_heads);
  SPES_CHECK(m.head_dim() % 2 == 0, "{}: head dimension d_model/n_heads = {} must be even (RoPE)",
             o, m.head_dim());
  SPES_CHECK(m.n_kv_heads >= 0 && m.n_heads % m.kv_heads() == 0,
             "{}: model.n_heads ({}) must be a multiple of model.n_kv_heads ({})", o, m.n_heads,
             m.kv_heads());
  if (m.is_moe()) {
    check_positive(o, "model.moe_num_experts", m.moe_num_experts);
    SPES_CHECK(m.moe_top_k >= 1 && m.moe_top_k <= m.moe_num_experts,
               "{}: model.moe_top_k must be in [1, moe_num_experts={}], found {}", o,
               m.moe_num_experts, m.moe_top_k);
  }
  SPES_CHECK(m.eos_token_id >= 0 && m.eos_token_id < m.vocab_size,
             "{}: model.eos_token_id {} is outside the vocabulary [0, {})", o, m.eos_token_id,
             m.vocab_size);
}

void validate_batches(const Config& c, const std::string& o) {
  check_positive(o, "global_train_batch_size", c.global_train_batch_size);
  check_positive(o, "device_train_microbatch_size", c.device_train_microbatch_size);
  SPES_CHECK(c.model.max_sequence_length <=
                 std::numeric_limits<int64_t>::max() / c.global_train_batch_size,
             "{}: global_train_batch_size ({}) x model.max_sequence_length ({}) tokens per step "
             "is too large to count", o, c.global_train_batch_size, c.model.max_sequence_length);
  SPES_CHECK(c.global_train_batch_size % c.device_train_microbatch_size == 0,
             "{}: global_train_batch_size ({}) must be a multiple of "
             "device_train_microbatch_size ({})",
             o, c.global_train_batch_size, c.device_train_microbatch_size);
  (void)c.total_steps();  // throws on a malformed max_duration
}

void validate_optimizer(const Config& c, const std::string& o) {
  SPES_CHECK(c.optimizer.betas.size() == 2, "{}: optimizer.betas must hold two numbers, found {}",
             o, c.optimizer.betas.size());
  SPES_CHECK(c.optimizer.learning_rate > 0, "{}: optimizer.learning_rate must be positive", o);
}

void validate_data(const DataConfig& d, const std::string& o) {
  SPES_CHECK(d.validation_fraction >= 0 && d.validation_fraction < 1,
             "{}: data.validation_fraction must be in [0, 1), found {}", o,
             d.validation_fraction);
  SPES_CHECK(d.seed >= -1, "{}: data.seed must be a non-negative integer (or left out: the data "
             "order then follows seed), found {}", o, d.seed);
}

void validate_topology(const SpesConfig& s, const std::string& o) {
  check_positive(o, "spes_config.num_peers", s.num_peers);
  check_positive(o, "spes_config.sync_steps", s.sync_steps);
  // issue 38 (own-node)
  SPES_CHECK(s.rewarmup_steps >= -1, "{}: spes_config.rewarmup_steps must be -1 (the "
             "scheduler's t_warmup), 0 (no re-warm-up) or a number of steps, found {}", o,
             s.rewarmup_steps);
  SPES_CHECK(s.elastic.max_nodes == 0 ||
                 (s.elastic.max_nodes >= s.num_peers && s.elastic.max_nodes <= 1024),
             "{}: spes_config.max_nodes must be 0 (= num_peers: no arrivals) or in [num_peers={}, "
             "1024] (node ids the run admits; ids from num_peers on arrive with `spes node "
             "--join-new`), found {}", o, s.num_peers, s.elastic.max_nodes);
  SPES_CHECK(s.peer_id >= 0 && s.peer_id < s.node_slots(),
             "{}: spes_config.peer_id must be in [0, max_nodes={}), found {}", o, s.node_slots(),
             s.peer_id);
}

void validate_transfer(const TransferSettings& t, const std::string& o) {
  SPES_CHECK(t.compression == Compression::None || t.dtype == TransferDtype::Fp32,
             "{}: spes_config.compression {} needs spes_config.transfer_dtype fp32 (found {}): "
             "deltas are taken from the exact fp32 published model", o, t.compression, t.dtype);
  SPES_CHECK(t.topk_density > 0 && t.topk_density <= 0.5, "{}: spes_config.topk_density must "
             "be in (0, 0.5] (the share of each chunk's values a top-k delta carries; 0.01-0.03 "
             "is SparseLoCo's range), found {}", o, t.topk_density);
  SPES_CHECK(t.topk_bits >= 2 && t.topk_bits <= 4, "{}: spes_config.topk_bits must be 2, 3 or "
             "4 (bits per sent value, sign included), found {}", o, t.topk_bits);
  SPES_CHECK(t.topk_decay > 0 && t.topk_decay <= 1, "{}: spes_config.topk_decay must be in "
             "(0, 1] (1: plain error feedback), found {}", o, t.topk_decay);
  SPES_CHECK(t.topk_down_density == 0 ||
                 (t.topk_down_density >= t.topk_density && t.topk_down_density <= 0.5),
             "{}: spes_config.topk_down_density must be 0 (the same as topk_density) or in "
             "[topk_density={}, 0.5] (the density of the change the server publishes for "
             "averaged tensors), found {}", o, t.topk_density, t.topk_down_density);
}

void validate_elastic(const ElasticOwnership& e, const Config& c, const std::string& o) {
  SPES_CHECK(e.reassign_after_rounds >= 0, "{}: spes_config.reassign_after_rounds must be >= 0 "
             "(0: never reassign a departed node's experts), found {}", o,
             e.reassign_after_rounds);
  const int64_t E = c.model.is_moe() ? c.model.moe_num_experts : 0;
  SPES_CHECK(e.expert_capacity >= 0 && e.expert_capacity <= std::max<int64_t>(E, 0),
             "{}: spes_config.expert_capacity must be in [0, moe_num_experts={}] (experts per "
             "layer this node can train; 0: no cap), found {}", o, E, e.expert_capacity);
  SPES_CHECK(std::isfinite(e.max_memory_capacity_gib) && e.max_memory_capacity_gib > 0,
             "{}: spes_config.max_memory_capacity_gib must be a positive number (the largest "
             "memory, GiB, the server believes a node declares), found {}", o,
             e.max_memory_capacity_gib);
  SPES_CHECK(std::isfinite(e.memory_capacity_gib) && e.memory_capacity_gib >= 0 &&
                 e.memory_capacity_gib <= e.max_memory_capacity_gib,
             "{}: spes_config.memory_capacity_gib must be in [0, max_memory_capacity_gib={}] "
             "(the memory this node can train in, GiB; 0: not declared), found {}", o,
             e.max_memory_capacity_gib, e.memory_capacity_gib);
}

void validate_timing(const RoundTiming& t, const SpesConfig& s, const std::string& o) {
  SPES_CHECK(t.overlap_delay_steps >= 0 && t.overlap_delay_steps < s.sync_steps,
             "{}: spes_config.overlap_delay_steps must be in [0, sync_steps={}) (0: apply a "
             "round when it arrives), found {}", o, s.sync_steps, t.overlap_delay_steps);
  SPES_CHECK(t.overlap || t.overlap_delay_steps == 0, "{}: spes_config.overlap_delay_steps {} "
             "needs spes_config.overlap: true", o, t.overlap_delay_steps);
  SPES_CHECK(t.min_nodes >= 1, "{}: spes_config.min_nodes must be >= 1", o);
  // The default, 2, also fits a one-node run: the quorum is at most the nodes alive.
  SPES_CHECK(t.min_nodes <= std::max<int64_t>(s.num_peers, 2), "{}: spes_config.min_nodes "
             "({}) exceeds num_peers ({}); a round could never publish at its deadline", o,
             t.min_nodes, s.num_peers);
  SPES_CHECK(t.round_timeout > 0, "{}: spes_config.round_timeout must be > 0 seconds, found {}",
             o, t.round_timeout);
  SPES_CHECK(t.heartbeat_timeout > 0, "{}: spes_config.heartbeat_timeout must be > 0 seconds, "
             "found {}", o, t.heartbeat_timeout);
}

void validate_outer_step(const SpesConfig& s, const std::string& o) {
  SPES_CHECK(!s.outer.on_shared || s.mode == SyncMode::Spes, "{}: spes_config.outer_step is "
             "for mode spes (the outer step on the shared tensors); mode {} {}", o, s.mode,
             s.mode == SyncMode::Diloco ? "always applies it (to every tensor): drop outer_step"
             : s.mode == SyncMode::Fedavg ? "with an outer step is mode diloco"
                                          : "has no sync server to apply it");
  SPES_CHECK(!s.uses_outer_step() ||
                 (s.outer.lr > 0 && s.outer.momentum >= 0 && s.outer.momentum < 1),
             "{}: the outer step needs spes_config.outer_lr > 0 and outer_momentum in [0, 1), "
             "found {} and {}", o, s.outer.lr, s.outer.momentum);
}

void validate_merging(const MergeSettings& m, const std::string& o) {
  SPES_CHECK(m.topk >= 0, "{}: spes_config.merge_topk must be >= 0", o);
}

void validate_bounds(const UpdateBounds& b, Weighting weighting, const std::string& o) {
  SPES_CHECK(b.max_update_norm_ratio >= 0, "{}: spes_config.max_update_norm_ratio must be >= 0 "
             "(0 disables the check), found {}", o, b.max_update_norm_ratio);
  SPES_CHECK(b.max_tensor_update_ratio >= 0, "{}: spes_config.max_tensor_update_ratio must be "
             ">= 0 (0 disables the check), found {}", o, b.max_tensor_update_ratio);
  SPES_CHECK(b.max_drift_ratio >= 0, "{}: spes_config.max_drift_ratio must be >= 0 (0 disables "
             "the check), found {}", o, b.max_drift_ratio);
  SPES_CHECK(b.drift_window_rounds >= 1 && b.drift_window_rounds <= 1000, "{}: "
             "spes_config.drift_window_rounds must be in [1, 1000], found {}", o,
             b.drift_window_rounds);
  SPES_CHECK(b.max_expert_peer_ratio == 0 || b.max_expert_peer_ratio >= 1, "{}: "
             "spes_config.max_expert_peer_ratio must be 0 (off) or >= 1 (x the median norm of the "
             "layer's other experts), found {}", o, b.max_expert_peer_ratio);
  SPES_CHECK(b.max_expert_growth == 0 || b.max_expert_growth >= 1, "{}: "
             "spes_config.max_expert_growth must be 0 (off) or >= 1 (x the expert's norm at the "
             "run's start), found {}", o, b.max_expert_growth);
  SPES_CHECK(b.outlier_factor == 0 || b.outlier_factor >= 1, "{}: spes_config.outlier_factor "
             "must be 0 (off) or >= 1 (x the median of the other nodes' updates), found {}", o,
             b.outlier_factor);
  SPES_CHECK(b.aggregation == Aggregation::Mean || weighting == Weighting::Equal, "{}: "
             "spes_config.aggregation={} takes each node's value once, so it cannot weigh nodes "
             "by tokens; set spes_config.weighting: equal, or aggregation: mean", o,
             b.aggregation);
  SPES_CHECK(b.trim_fraction >= 0 && b.trim_fraction < 0.5, "{}: spes_config.trim_fraction "
             "must be in [0, 0.5), found {}", o, b.trim_fraction);
}

void validate_transport(const SyncTransport& t, const std::string& o) {
  SPES_CHECK(t.retry_max_s >= 0 && t.retry_backoff_max_s > 0, "{}: spes_config.retry_max_s "
             "must be >= 0 and retry_backoff_max_s > 0", o);
  SPES_CHECK(t.tls_cert.empty() == t.tls_key.empty(), "{}: spes_config.tls_cert and tls_key go "
             "together (the server's PEM certificate chain and private key)", o);
  SPES_CHECK(t.tls_client_cert.empty() == t.tls_client_key.empty(), "{}: "
             "spes_config.tls_client_cert and tls_client_key go together", o);
}

// Top-k deltas: the robust aggregation modes take each node's value per position, and at 1-3%
// density nearly every node sent nothing at a given position, so their median or trimmed
// mean is zero almost everywhere: the combination is refused rather than given that meaning.
void validate_sparse(const SpesConfig& s, const std::string& o) {
  if (s.transfer.compression != Compression::Topk) return;
  SPES_CHECK(s.bounds.aggregation == Aggregation::Mean, "{}: spes_config.aggregation={} with "
             "compression: topk is refused: at topk_density {} nearly every node sent nothing at "
             "a given position, so a per-position median or trimmed mean is zero almost "
             "everywhere and would drop the updates; use aggregation: mean (the update bounds "
             "and outlier checks still apply to each decoded upload) or compression: int8", o,
             s.bounds.aggregation, s.transfer.topk_density);
}

void validate_dashboard(const DashboardSettings& d, const std::string& o) {
  SPES_CHECK(d.port >= -1 && d.port <= 65535, "{}: spes_config.dashboard_port must be -1 "
             "(off), 0 (any free port) or a port number, found {}", o, d.port);
  SPES_CHECK(!d.host.empty(), "{}: spes_config.dashboard_host must not be empty (127.0.0.1: "
             "this machine only; 0.0.0.0: every interface)", o);
}

void validate_spes(const SpesConfig& s, const std::string& o) {
  validate_topology(s, o);
  validate_transfer(s.transfer, o);
  validate_timing(s.timing, s, o);
  validate_outer_step(s, o);
  validate_merging(s.merging, o);
  validate_bounds(s.bounds, s.weighting, o);
  validate_sparse(s, o);
  validate_transport(s.transport, o);
  validate_dashboard(s.dashboard, o);
}

}  // namespace

void config_validate(const Config& c, const std::string& o) {
  validate_model(c.model, o);
  validate_batches(c, o);
  validate_optimizer(c, o);
  validate_data(c.data, o);
  validate_spes(c.spes_config, o);
  validate_elastic(c.spes_config.elastic, c, o);
}

}  // namespace spes
