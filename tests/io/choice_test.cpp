// Settings that take one of a few names (io/choice.h): parsed once from YAML and `--set`,
// refused with the key and the allowed names, compared as enums, and written back as names.
#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <sstream>

#include "spes/common/error.h"
#include "spes/io/config.h"

using namespace spes;
using ::testing::HasSubstr;

namespace {
std::string error_of(const std::string& yaml, std::vector<std::string> sets = {}) {
  try {
    config_parse(yaml, sets, "test.yaml");
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}
}  // namespace

TEST(Choice, ParsesEveryNameOfEverySetting) {
  const Config c = config_parse(
      "model:\n  qk_norm: per_head\n  block_type: dense\nprecision: amp_bf16\n"
      "spes_config:\n  mode: diloco\n  transfer_dtype: bf16\n  weighting: tokens\n",
      {"spes_config.num_peers=2"}, "test.yaml");
  EXPECT_EQ(c.model.qk_norm.value(), QkNorm::PerHead);
  EXPECT_EQ(c.model.block_type.value(), BlockType::Dense);
  EXPECT_EQ(c.precision.value(), Precision::AmpBf16);
  EXPECT_EQ(c.spes_config.mode.value(), SyncMode::Diloco);
  EXPECT_EQ(c.spes_config.transfer.dtype.value(), TransferDtype::Bf16);
  EXPECT_EQ(c.spes_config.weighting.value(), Weighting::Tokens);
  const Config m = config_parse("spes_config:\n  aggregation: trimmed_mean\n", {}, "t");
  EXPECT_EQ(m.spes_config.bounds.aggregation.value(), Aggregation::TrimmedMean);
  for (const auto& [e, name] : ChoiceNames<SyncMode>::names) {
    const Config s = config_parse("", {"spes_config.mode=" + std::string(name)}, "t");
    EXPECT_EQ(s.spes_config.mode.value(), e) << name;
    EXPECT_EQ(s.spes_config.mode.name(), name);
  }
}

TEST(Choice, AnUnknownNameIsRefusedWithTheKeyAndTheAllowedNames) {
  EXPECT_EQ(error_of("spes_config:\n  mode: spess\n"),
            "test.yaml: spes_config.mode must be centralized, spes, fedavg or diloco, found "
            "'spess'");
  EXPECT_THAT(error_of("", {"spes_config.transfer_dtype=fp16"}),
              HasSubstr("spes_config.transfer_dtype must be fp32 or bf16, found 'fp16'"));
  EXPECT_THAT(error_of("model:\n  qk_norm: [whole]\n"),
              HasSubstr("key 'model.qk_norm' must be whole, per_head or none"));
  EXPECT_THAT(error_of("precision: bf16\n"),
              HasSubstr("precision must be auto, fp32 or amp_bf16, found 'bf16'"));
  // Names are exact: no case folding, no surrounding blanks.
  EXPECT_THAT(error_of("", {"spes_config.aggregation=Median"}),
              HasSubstr("spes_config.aggregation must be mean, trimmed_mean or median"));
  EXPECT_THROW(Choice<Weighting>("equal "), Error);
}

TEST(Choice, ComparesAsAnEnumAndPrintsItsName) {
  Choice<SyncMode> m = SyncMode::Spes;
  EXPECT_TRUE(m == SyncMode::Spes);
  EXPECT_TRUE(m != SyncMode::Fedavg);
  EXPECT_TRUE(m == "spes");
  EXPECT_TRUE(m != std::string("diloco"));
  m = "fedavg";
  EXPECT_EQ(m.value(), SyncMode::Fedavg);
  switch (m) {
    case SyncMode::Fedavg: break;
    default: ADD_FAILURE() << "switch on a Choice takes its enum value";
  }
  std::ostringstream os;
  os << m;
  EXPECT_EQ(os.str(), "fedavg");
  EXPECT_EQ(fmt::format("[{}]", m), "[fedavg]");
  // Comparing against a name that is not one is a mistake, not `false`.
  EXPECT_THROW((void)(m == "fed_avg"), Error);
}

TEST(Choice, ConfigYamlWritesNamesThatReadBackTheSame) {
  Config c;
  c.spes_config.mode = SyncMode::Diloco;
  c.spes_config.bounds.aggregation = Aggregation::Median;
  c.model.qk_norm = QkNorm::None;
  c.precision = Precision::Fp32;
  const std::string yaml = config_to_yaml(c);
  EXPECT_THAT(yaml, HasSubstr("mode: diloco\n"));  // plain, as written (spes config)
  EXPECT_THAT(yaml, HasSubstr("aggregation: median\n"));
  const Config back = config_parse(yaml, {}, "round-trip");
  EXPECT_EQ(back.spes_config.mode.value(), SyncMode::Diloco);
  EXPECT_EQ(back.spes_config.bounds.aggregation.value(), Aggregation::Median);
  EXPECT_EQ(back.model.qk_norm.value(), QkNorm::None);
  EXPECT_EQ(back.precision.value(), Precision::Fp32);
}
