// Hugging Face weight files: one file below the shard limit, shards + index above it (index
// contents checked by hand), dtypes, a tampered index, pickle-only directories, size strings.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <filesystem>

#include "interop/interop_test_util.h"
#include "spes/common/error.h"
#include "spes/interop/hf_weights.h"
#include "spes/io/files.h"

using namespace spes;
using json = nlohmann::json;
using ::testing::HasSubstr;
namespace fs = std::filesystem;

namespace {

// 4 tensors of 100, 300, 50 and 200 fp32 values (400, 1200, 200, 800 bytes).
NamedTensors four_tensors() {
  torch::manual_seed(1);
  return {{"a.weight", torch::randn({10, 10})},
          {"b.weight", torch::randn({3, 100})},
          {"c.weight", torch::randn({50})},
          {"d.weight", torch::randn({20, 10})}};
}

void expect_equal(const NamedTensors& got, const NamedTensors& want) {
  ASSERT_EQ(got.size(), want.size());
  std::map<std::string, torch::Tensor> by_name(got.begin(), got.end());
  for (const auto& [n, t] : want) {
    ASSERT_TRUE(by_name.count(n)) << n;
    EXPECT_TRUE(torch::equal(by_name[n], t)) << n;
  }
}

using interop_test::error_of;

TEST(InteropHfWeights, OneFileBelowTheLimitTaggedFormatPt) {
  interop_test::TempDir d;
  const auto files = hf_write_weights(d.path.string(), four_tensors(), torch::kFloat32, 2600);
  EXPECT_EQ(files, std::vector<std::string>{"model.safetensors"});
  EXPECT_FALSE(fs::exists(d.file("model.safetensors.index.json")));
  Metadata meta;
  expect_equal(safetensors_load(d.file("model.safetensors"), &meta), four_tensors());
  EXPECT_EQ(meta["format"], "pt");
  expect_equal(hf_read_weights(d.path.string()), four_tensors());
}

TEST(InteropHfWeights, ShardsAndIndexAboveTheLimit) {
  interop_test::TempDir d;
  // Limit 1500 bytes, greedy in order: [a 400] + b 1200 > 1500 -> new; [b 1200, c 200]; d 800
  // -> new: three shards.
  const auto files = hf_write_weights(d.path.string(), four_tensors(), torch::kFloat32, 1500);
  const std::vector<std::string> want = {"model-00001-of-00003.safetensors",
                                         "model-00002-of-00003.safetensors",
                                         "model-00003-of-00003.safetensors",
                                         "model.safetensors.index.json"};
  EXPECT_EQ(files, want);
  const json idx = json::parse(file_read(d.file("model.safetensors.index.json")));
  EXPECT_EQ(idx["metadata"]["total_size"], 2600);
  EXPECT_EQ(idx["weight_map"], json({{"a.weight", want[0]},
                                     {"b.weight", want[1]},
                                     {"c.weight", want[1]},
                                     {"d.weight", want[2]}}));
  EXPECT_FALSE(fs::exists(d.file("model.safetensors")));
  Metadata meta;
  EXPECT_EQ(safetensors_load(d.file(want[1]), &meta).size(), 2u);
  EXPECT_EQ(meta["format"], "pt");
  expect_equal(hf_read_weights(d.path.string()), four_tensors());
}

TEST(InteropHfWeights, WritesAndReadsHalfPrecision) {
  interop_test::TempDir d;
  hf_write_weights(d.path.string(), four_tensors(), torch::kBFloat16, 1 << 20);
  const NamedTensors got = hf_read_weights(d.path.string());
  NamedTensors want;
  for (const auto& [n, t] : four_tensors()) want.emplace_back(n, t.to(torch::kBFloat16));
  for (const auto& [n, t] : got) EXPECT_EQ(t.scalar_type(), torch::kBFloat16) << n;
  expect_equal(got, want);
}

TEST(InteropHfWeights, RefusesAnIndexThatDisagreesWithItsShards) {
  interop_test::TempDir d;
  const std::string dir = d.path.string();
  hf_write_weights(dir, four_tensors(), torch::kFloat32, 1500);
  const std::string idx_path = d.file("model.safetensors.index.json");
  const json good = json::parse(file_read(idx_path));
  json j = good;
  j["weight_map"]["c.weight"] = "model-00001-of-00003.safetensors";
  file_write_atomic(idx_path, j.dump());
  // Shard 1 is read first: the tensor the index places there is not in it.
  EXPECT_THAT(error_of([&] { hf_read_weights(dir); }),
              HasSubstr("model-00001-of-00003.safetensors: tensor 'c.weight' is listed in "
                        "model.safetensors.index.json but missing from the shard"));
  j = good;
  j["weight_map"]["a.weight"] = "model-00002-of-00003.safetensors";
  file_write_atomic(idx_path, j.dump());
  // Shard 1 is no longer listed; shard 2 holds c and b but not a.
  EXPECT_THAT(error_of([&] { hf_read_weights(dir); }),
              HasSubstr("tensor 'a.weight' is listed in model.safetensors.index.json but "
                        "missing from the shard"));
  j = good;
  j["weight_map"]["e.weight"] = "model-00003-of-00003.safetensors";
  file_write_atomic(idx_path, j.dump());
  EXPECT_THAT(error_of([&] { hf_read_weights(dir); }),
              HasSubstr("tensor 'e.weight' is listed in model.safetensors.index.json but "
                        "missing from the shard"));
  j = good;
  j["weight_map"].erase("b.weight");  // still in shard 2, which the index lists for c
  file_write_atomic(idx_path, j.dump());
  EXPECT_THAT(error_of([&] { hf_read_weights(dir); }),
              HasSubstr("tensor 'b.weight' is not listed in model.safetensors.index.json"));
  j = good;
  j["weight_map"]["c.weight"] = "model-00003-of-00003.safetensors";
  file_write_atomic(idx_path, j.dump());
  EXPECT_THAT(error_of([&] { hf_read_weights(dir); }),
              HasSubstr("model-00002-of-00003.safetensors: tensor 'c.weight' is mapped to "
                        "'model-00003-of-00003.safetensors'"));
  j = good;
  j["weight_map"]["d.weight"] = "model-00009-of-00009.safetensors";
  file_write_atomic(idx_path, j.dump());
  EXPECT_THAT(error_of([&] { hf_read_weights(dir); }),
              HasSubstr("shard 'model-00009-of-00009.safetensors' listed in the index is "
                        "missing"));
}

TEST(InteropHfWeights, RefusesPickleOnlyDirectories) {
  interop_test::TempDir d;
  spes::test::write_bytes(d.file("pytorch_model.bin"), "not read");
  EXPECT_THAT(error_of([&] { hf_read_weights(d.path.string()); }),
              HasSubstr("pickle weights (pytorch_model.bin)"));
}

TEST(InteropHfWeights, ParsesSizes) {
  EXPECT_EQ(parse_byte_size("5GB", "x"), 5000000000);
  EXPECT_EQ(parse_byte_size("500MB", "x"), 500000000);
  EXPECT_EQ(parse_byte_size("2GiB", "x"), 2147483648);
  EXPECT_EQ(parse_byte_size("1.5kb", "x"), 1500);
  EXPECT_EQ(parse_byte_size("123", "x"), 123);
  EXPECT_THAT(error_of([] { parse_byte_size("GB", "--max-shard-size"); }),
              HasSubstr("--max-shard-size: 'GB' is not a size"));
  EXPECT_THAT(error_of([] { parse_byte_size("5XB", "--max-shard-size"); }),
              HasSubstr("unknown unit 'XB'"));
  EXPECT_EQ(hf_dtype_from_name("bf16"), torch::kBFloat16);
  EXPECT_THAT(error_of([] { hf_dtype_from_name("int8"); }), HasSubstr("unknown dtype 'int8'"));
}

}  // namespace
