// The fuzz targets' entry functions, one per kind of untrusted input; the libFuzzer drivers
// (tests/fuzz/fuzz_driver.cc, built by scripts/fuzz.sh) and the regression test that replays
// the kept cases (tests/fuzz/fuzz_cases_test.cpp, built with the normal build) call the same
// code. Each returns normally when the product code accepted the input or refused it with a
// clean spes::Error (a message naming the problem); anything else (another exception, a crash,
// a sanitizer report) is a bug.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace spes::fuzz {

// safetensors_parse (src/spes/io/safetensors.cpp) of the bytes, as a file.
void fuzz_safetensors(const uint8_t* data, size_t size);
// config_parse (src/spes/io/config.cpp): the bytes up to the first NUL are the YAML text, each
// further NUL-separated piece is one `--set KEY=VALUE` override.
void fuzz_config(const uint8_t* data, size_t size);
// The server's handling of an Upload stream: records of [u32 little-endian length][serialized
// spes.sync.v1.UploadChunk], as the gRPC handler (src/spes/sync/server/server.cpp) receives them,
// through the chunk decoding (a zstd frame when `encoding` says so: wire/chunk_coding.cpp), the
// chunk assembly (upload_assembly.cpp) and the stream parser (framing.cpp). A chunk whose
// `checksum` field is empty gets the correct checksum of its raw bytes here, so that the fuzzer
// reaches the parser (it would not guess one); chunks with a checksum are checked as sent.
void fuzz_upload_stream(const uint8_t* data, size_t size);

// The sync server's RPC handling and round logic with a real (tiny) model: a sequence of calls
// of every RPC, by the run's nodes and by strangers (the record format and the invariants it
// checks: fuzz_round_rpc.cpp); round_rpc_int8: the same with int8-compressed deltas.
void fuzz_round_rpc(const uint8_t* data, size_t size);
void fuzz_round_rpc_int8(const uint8_t* data, size_t size);

// The targets by name ("safetensors", "config", "upload_stream", "round_rpc",
// "round_rpc_int8"), for
// scripts/fuzz.sh and the regression test; fuzz_run throws spes::Error for an unknown name.
const std::vector<std::string>& fuzz_target_names();
void fuzz_run(const std::string& target, const uint8_t* data, size_t size);

}  // namespace spes::fuzz
