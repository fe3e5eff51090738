// UploadAssembly, the server's chunk-level assembly of an upload stream: a repeated chunk is
// ignored (never applied twice), a chunk overlapping the bytes received adds only its new
// bytes, gaps, overruns, oversized and corrupt chunks are refused, and the whole-stream digest
// covers each byte once.
#include <gtest/gtest.h>

#include "spes/io/files.h"
#include "spes/sync/server/upload_assembly.h"
#include "spes/sync/wire/checksum.h"
#include "spes/sync/wire/framing.h"
#include "spes/sync/wire/protocol.h"
#include "sync/sync_test_util.h"

using namespace spes;
using namespace spes::sync;
using namespace spes::sync::testing;

namespace {

std::string add(UploadAssembly& a, uint64_t offset, const std::string& data) {
  return std::string(a.accept(offset, data, chunk_checksum(data)));
}

}  // namespace

TEST(UploadAssembly, RepeatedChunksAreIgnoredAndOverlapsAddOnlyTheirNewBytes) {
  UploadAssembly a(10, "node 0 round 1");
  EXPECT_EQ(add(a, 0, "0123"), "0123");
  EXPECT_EQ(add(a, 0, "0123"), "");  // the same chunk again
  EXPECT_EQ(add(a, 2, "23"), "");    // a piece of it
  EXPECT_EQ(add(a, 4, ""), "");      // an empty chunk at the end of what arrived
  EXPECT_EQ(a.received(), 4u);
  EXPECT_EQ(add(a, 2, "2345"), "45");  // overlaps the end: only the new bytes count
  EXPECT_EQ(a.received(), 6u);
  EXPECT_FALSE(a.complete());
  EXPECT_EQ(code_of([&] { a.checksum(); }), SyncErrc::DataLoss);  // not every byte yet
  EXPECT_EQ(add(a, 6, "6789"), "6789");
  EXPECT_EQ(add(a, 0, "0123456789"), "");  // a repeat of everything after the end
  ASSERT_TRUE(a.complete());
  EXPECT_EQ(a.checksum(), chunk_checksum("0123456789"));  // each byte hashed once
}

TEST(UploadAssembly, CorruptOversizedOutOfOrderAndOverrunningChunksAreRefused) {
  UploadAssembly a(10, "node 0 round 1");
  add(a, 0, "0123");
  EXPECT_EQ(code_of([&] { a.accept(4, "4567", chunk_checksum("4568")); }), SyncErrc::DataLoss);
  EXPECT_EQ(code_of([&] { add(a, 6, "67"); }), SyncErrc::InvalidArgument);  // a gap
  EXPECT_EQ(code_of([&] { add(a, 4, "4567890"); }), SyncErrc::InvalidArgument);  // past 10
  EXPECT_EQ(code_of([&] { add(a, 4, std::string(kMaxChunkBytes + 1, 'x')); }),
            SyncErrc::ResourceExhausted);
  EXPECT_EQ(a.received(), 4u);  // nothing refused was counted
  EXPECT_EQ(add(a, 4, "456789"), "456789");
  EXPECT_EQ(a.checksum(), chunk_checksum("0123456789"));
}
