// Hugging Face weight files, single or sharded (see hf_weights.h).
#include "spes/interop/hf_weights.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <cctype>
#include <filesystem>
#include <map>
#include <unordered_map>

#include "spes/common/error.h"
#include "spes/io/files.h"
#include "spes/io/json_depth.h"

namespace spes {
namespace fs = std::filesystem;
using json = nlohmann::json;

static const char* kIndex = "model.safetensors.index.json";
static const char* kSingle = "model.safetensors";

NamedTensors hf_read_weights(const std::string& dir) {
  const std::string index_path = dir + "/" + kIndex;
  const std::string single_path = dir + "/" + kSingle;
  if (!fs::exists(index_path)) {
    if (fs::exists(single_path)) return safetensors_load(single_path);
    SPES_CHECK(!fs::exists(dir + "/pytorch_model.bin") &&
                   !fs::exists(dir + "/pytorch_model.bin.index.json"),
               "{}: holds only pickle weights (pytorch_model.bin); spes reads safetensors only "
               "(convert with transformers: model.save_pretrained(dir, safe_serialization=True))",
               dir);
    fail("{}: neither {} nor {} found", dir, kSingle, kIndex);
  }
  json idx = json_parse_bounded(file_read(index_path), index_path);
  SPES_CHECK(idx.is_object() && idx.contains("weight_map") && idx["weight_map"].is_object(),
             "{}: expected an object with a 'weight_map' object (tensor name -> shard file)",
             index_path);
  std::map<std::string, std::vector<std::string>> by_shard;  // shard -> tensor names
  std::unordered_map<std::string, std::string> shard_of;
  for (const auto& [name, file] : idx["weight_map"].items()) {
    SPES_CHECK(file.is_string(), "{}: weight_map['{}'] must be a file name, found {}",
               index_path, name, file.dump());
    const std::string f = file.get<std::string>();
    SPES_CHECK(f.find('/') == std::string::npos && f != ".." && !f.empty(),
               "{}: weight_map['{}'] = '{}' must name a file inside the directory", index_path,
               name, f);
    by_shard[f].push_back(name);
    shard_of[name] = f;
  }
  SPES_CHECK(!by_shard.empty(), "{}: weight_map is empty", index_path);
  NamedTensors out;
  for (const auto& [file, names] : by_shard) {
    const std::string path = dir + "/" + file;
    SPES_CHECK(fs::exists(path), "{}: shard '{}' listed in the index is missing", dir, file);
    NamedTensors shard = safetensors_load(path);
    std::unordered_map<std::string, bool> present;
    for (auto& [n, t] : shard) {
      auto it = shard_of.find(n);
      SPES_CHECK(it != shard_of.end(), "{}: tensor '{}' is not listed in {}", path, n, kIndex);
      SPES_CHECK(it->second == file, "{}: tensor '{}' is mapped to '{}' by {}", path, n,
                 it->second, kIndex);
      present[n] = true;
      out.emplace_back(n, std::move(t));
    }
    for (const auto& n : names)
      SPES_CHECK(present.count(n), "{}: tensor '{}' is listed in {} but missing from the shard",
                 path, n, kIndex);
  }
  return out;
}

std::vector<std::string> hf_write_weights(const std::string& dir, const NamedTensors& tensors,
                                          torch::ScalarType dtype, int64_t max_shard_bytes) {
  SPES_CHECK(max_shard_bytes > 0, "max shard size must be positive, found {}", max_shard_bytes);
  const int64_t esize = c10::elementSize(dtype);
  // Greedy, in order: a new shard when the next tensor would overflow the current one (a tensor
  // larger than the limit gets a shard of its own, as transformers does).
  std::vector<std::vector<size_t>> shards(1);
  int64_t cur = 0, total = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const int64_t bytes = tensors[i].second.numel() * esize;
    if (!shards.back().empty() && cur + bytes > max_shard_bytes) {
      shards.emplace_back();
      cur = 0;
    }
    shards.back().push_back(i);
    cur += bytes;
    total += bytes;
  }
  const Metadata meta = {{"format", "pt"}};
  auto shard_tensors = [&](const std::vector<size_t>& idx) {
    NamedTensors nt;
    for (size_t i : idx) nt.emplace_back(tensors[i].first, tensors[i].second.detach().to(dtype));
    return nt;
  };
  if (shards.size() == 1) {
    safetensors_save(dir + "/" + kSingle, shard_tensors(shards[0]), meta);
    return {kSingle};
  }
  std::vector<std::string> files;
  json weight_map = json::object();
  for (size_t s = 0; s < shards.size(); ++s) {
    const std::string file =
        fmt::format("model-{:05d}-of-{:05d}.safetensors", s + 1, shards.size());
    safetensors_save(dir + "/" + file, shard_tensors(shards[s]), meta);
    for (size_t i : shards[s]) weight_map[tensors[i].first] = file;
    files.push_back(file);
  }
  const json idx = {{"metadata", {{"total_size", total}}}, {"weight_map", weight_map}};
  file_write_atomic(dir + "/" + kIndex, idx.dump(2) + "\n");
  files.push_back(kIndex);
  return files;
}

int64_t parse_byte_size(const std::string& s, const std::string& what) {
  size_t i = 0;
  while (i < s.size() && (std::isdigit(static_cast<unsigned char>(s[i])) || s[i] == '.')) ++i;
  std::string unit = s.substr(i);
  for (auto& c : unit) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  double v = 0;
  bool ok = i > 0;
  if (ok) {
    try {
      size_t used = 0;
      v = std::stod(s.substr(0, i), &used);
      ok = used == i;
    } catch (const std::exception&) {
      ok = false;
    }
  }
  SPES_CHECK(ok, "{}: '{}' is not a size (examples: 5GB, 500MB, 2GiB, 1000000)", what, s);
  static const std::map<std::string, double> units = {
      {"", 1.0},          {"B", 1.0},          {"KB", 1e3},           {"MB", 1e6},
      {"GB", 1e9},        {"TB", 1e12},        {"KIB", 1024.0},       {"MIB", 1048576.0},
      {"GIB", 1073741824.0}, {"TIB", 1099511627776.0}};
  auto it = units.find(unit);
  SPES_CHECK(it != units.end(), "{}: unknown unit '{}' in '{}' (B, KB, MB, GB, TB, KiB, MiB, GiB, "
             "TiB)", what, s.substr(i), s);
  const double bytes = v * it->second;
  SPES_CHECK(bytes >= 1, "{}: '{}' is less than one byte", what, s);
  return static_cast<int64_t>(bytes);
}

torch::ScalarType hf_dtype_from_name(const std::string& n) {
  if (n == "float32" || n == "fp32") return torch::kFloat32;
  if (n == "bfloat16" || n == "bf16") return torch::kBFloat16;
  if (n == "float16" || n == "fp16") return torch::kFloat16;
  fail("unknown dtype '{}' (expected float32, bfloat16 or float16)", n);
}

std::string hf_dtype_name(torch::ScalarType t) {
  switch (t) {
    case torch::kFloat32: return "float32";
    case torch::kBFloat16: return "bfloat16";
    case torch::kFloat16: return "float16";
    default: fail("dtype {} has no Hugging Face name", c10::toString(t));
  }
}

}  // namespace spes
