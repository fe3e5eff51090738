// TensorBoard event files (see tensorboard_writer.h).
#include "spes/io/tensorboard_writer.h"

#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstring>

#include <fmt/format.h>

#include "spes/common/error.h"
#include "spes/common/timing.h"
#include "spes/io/crc32c.h"

namespace spes {
namespace {

// Protobuf wire types.
constexpr int kVarint = 0, kFixed64 = 1, kLengthDelimited = 2, kFixed32 = 5;

void put_varint(std::string& out, uint64_t v) {
  while (v >= 0x80) {
    out.push_back(static_cast<char>((v & 0x7F) | 0x80));
    v >>= 7;
  }
  out.push_back(static_cast<char>(v));
}

void put_key(std::string& out, int field, int wire_type) {
  put_varint(out, static_cast<uint64_t>(field) << 3 | static_cast<uint64_t>(wire_type));
}

void put_le(std::string& out, uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xFF));
}

void put_double(std::string& out, int field, double v) {
  uint64_t bits;
  std::memcpy(&bits, &v, sizeof bits);
  put_key(out, field, kFixed64);
  put_le(out, bits, 8);
}

void put_float(std::string& out, int field, float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof bits);
  put_key(out, field, kFixed32);
  put_le(out, bits, 4);
}

void put_bytes(std::string& out, int field, std::string_view bytes) {
  put_key(out, field, kLengthDelimited);
  put_varint(out, bytes.size());
  out.append(bytes);
}

// Event's fields (tensorflow/core/util/event.proto): wall_time 1, step 2, file_version 3,
// summary 5; Summary: value 1; Summary.Value: tag 1, simple_value 2.
std::string event_head(double wall_time, int64_t step) {
  std::string e;
  put_double(e, 1, wall_time);
  if (step != 0) {
    put_key(e, 2, kVarint);
    put_varint(e, static_cast<uint64_t>(step));
  }
  return e;
}

std::string hostname() {
  char buf[256] = {};
  if (::gethostname(buf, sizeof buf - 1) != 0 || buf[0] == 0) return "localhost";
  return buf;
}

}  // namespace

std::string tfrecord_frame(std::string_view data) {
  std::string length;
  put_le(length, data.size(), 8);
  std::string out = length;
  put_le(out, masked_crc32c(length), 4);
  out.append(data);
  put_le(out, masked_crc32c(data), 4);
  return out;
}

std::string encode_scalar_event(double wall_time, int64_t step, const Scalars& values) {
  std::string summary;
  for (const auto& [tag, v] : values) {
    std::string value;
    put_bytes(value, 1, tag);
    put_float(value, 2, static_cast<float>(v));
    put_bytes(summary, 1, value);
  }
  std::string e = event_head(wall_time, step);
  put_bytes(e, 5, summary);
  return e;
}

std::string encode_file_version_event(double wall_time) {
  std::string e = event_head(wall_time, 0);
  put_bytes(e, 3, "brain.Event:2");
  return e;
}

TensorBoardWriter::TensorBoardWriter(const std::string& dir) {
  const double now = unix_time();
  path_ = fmt::format("{}/events.out.tfevents.{}.{}.{}", dir, static_cast<int64_t>(now),
                      hostname(), ::getpid());
  f_ = std::fopen(path_.c_str(), "ab");
  SPES_CHECK(f_, "cannot create the TensorBoard event file '{}': {}", path_,
             std::strerror(errno));
  append(encode_file_version_event(now));
}

TensorBoardWriter::~TensorBoardWriter() {
  if (f_) std::fclose(f_);
}

void TensorBoardWriter::append(const std::string& event) {
  const std::string record = tfrecord_frame(event);
  std::fwrite(record.data(), 1, record.size(), f_);
  std::fflush(f_);
}

void TensorBoardWriter::write(int64_t step, double wall_time, const Scalars& values) {
  if (!values.empty()) append(encode_scalar_event(wall_time, step, values));
}

void TensorBoardWriter::write(int64_t step, double wall_time, const nlohmann::json& record,
                              const std::vector<ScalarKey>& keys) {
  Scalars values;
  for (const auto& k : keys) {
    const auto it = record.find(k.key);
    if (it != record.end() && it->is_number()) values.emplace_back(k.tag, it->get<double>());
  }
  write(step, wall_time, values);
}

}  // namespace spes
