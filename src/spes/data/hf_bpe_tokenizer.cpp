// Hugging Face tokenizer.json byte-level BPE (see hf_bpe_tokenizer.h). Pipeline of encode():
// repair UTF-8 -> split out non-normalized added tokens -> NFC -> split out normalized added
// tokens -> pre-tokenizer steps (ByteLevel regex / Split) -> bytes to byte-level symbols ->
// BPE merges (cached per word). Leaves out: offsets, truncation/padding, post-processing.
#include "spes/data/hf_bpe_tokenizer.h"

#include <nlohmann/json.hpp>

#include <mutex>
#include <queue>
#include <shared_mutex>
#include <unordered_map>

#include "spes/common/error.h"
#include "spes/data/hf_added_tokens.h"
#include "spes/data/hf_regex_split.h"
#include "spes/data/unicode_nfc.h"
#include "spes/io/json_depth.h"

namespace spes {
using json = nlohmann::json;

namespace {

struct PreStep {
  bool byte_level = false;  // ByteLevel: optional prefix space, optional GPT-2 regex split
  bool add_prefix_space = false;
  std::unique_ptr<RegexSplitter> splitter;  // null: no split in this step
};

const json& field(const json& j, const char* key, const std::string& where) {
  auto it = j.find(key);
  SPES_CHECK(it != j.end(), "{}: missing field '{}'", where, key);
  return *it;
}

bool opt_bool(const json& j, const char* key, bool dflt) {
  auto it = j.find(key);
  return (it == j.end() || it->is_null()) ? dflt : it->get<bool>();
}

std::string type_of(const json& j, const std::string& where) {
  SPES_CHECK(j.is_object(), "{}: expected an object, found {}", where, j.dump().substr(0, 80));
  return field(j, "type", where).get<std::string>();
}

}  // namespace

struct HfBpeTokenizer::Impl {
  std::string origin;
  std::unordered_map<std::string, int32_t> vocab;
  std::vector<std::string> id_to_token;       // model vocab and added tokens, by id
  std::vector<std::string> id_to_bytes;       // ByteLevel-decoded bytes of each id
  std::unordered_map<uint64_t, std::pair<int32_t, int32_t>> merges;  // (a,b) -> (rank, new id)
  int32_t byte_id[256];                       // id of each single-byte symbol, -1 if absent
  std::string byte_char[256];                 // UTF-8 of the byte-level char of each byte
  bool ignore_merges = false;
  bool nfc = false;
  std::vector<PreStep> steps;
  AddedTokenMatcher raw_added, normalized_added;
  int64_t eos = -1;

  mutable std::shared_mutex cache_mu;
  mutable std::unordered_map<std::string, std::vector<int32_t>> cache;

  void load(const json& j);
  void load_model(const json& m, const std::string& where);
  void check_byte_level(const json& decoder) const;
  std::vector<HfAddedToken> load_added_tokens(const json& added);
  void load_byte_decoding();
  int64_t find_eos(const std::vector<HfAddedToken>& added) const;
  void load_normalizer(const json& n, const std::string& where);
  void load_pre_tokenizer(const json& p, const std::string& where);
  void bpe(const std::string& word, std::vector<int64_t>& out) const;
  void bpe_uncached(const std::string& word, std::vector<int32_t>& out) const;
  void encode_text(const std::string& text, std::vector<int64_t>& out) const;
};

void HfBpeTokenizer::Impl::load(const json& j) {
  SPES_CHECK(j.is_object(), "{}: expected a JSON object (tokenizer.json)", origin);
  load_model(field(j, "model", origin), origin + ": model");
  load_normalizer(j.value("normalizer", json()), origin + ": normalizer");
  load_pre_tokenizer(j.value("pre_tokenizer", json()), origin + ": pre_tokenizer");
  check_byte_level(j.value("decoder", json()));
  const std::vector<HfAddedToken> added =
      load_added_tokens(j.value("added_tokens", json::array()));
  load_byte_decoding();
  eos = find_eos(added);
}

// Only byte-level BPE: a ByteLevel pre-tokenizer step, and a ByteLevel decoder or none.
void HfBpeTokenizer::Impl::check_byte_level(const json& decoder) const {
  bool byte_level = false;
  for (const auto& s : steps) byte_level |= s.byte_level;
  SPES_CHECK(byte_level, "{}: pre_tokenizer has no ByteLevel step; only byte-level BPE is "
             "supported", origin);
  if (!decoder.is_null()) {
    std::string t = type_of(decoder, origin + ": decoder");
    SPES_CHECK(t == "ByteLevel", "{}: decoder type '{}' is not supported (expected ByteLevel)",
               origin, t);
  }
}

// Added tokens: ids override the model vocabulary; normalized ones are matched after NFC.
// Returns them all (normalized contents after NFC).
std::vector<HfAddedToken> HfBpeTokenizer::Impl::load_added_tokens(const json& added) {
  std::vector<HfAddedToken> raw, norm;
  int64_t max_id = static_cast<int64_t>(id_to_token.size()) - 1;
  std::vector<HfAddedToken> all;
  for (const auto& a : added) {
    const std::string where = origin + ": added_tokens";
    HfAddedToken t;
    t.content = field(a, "content", where).get<std::string>();
    t.id = field(a, "id", where).get<int32_t>();
    SPES_CHECK(t.id >= 0, "{}: token '{}' has negative id {}", where, t.content, t.id);
    t.special = opt_bool(a, "special", false);
    t.normalized = opt_bool(a, "normalized", !t.special);
    t.lstrip = opt_bool(a, "lstrip", false);
    t.rstrip = opt_bool(a, "rstrip", false);
    t.single_word = opt_bool(a, "single_word", false);
    max_id = std::max<int64_t>(max_id, t.id);
    all.push_back(t);
  }
  id_to_token.resize(max_id + 1);
  for (auto& t : all) {
    id_to_token[t.id] = t.content;
    if (t.normalized) {
      if (nfc) t.content = utf8_nfc(t.content);
      norm.push_back(t);
    } else {
      raw.push_back(t);
    }
  }
  raw_added = AddedTokenMatcher(std::move(raw));
  normalized_added = AddedTokenMatcher(std::move(norm));
  return all;
}

// ByteLevel decoding of every id: a token whose chars are not all byte-level chars (e.g. an
// added token with a plain space) decodes to its own UTF-8 bytes, as in the reference.
void HfBpeTokenizer::Impl::load_byte_decoding() {
  std::unordered_map<uint32_t, unsigned char> char_byte;
  for (int b = 0; b < 256; ++b) {
    size_t k = 0;
    char_byte[utf8_next(byte_char[b], k)] = static_cast<unsigned char>(b);
  }
  id_to_bytes.resize(id_to_token.size());
  for (size_t id = 0; id < id_to_token.size(); ++id) {
    const std::string& t = id_to_token[id];
    std::string bytes;
    bool ok = true;
    for (size_t i = 0; i < t.size() && ok;) {
      auto it = char_byte.find(utf8_next(t, i));
      if (it == char_byte.end()) ok = false;
      else bytes.push_back(static_cast<char>(it->second));
    }
    id_to_bytes[id] = ok ? bytes : t;
  }
}

// The end-of-document token: the first of the usual names found among the added tokens, else
// in the model's vocabulary.
int64_t HfBpeTokenizer::Impl::find_eos(const std::vector<HfAddedToken>& added) const {
  static const char* const kEosNames[] = {"<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>",
                                          "<|eos|>", "<|im_end|>", "<|eot_id|>"};
  for (const char* name : kEosNames)
    for (const auto& t : added)
      if (t.content == name) return t.id;
  for (const char* name : kEosNames) {
    auto it = vocab.find(name);
    if (it != vocab.end()) return it->second;
  }
  fail("{}: no end-of-document token found (looked for <|endoftext|>, <|end_of_text|>, </s>, "
       "<eos>, <|eos|>, <|im_end|>, <|eot_id|> in added_tokens and model.vocab)", origin);
}

void HfBpeTokenizer::Impl::load_model(const json& m, const std::string& where) {
  SPES_CHECK(m.is_object(), "{}: expected an object", where);
  std::string type = m.value("type", std::string("BPE"));
  SPES_CHECK(type == "BPE", "{}: type '{}' is not supported (expected BPE)", where, type);
  auto empty_or_null = [&](const char* k) {
    auto it = m.find(k);
    return it == m.end() || it->is_null() || (it->is_string() && it->get<std::string>().empty());
  };
  SPES_CHECK(empty_or_null("continuing_subword_prefix") && empty_or_null("end_of_word_suffix"),
             "{}: continuing_subword_prefix / end_of_word_suffix are not supported", where);
  auto dr = m.find("dropout");
  SPES_CHECK(dr == m.end() || dr->is_null() || dr->get<double>() == 0.0,
             "{}: BPE dropout is not supported (found {})", where, dr->dump());
  ignore_merges = opt_bool(m, "ignore_merges", false);

  const json& v = field(m, "vocab", where);
  SPES_CHECK(v.is_object(), "{}: vocab must be an object token -> id", where);
  int32_t max_id = -1;
  for (auto it = v.begin(); it != v.end(); ++it) {
    int32_t id = it.value().get<int32_t>();
    SPES_CHECK(id >= 0, "{}: vocab token '{}' has negative id {}", where, it.key(), id);
    vocab[it.key()] = id;
    max_id = std::max(max_id, id);
  }
  id_to_token.assign(max_id + 1, std::string());
  for (const auto& kv : vocab) id_to_token[kv.second] = kv.first;

  // GPT-2 bytes_to_unicode: printable bytes map to themselves, the rest to U+0100 upwards.
  int next = 0;
  for (int b = 0; b < 256; ++b) {
    bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE);
    byte_char[b].clear();
    utf8_append(byte_char[b], printable ? b : 256 + next++);
    auto it = vocab.find(byte_char[b]);
    byte_id[b] = it == vocab.end() ? -1 : it->second;
  }

  const json& ms = field(m, "merges", where);
  SPES_CHECK(ms.is_array(), "{}: merges must be an array", where);
  int32_t rank = 0;
  for (const auto& e : ms) {
    std::string a, b;
    if (e.is_string()) {
      const std::string s = e.get<std::string>();
      size_t sp = s.find(' ');
      SPES_CHECK(sp != std::string::npos && s.find(' ', sp + 1) == std::string::npos,
                 "{}: merges[{}] = '{}': expected two tokens separated by one space", where,
                 rank, s);
      a = s.substr(0, sp);
      b = s.substr(sp + 1);
    } else {
      SPES_CHECK(e.is_array() && e.size() == 2, "{}: merges[{}]: expected \"a b\" or [a, b]",
                 where, rank);
      a = e[0].get<std::string>();
      b = e[1].get<std::string>();
    }
    auto ia = vocab.find(a), ib = vocab.find(b), inew = vocab.find(a + b);
    SPES_CHECK(ia != vocab.end() && ib != vocab.end() && inew != vocab.end(),
               "{}: merges[{}] ('{}' + '{}'): token '{}' is not in the vocab", where, rank, a, b,
               ia == vocab.end() ? a : ib == vocab.end() ? b : a + b);
    uint64_t key = (uint64_t(uint32_t(ia->second)) << 32) | uint32_t(ib->second);
    merges.emplace(key, std::make_pair(rank, inew->second));  // the first (best) rank wins
    ++rank;
  }
}

void HfBpeTokenizer::Impl::load_normalizer(const json& n, const std::string& where) {
  if (n.is_null()) return;
  std::string t = type_of(n, where);
  if (t == "NFC") {
    nfc = true;
  } else if (t == "Sequence") {
    for (const auto& s : field(n, "normalizers", where)) load_normalizer(s, where);
  } else {
    fail("{}: normalizer type '{}' is not supported (supported: NFC, Sequence of NFC, null)",
         where, t);
  }
}

void HfBpeTokenizer::Impl::load_pre_tokenizer(const json& p, const std::string& where) {
  SPES_CHECK(!p.is_null(), "{}: missing; a byte-level BPE needs a ByteLevel pre-tokenizer", where);
  std::string t = type_of(p, where);
  if (t == "Sequence") {
    for (const auto& s : field(p, "pretokenizers", where)) load_pre_tokenizer(s, where);
  } else if (t == "ByteLevel") {
    PreStep s;
    s.byte_level = true;
    s.add_prefix_space = opt_bool(p, "add_prefix_space", true);
    if (opt_bool(p, "use_regex", true))
      s.splitter = std::make_unique<RegexSplitter>(kGpt2SplitPattern, SplitBehavior::Isolated,
                                                   false, where + " (ByteLevel regex)");
    steps.push_back(std::move(s));
  } else if (t == "Split") {
    const json& pat = field(p, "pattern", where);
    std::string regex;
    if (pat.contains("Regex")) regex = pat["Regex"].get<std::string>();
    else if (pat.contains("String")) regex = regex_escape(pat["String"].get<std::string>());
    else fail("{}: Split pattern must be {{\"Regex\": ...}} or {{\"String\": ...}}", where);
    PreStep s;
    s.splitter = std::make_unique<RegexSplitter>(
        regex, split_behavior_parse(field(p, "behavior", where).get<std::string>(), where),
        opt_bool(p, "invert", false), where + " (Split)");
    steps.push_back(std::move(s));
  } else {
    fail("{}: pre-tokenizer type '{}' is not supported (supported: ByteLevel, Split, Sequence)",
         where, t);
  }
}

void HfBpeTokenizer::Impl::bpe_uncached(const std::string& word, std::vector<int32_t>& out) const {
  if (ignore_merges) {
    std::string mapped;
    for (unsigned char b : word) mapped += byte_char[b];
    auto it = vocab.find(mapped);
    if (it != vocab.end()) { out.push_back(it->second); return; }
  }
  struct Sym { int32_t id; int32_t prev, next; };
  std::vector<Sym> sy;
  sy.reserve(word.size());
  for (unsigned char b : word) {
    if (byte_id[b] < 0) continue;  // byte without a vocab entry: dropped (no unk in byte-level)
    int32_t i = static_cast<int32_t>(sy.size());
    sy.push_back({byte_id[b], i - 1, -1});
    if (i > 0) sy[i - 1].next = i;
  }
  struct Cand { int32_t rank, pos, new_id; };
  auto later = [](const Cand& x, const Cand& y) {
    return x.rank != y.rank ? x.rank > y.rank : x.pos > y.pos;
  };
  std::priority_queue<Cand, std::vector<Cand>, decltype(later)> q(later);
  auto push = [&](int32_t pos) {
    if (pos < 0 || sy[pos].next < 0) return;
    auto it = merges.find((uint64_t(uint32_t(sy[pos].id)) << 32) | uint32_t(sy[sy[pos].next].id));
    if (it != merges.end()) q.push({it->second.first, pos, it->second.second});
  };
  for (int32_t i = 0; i + 1 < static_cast<int32_t>(sy.size()); ++i) push(i);
  std::vector<bool> dead(sy.size(), false);
  while (!q.empty()) {
    Cand c = q.top();
    q.pop();
    if (dead[c.pos] || sy[c.pos].next < 0) continue;
    int32_t r = sy[c.pos].next;
    auto it = merges.find((uint64_t(uint32_t(sy[c.pos].id)) << 32) | uint32_t(sy[r].id));
    if (it == merges.end() || it->second.second != c.new_id) continue;  // stale entry
    sy[c.pos].id = c.new_id;
    dead[r] = true;
    sy[c.pos].next = sy[r].next;
    if (sy[r].next >= 0) sy[sy[r].next].prev = c.pos;
    push(sy[c.pos].prev);
    push(c.pos);
  }
  for (int32_t i = sy.empty() ? -1 : 0; i >= 0; i = sy[i].next) out.push_back(sy[i].id);
}

void HfBpeTokenizer::Impl::bpe(const std::string& word, std::vector<int64_t>& out) const {
  constexpr size_t kMaxCachedWordBytes = 64, kMaxCacheEntries = 1 << 20;
  if (word.size() <= kMaxCachedWordBytes) {
    std::shared_lock<std::shared_mutex> lock(cache_mu);
    auto it = cache.find(word);
    if (it != cache.end()) {
      out.insert(out.end(), it->second.begin(), it->second.end());
      return;
    }
  }
  std::vector<int32_t> ids;
  bpe_uncached(word, ids);
  out.insert(out.end(), ids.begin(), ids.end());
  if (word.size() <= kMaxCachedWordBytes) {
    std::unique_lock<std::shared_mutex> lock(cache_mu);
    if (cache.size() >= kMaxCacheEntries) cache.clear();
    cache.emplace(word, std::move(ids));
  }
}

void HfBpeTokenizer::Impl::encode_text(const std::string& text, std::vector<int64_t>& out) const {
  std::vector<std::string> cur, next;
  cur.push_back(text);
  for (const PreStep& s : steps) {
    next.clear();
    for (auto& w : cur) {
      if (s.byte_level && s.add_prefix_space && (w.empty() || w[0] != ' ')) w.insert(0, 1, ' ');
      if (s.splitter) s.splitter->split(w, next);
      else next.push_back(std::move(w));
    }
    std::swap(cur, next);
  }
  for (const auto& w : cur) bpe(w, out);
}

HfBpeTokenizer::HfBpeTokenizer() : impl_(std::make_unique<Impl>()) {}
HfBpeTokenizer::~HfBpeTokenizer() = default;

std::unique_ptr<HfBpeTokenizer> HfBpeTokenizer::from_json(const std::string& json_text,
                                                          const std::string& origin) {
  json j = json_parse_bounded(json_text, origin);
  std::unique_ptr<HfBpeTokenizer> t(new HfBpeTokenizer());
  t->impl_->origin = origin;
  try {
    t->impl_->load(j);
  } catch (const json::exception& e) {  // wrong JSON types in a field
    fail("{}: unexpected tokenizer.json content: {}", origin, e.what());
  }
  return t;
}

std::vector<int64_t> HfBpeTokenizer::encode(const std::string& text) const {
  const Impl& m = *impl_;
  std::vector<int64_t> out;
  out.reserve(text.size() / 3 + 4);
  std::vector<TextPiece> raw, norm;
  std::string valid = utf8_make_valid(text);
  if (m.raw_added.empty()) raw.push_back({std::move(valid), -1});
  else m.raw_added.split(valid, raw);
  for (auto& p : raw) {
    if (p.id >= 0) { out.push_back(p.id); continue; }
    norm.clear();
    std::string n = m.nfc ? utf8_nfc(p.text) : std::move(p.text);
    if (m.normalized_added.empty()) norm.push_back({std::move(n), -1});
    else m.normalized_added.split(n, norm);
    for (auto& q : norm) {
      if (q.id >= 0) out.push_back(q.id);
      else m.encode_text(q.text, out);
    }
  }
  return out;
}

std::string HfBpeTokenizer::decode(const std::vector<int64_t>& ids) const {
  std::string bytes;
  for (int64_t id : ids) {
    SPES_CHECK(id >= 0 && id < vocab_size(), "{}: cannot decode id {}: outside [0, {})",
               impl_->origin, id, vocab_size());
    bytes += impl_->id_to_bytes[id];
  }
  return utf8_make_valid(bytes);
}

int64_t HfBpeTokenizer::vocab_size() const {
  return static_cast<int64_t>(impl_->id_to_token.size());
}
int64_t HfBpeTokenizer::eos_id() const { return impl_->eos; }

std::string HfBpeTokenizer::id_to_token(int64_t id) const {
  return (id >= 0 && id < vocab_size()) ? impl_->id_to_token[id] : std::string();
}

int64_t HfBpeTokenizer::token_to_id(const std::string& token) const {
  auto it = impl_->vocab.find(token);
  if (it != impl_->vocab.end()) return it->second;
  for (size_t i = 0; i < impl_->id_to_token.size(); ++i)
    if (impl_->id_to_token[i] == token) return static_cast<int64_t>(i);
  return -1;
}

}  // namespace spes
