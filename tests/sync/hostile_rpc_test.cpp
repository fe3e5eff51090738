// Hostile clients against a real `spes serve` process over gRPC (issue 13, item 5): seeded
// random and hostile values in every field of every request of proto/spes_sync.proto (huge and
// negative numbers, invalid UTF-8, oversize strings, random bytes as data and as whole
// messages, wrong digests, offsets and sizes, fields of the wrong wire type), with no, wrong
// and valid credentials; afterwards the server is alive, answers Status, has published
// nothing, and the honest nodes' next round publishes exactly the model an untouched server
// publishes from the same uploads. Messages are encoded by hand (protobuf wire format) and
// sent through a generic stub, so that nothing on the client side cleans them up. Also: a
// failed save shows in the Status reply and in `spes status` (publish_error). And a damaged
// top-k sparse upload, refused with its reason.
#include <gmock/gmock.h>
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <fmt/core.h>

#include <algorithm>
#include <iostream>
#include <cstring>
#include <limits>
#include <map>
#include <random>
#include <thread>

#include "spes/sync/node/client.h"
#include "spes/sync/server/server.h"
#include "spes/sync/wire/framing.h"
#include "spes_sync.grpc.pb.h"
#include "spes/sync/wire/topk_codec.h"
#include "sync/compressed_upload_parts.h"
#include "sync/serve_fixture.h"
#include "sync/sync_process_util.h"
#include "sync/sync_test_util.h"

using namespace spes;
using namespace spes::sync;
using namespace spes::sync::testing;
using ::testing::HasSubstr;
namespace pb = ::spes::sync::v1;

namespace {

// Protobuf wire format, by hand: any value in any field, valid or not.
std::string varint(uint64_t v) {
  std::string s;
  while (v >= 0x80) {
    s += static_cast<char>((v & 0x7f) | 0x80);
    v >>= 7;
  }
  return s + static_cast<char>(v);
}
std::string int_field(int field, uint64_t v) { return varint(uint64_t(field) << 3) + varint(v); }
std::string bytes_field(int field, const std::string& b) {
  return varint((uint64_t(field) << 3) | 2) + varint(b.size()) + b;
}
std::string double_field(int field, double d) {
  uint64_t bits;
  std::memcpy(&bits, &d, 8);
  std::string s = varint((uint64_t(field) << 3) | 1);
  for (int i = 0; i < 8; ++i) s += static_cast<char>((bits >> (8 * i)) & 0xff);
  return s;
}

enum class Kind { Int, String, Bytes, Double, Node, LossPoints };
struct Field {
  int number;
  Kind kind;
};

// The request messages of proto/spes_sync.proto: their fields and kinds.
struct Method {
  const char* name;
  std::vector<Field> fields;
};
const std::vector<Method> kMethods = {
    {"Join", {{1, Kind::Node}, {2, Kind::Int}, {3, Kind::String}, {4, Kind::String},
              {5, Kind::String}, {6, Kind::String}, {7, Kind::Int}, {8, Kind::Int},
              {9, Kind::String}, {10, Kind::Int}}},
    {"Upload", {{1, Kind::Node}, {2, Kind::Int}, {3, Kind::Int}, {4, Kind::Int}, {5, Kind::Int},
                {6, Kind::Bytes}, {7, Kind::String}, {8, Kind::Int}, {9, Kind::String}}},
    {"WaitRound", {{1, Kind::Node}, {2, Kind::Int}, {3, Kind::Int}}},
    {"Download", {{1, Kind::Node}, {2, Kind::Int}, {3, Kind::Int}, {4, Kind::Int}}},
    {"Leave", {{1, Kind::Node}, {2, Kind::Int}, {3, Kind::String}}},
    {"Heartbeat", {{1, Kind::Node}, {2, Kind::Int}, {3, Kind::Double}, {4, Kind::Double},
                   {5, Kind::LossPoints}}},
    {"Status", {}},
};

// Makes hostile values; `node`/`incarnation` are the identity the call's credentials claim
// (sometimes used as is, so that a call gets past the identity checks).
struct Hostile {
  std::mt19937_64 rng;
  explicit Hostile(uint64_t seed) : rng(seed) {}
  uint64_t below(uint64_t n) { return rng() % n; }
  bool chance(double p) { return std::uniform_real_distribution<double>(0, 1)(rng) < p; }
  std::string random_bytes(size_t n) {
    std::string s(n, '\0');
    for (char& c : s) c = static_cast<char>(rng());
    return s;
  }
  uint64_t number(int64_t plausible) {
    switch (below(9)) {
      case 0: return 0;
      case 1: return uint64_t(-1);  // -1 as int64, the largest uint64
      case 2: return uint64_t(std::numeric_limits<int64_t>::min());
      case 3: return uint64_t(std::numeric_limits<int64_t>::max());
      case 4: return rng();
      case 5: return below(4);
      case 6: return uint64_t(1) << below(64);
      default: return uint64_t(plausible);
    }
  }
  std::string text(const std::string& plausible) {
    switch (below(8)) {
      case 0: return "";
      case 1: return random_bytes(below(64));
      case 2: return std::string("\xff\xfe\xc3(\xed\xa0\x80 node", 12);  // not UTF-8
      case 3: return std::string(chance(0.2) ? (1 << 20) : 4096, 'n');  // oversize
      case 4: return std::string("a\0b\n\x1b[31mred\r", 13);          // control characters
      case 5: return std::string(64, "0123456789abcdef"[below(16)]);  // a digest, wrong
      default: return plausible;
    }
  }
  double real() {
    switch (below(6)) {
      case 0: return std::numeric_limits<double>::quiet_NaN();
      case 1: return std::numeric_limits<double>::infinity();
      case 2: return -std::numeric_limits<double>::infinity();
      case 3: return 1e308;
      case 4: {
        const uint64_t bits = rng();
        double d;
        std::memcpy(&d, &bits, 8);
        return d;
      }
      default: return 2.5;
    }
  }
  std::string identity(int64_t node, uint64_t incarnation) {
    if (chance(0.05)) return random_bytes(below(16));  // not a NodeIdentity
    std::string s;
    if (!chance(0.1)) s += int_field(1, chance(0.6) ? uint64_t(node) : number(node));
    if (!chance(0.1)) s += int_field(2, chance(0.6) ? incarnation : number(1));
    if (chance(0.1)) s += bytes_field(3, "token-in-the-body-0123456789");  // reserved field
    return s;
  }
  // One message of `m` with hostile values in its fields.
  std::string message(const Method& m, int64_t node, uint64_t incarnation,
                      const std::string& valid_data) {
    if (chance(0.04)) return random_bytes(below(256));  // not a message at all
    std::string s;
    for (const Field& f : m.fields) {
      if (chance(0.15)) continue;
      if (chance(0.03)) {  // the wrong wire type for the field
        s += f.kind == Kind::Int ? bytes_field(f.number, "x") : int_field(f.number, 7);
        continue;
      }
      switch (f.kind) {
        case Kind::Int: s += int_field(f.number, number(f.number == 2 ? 1 : 0)); break;
        case Kind::String: s += bytes_field(f.number, text("fp32")); break;
        case Kind::Bytes:
          s += bytes_field(f.number, chance(0.5) ? valid_data.substr(0, below(valid_data.size()))
                                                 : random_bytes(below(64 << 10)));
          break;
        case Kind::Double: s += double_field(f.number, real()); break;
        case Kind::Node: s += bytes_field(f.number, identity(node, incarnation)); break;
        case Kind::LossPoints:
          for (uint64_t i = below(300); i > 0; --i)
            s += bytes_field(f.number, int_field(1, number(5)) + double_field(2, real()));
          break;
      }
    }
    if (chance(0.05)) s += random_bytes(below(32));  // trailing garbage
    if (chance(0.05) && !s.empty()) s.resize(below(s.size()));  // truncated
    return s;
  }
};

// Call metadata: none, an id alone, wrong or valid tokens, ids that are not ids, a repeated id.
struct Credentials {
  std::vector<std::pair<std::string, std::string>> md;
  int64_t node = 0;  // the node the credentials claim (for the body)
};

Credentials credentials_of(Hostile& h, int num_peers, int hostile_node) {
  Credentials c;
  const int64_t any = static_cast<int64_t>(h.below(num_peers));
  switch (h.below(8)) {
    case 0: break;  // none
    case 1: c.node = any; c.md = {{kNodeIdMetadata, std::to_string(any)}}; break;
    case 2:
    case 3:  // the hostile node's own valid credentials
      c.node = hostile_node;
      c.md = {{kNodeIdMetadata, std::to_string(hostile_node)},
              {kNodeTokenMetadata, ServeFixture::token(hostile_node)}};
      break;
    case 4:  // another node's valid token, with bodies that do not fit it
      c.node = any;
      c.md = {{kNodeIdMetadata, std::to_string(any)}, {kNodeTokenMetadata, ServeFixture::token(any)}};
      break;
    case 5: {  // an id that is not one (printable: gRPC refuses other metadata at the client)
      const char* ids[] = {"-1", "99999999999999999999", "1e3", " 0", "0x1", "", "7", "0 0"};
      c.md = {{kNodeIdMetadata, ids[h.below(8)]}, {kNodeTokenMetadata, ServeFixture::token(0)}};
      break;
    }
    case 6:  // a wrong token
      c.node = any;
      c.md = {{kNodeIdMetadata, std::to_string(any)},
              {kNodeTokenMetadata, ServeFixture::token(any) + "x"}};
      break;
    default:  // the id twice
      c.node = hostile_node;
      c.md = {{kNodeIdMetadata, std::to_string(hostile_node)},
              {kNodeIdMetadata, std::to_string(hostile_node)},
              {kNodeTokenMetadata, ServeFixture::token(hostile_node)}};
  }
  return c;
}

// Sends `messages` as the requests of `method` (any number, even to a unary method), reads
// whatever comes back, and returns the call's status.
grpc::Status raw_call(grpc::GenericStub& stub, const std::string& method, const Credentials& c,
                      const std::vector<std::string>& messages, double deadline_s) {
  grpc::ClientContext ctx;
  set_deadline(ctx, deadline_s);
  for (const auto& [k, v] : c.md) ctx.AddMetadata(k, v);
  grpc::CompletionQueue cq;
  auto call = stub.PrepareCall(&ctx, "/spes.sync.v1.SpesSync/" + method, &cq);
  void* tag = nullptr;
  bool ok = false;
  call->StartCall(nullptr);
  cq.Next(&tag, &ok);
  for (const std::string& m : messages) {
    if (!ok) break;
    grpc::Slice slice(m);
    grpc::ByteBuffer buf(&slice, 1);
    call->Write(buf, nullptr);
    cq.Next(&tag, &ok);
  }
  call->WritesDone(nullptr);
  cq.Next(&tag, &ok);
  grpc::ByteBuffer reply;
  do {
    call->Read(&reply, nullptr);
    cq.Next(&tag, &ok);
  } while (ok);
  grpc::Status status;
  call->Finish(&status, nullptr);
  cq.Next(&tag, &ok);
  cq.Shutdown();
  while (cq.Next(&tag, &ok)) {
  }
  return status;
}

// An upload stream of `w` in chunks, each chunk an UploadChunk message with one thing wrong
// chosen by `fault` (so that it can never be accepted).
std::vector<std::string> spoiled_upload(Hostile& h, const SafetensorsStreamWriter& w,
                                        int64_t node, uint64_t incarnation) {
  std::string bytes;
  w.read(0, w.total_bytes(), &bytes);
  uint64_t total = bytes.size();
  const int fault = static_cast<int>(h.below(5));
  if (fault == 0) bytes[0] ^= static_cast<char>(1 + h.below(255));  // the header's length
  if (fault == 1) total += h.chance(0.5) ? 1 : uint64_t(-1);          // a size that is not it
  std::vector<std::string> out;
  const uint64_t chunk = 1000 + h.below(4000);
  for (uint64_t off = 0; off < bytes.size(); off += chunk) {
    const std::string data = bytes.substr(off, chunk);
    std::string sha = chunk_checksum(data);
    if (fault == 2 && off == 0) sha[3] = sha[3] == 'a' ? 'b' : 'a';  // a wrong digest
    const uint64_t at = fault == 3 && off > 0 ? off + 1 : off;          // an offset that is not
    std::string m = bytes_field(1, int_field(1, uint64_t(node)) + int_field(2, incarnation)) +
                    int_field(2, 1) + int_field(3, 10) + int_field(4, at) + int_field(5, total) +
                    bytes_field(6, data) + bytes_field(7, sha);
    if (off + chunk >= bytes.size())
      m += bytes_field(9, fault == 4 ? std::string(32, 'e') : chunk_checksum(bytes));
    out.push_back(std::move(m));
  }
  if (fault == 4 && out.size() > 1) out.pop_back();  // short, and the last digest wrong
  return out;
}

pb::StatusReply status_of(const ServeFixture& f) {
  pb::StatusReply st;
  grpc::Status s;
  for (int attempt = 0; attempt < 50; ++attempt) {
    grpc::ClientContext ctx;
    set_deadline(ctx, 60);
    st.Clear();
    s = f.stub()->Status(&ctx, pb::StatusRequest(), &st);
    if (s.error_code() != grpc::StatusCode::UNAVAILABLE) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(200));  // the Status rate limit
  }
  EXPECT_TRUE(s.ok()) << s.error_message();
  return st;
}

}  // namespace

TEST(HostileRpc, RandomValuesInEveryFieldOfEveryRpcNeverStopOrPoisonTheServer) {
  // Nodes 0 and 1 are honest; node 2 has a token and sends garbage, as do strangers.
  ServeFixture f({{}, "127.0.0.1:0", "", /*num_peers=*/3, /*vocab_size=*/512, /*num_experts=*/6});
  ASSERT_FALSE(f.address.empty()) << f.srv->log();
  TempDir ref_dir;
  RoundState ref(f.cfg, ServeOptions{ref_dir.path});  // the same run, untouched
  const std::string initial_sha = status_of(f).model_sha256();
  ASSERT_EQ(initial_sha, ref.status().model_sha256);
  FakeNode hostile(f.cfg, 2, 3);
  hostile.id.auth_token = ServeFixture::token(2);
  SyncClient(f.address, hostile.id).join(hostile.join_info());
  const SafetensorsStreamWriter valid = upload_of(hostile, 1, trained(hostile, ref, 0.001));
  std::string valid_bytes;
  valid.read(0, valid.total_bytes(), &valid_bytes);

  auto channel = grpc::CreateChannel(f.address, grpc::InsecureChannelCredentials());
  grpc::GenericStub stub(channel);
  Hostile h(20261202);
  std::map<grpc::StatusCode, int> codes;
  for (int call = 0; call < 400; ++call) {
    const Method& m = kMethods[h.below(kMethods.size())];
    const Credentials c = credentials_of(h, 3, 2);
    const uint64_t incarnation = c.node == 2 && h.chance(0.7) ? hostile.id.incarnation : h.rng();
    std::vector<std::string> messages;
    if (std::string(m.name) == "Upload" && c.node == 2 && h.chance(0.3)) {
      messages = spoiled_upload(h, valid, 2, incarnation);
    } else {
      const size_t n = std::string(m.name) == "Upload" ? h.below(5) : 1 + (h.chance(0.05) ? 1 : 0);
      for (size_t i = 0; i < n; ++i)
        messages.push_back(h.message(m, c.node, incarnation, valid_bytes));
      if (h.chance(0.01)) messages.push_back(h.random_bytes(kMaxMessageBytes + 1024));
    }
    const grpc::Status s = raw_call(stub, m.name, c, messages, 2);
    ++codes[s.error_code()];
    // A handler that let an exception out would answer UNKNOWN.
    EXPECT_NE(s.error_code(), grpc::StatusCode::UNKNOWN) << m.name << ": " << s.error_message();
    ASSERT_FALSE(f.srv->poll()) << "call " << call << " (" << m.name << ") stopped the server\n"
                                << f.srv->log();
  }
  std::string histogram;
  for (const auto& [code, n] : codes) histogram += fmt::format(" {}:{}", static_cast<int>(code), n);
  std::cout << "status codes of the hostile calls (code:count):" << histogram << "\n";
  EXPECT_GT(codes[grpc::StatusCode::PERMISSION_DENIED], 0);
  EXPECT_GT(codes[grpc::StatusCode::OK], 0);  // some got through (Status, heartbeats, ...)
  // Alive, answering, and nothing published.
  const pb::StatusReply after = status_of(f);
  EXPECT_EQ(after.published_round(), 0);
  EXPECT_EQ(after.model_sha256(), initial_sha);
  EXPECT_EQ(after.publish_error(), "");

  // The honest round: node 2 is out of it (its garbage upload was refused, or it is refused
  // now); nodes 0 and 1 upload, and the round publishes exactly what the untouched server
  // publishes from the same uploads.
  hostile.id.incarnation = 777;
  retried([&] { return SyncClient(f.address, hostile.id).join(hostile.join_info()); });
  ref.join(hostile.join_info());
  EXPECT_EQ(code_of([&] { ref.begin_upload(hostile.id, 1, 10, 5); }),
            SyncErrc::ResourceExhausted);
  {
    grpc::ClientContext ctx;
    set_deadline(ctx, 60);
    credentials(ctx, 2, ServeFixture::token(2));
    pb::UploadReply rep;
    auto w = f.stub()->Upload(&ctx, &rep);
    pb::UploadChunk c;
    c.mutable_node()->set_node_id(2);
    c.mutable_node()->set_incarnation(777);
    c.set_round(1);
    c.set_step(10);
    c.set_total_bytes(5);
    c.set_data("12345");
    c.set_checksum(chunk_checksum("12345"));
    w->Write(c);
    w->WritesDone();
    EXPECT_FALSE(w->Finish().ok());
  }
  std::vector<std::unique_ptr<FakeNode>> honest;
  for (int i = 0; i < 2; ++i) {
    honest.push_back(std::make_unique<FakeNode>(f.cfg, i, 10 + i));
    honest.back()->id.auth_token = ServeFixture::token(i);
  }
  std::vector<SafetensorsStreamWriter> uploads;
  for (int i = 0; i < 2; ++i)
    uploads.push_back(upload_of(*honest[i], 1, trained(*honest[i], ref, 0.001 * (i + 1))));
  for (int i = 0; i < 2; ++i) {
    ref.join(honest[i]->join_info());
    send_upload(ref, honest[i]->id, 1, uploads[i]);
  }
  ASSERT_EQ(ref.published_round(), 1);
  for (int i = 0; i < 2; ++i) {
    SyncClient client(f.address, honest[i]->id);
    retried([&] { return client.join(honest[i]->join_info()); });
    EXPECT_TRUE(retried([&] { return client.upload(1, 10, uploads[i]); }).accepted);
  }
  SyncClient waiter(f.address, honest[0]->id);
  const RoundStatus r = retried([&] { return waiter.wait_round(1, 30000); });
  ASSERT_TRUE(r.published) << f.srv->log();
  EXPECT_EQ(r.model_sha256, ref.status().model_sha256);
  EXPECT_EQ(status_of(f).model_sha256(), ref.status().model_sha256);
  EXPECT_FALSE(f.srv->poll()) << f.srv->log();
}

// A node with a token that calls as fast as it can is held to its call rate (call_rates.h):
// past the burst its calls are refused as UNAVAILABLE, naming the limit, while another node's
// calls and read access from elsewhere are unaffected; once its bucket refills it is served
// again.
TEST(HostileRpc, AFloodOfCallsFromOneNodeIsHeldToItsRateAndOthersAreNot) {
  ServeFixture f({{}, "127.0.0.1:0", "", /*num_peers=*/2});
  ASSERT_FALSE(f.address.empty()) << f.srv->log();
  std::vector<std::unique_ptr<FakeNode>> nodes;
  std::vector<std::unique_ptr<SyncClient>> clients;
  for (int i = 0; i < 2; ++i) {
    nodes.push_back(std::make_unique<FakeNode>(f.cfg, i, 5 + i));
    nodes.back()->id.auth_token = ServeFixture::token(i);
    clients.push_back(std::make_unique<SyncClient>(f.address, nodes.back()->id));
    clients.back()->join(nodes.back()->join_info());
  }
  int ok = 0, limited = 0;
  std::string refusal;
  for (int i = 0; i < 3000 && limited < 5; ++i) {  // as fast as it can, until refused
    try {
      clients[1]->heartbeat(0);
      ++ok;
    } catch (const SyncError& e) {
      ASSERT_EQ(e.code(), SyncErrc::Unavailable) << e.what();
      ++limited;
      refusal = e.what();
    }
  }
  // The burst of 40 and what refilled meanwhile got through; then calls were refused.
  EXPECT_GE(ok, 40);
  EXPECT_EQ(limited, 5);
  EXPECT_THAT(refusal, HasSubstr("node 1 calls Heartbeat more often than 20 a second"));
  // Node 0 is served at once.
  EXPECT_EQ(clients[0]->heartbeat(0), 0);
  EXPECT_EQ(status_of(f).nodes_size(), 2);
  // Node 1 again, after its bucket refilled a little (20 a second).
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  EXPECT_NO_THROW(clients[1]->heartbeat(0));
  EXPECT_FALSE(f.srv->poll()) << f.srv->log();
}

// A node whose calls are refused for their rate waits its whole backoff before it calls again
// (the retry loop of SyncNode::call, as the node runs it). Found by issue 35's load runs: the
// wait returned at once on a connected channel, so a node syncing faster than the Upload rate
// retried about once a millisecond (169,172 attempts) and its bucket never refilled.
TEST(HostileRpc, ACallRefusedForItsRateIsRetriedOnlyAfterTheBackoff) {
  ServeFixture f({{}, "127.0.0.1:0", "", /*num_peers=*/1});
  ASSERT_FALSE(f.address.empty()) << f.srv->log();
  FakeNode node(f.cfg, 0, 5);
  node.id.auth_token = ServeFixture::token(0);
  SyncClient client(f.address, node.id);
  client.join(node.join_info());
  bool refused = false;
  for (int i = 0; i < 3000 && !refused; ++i) {  // empty the bucket
    try {
      client.heartbeat(0);
    } catch (const SyncError& e) {
      ASSERT_EQ(e.code(), SyncErrc::Unavailable) << e.what();
      refused = true;
    }
  }
  ASSERT_TRUE(refused);
  int attempts = 0;
  double backoff = 0.2;  // the node's first backoff: 4 heartbeats' worth at 20 a second
  for (bool served = false; !served && attempts < 1000;) {
    ++attempts;
    try {
      client.heartbeat(0);
      served = true;
    } catch (const SyncError& e) {
      ASSERT_EQ(e.code(), SyncErrc::Unavailable) << e.what();
      client.wait_before_retry(backoff);
      backoff *= 2;
    }
  }
  EXPECT_LE(attempts, 3) << "a refused call was retried without waiting";
  EXPECT_FALSE(f.srv->poll()) << f.srv->log();
}

// Issue 35, finding 7: Status is limited per host, so a flood of Status calls from one host
// starved `spes status` there. Callers holding the read token have a budget of their own: after
// a flood without it from the same host has been refused for its rate, `spes status` with the
// token is answered at once.
TEST(HostileRpc, AStatusFloodFromAHostDoesNotStarveTheReadTokenHolder) {
  TempDir keys;
  write_secret(keys.path + "/read.token", "read-token-0123456789abcdef\n", kPrivate);
  ServeFixture f({{"--read-token-file", keys.path + "/read.token"}});
  ASSERT_FALSE(f.address.empty()) << f.srv->log();
  int limited = 0;
  std::string refusal;
  for (int i = 0; i < 3000 && limited < 5; ++i) {
    grpc::ClientContext ctx;
    set_deadline(ctx, 60);
    pb::StatusReply st;
    const grpc::Status s = f.stub()->Status(&ctx, pb::StatusRequest(), &st);
    ASSERT_FALSE(s.ok());
    if (s.error_code() == grpc::StatusCode::UNAVAILABLE) {
      ++limited;
      refusal = s.error_message();
    } else {
      ASSERT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED) << s.error_message();
    }
  }
  ASSERT_EQ(limited, 5);
  EXPECT_THAT(refusal, HasSubstr("calls Status more often than 20 a second"));
  Proc ok("status", {SPES_BINARY, "status", "--server", f.address, "--read-token-file",
                     keys.path + "/read.token", "--json"});
  ASSERT_TRUE(pump_until({&ok}, [&] { return ok.exited; }, 60));
  EXPECT_EQ(ok.code, 0) << ok.log() << f.srv->log();
  EXPECT_TRUE(ok.saw("\"published_round\": 0")) << ok.log();
}

TEST(HostileRpc, AFailedSaveShowsInStatusAndInSpesStatus) {
  TempDir dir;
  const Config cfg = tiny_config({"spes_config.dashboard_port=-1"});
  ServerOptions o;
  o.state.out_dir = dir.path;
  SyncServer server(cfg, o);  // gRPC serves on its own threads; nothing ticks (no retry)
  RoundState& st = server.state();
  FakeNode a(cfg, 0, 1), b(cfg, 1, 2);
  st.join(a.join_info());
  st.join(b.join_info());
  const auto ua = upload_of(a, 1, trained(a, st, 0.001));
  const auto ub = upload_of(b, 1, trained(b, st, -0.002));
  send_upload(st, a.id, 1, ua);
  {
    FileSizeLimit full(ub.total_bytes() + 64);  // the upload is staged, the model not saved
    send_upload(st, b.id, 1, ub);
  }
  ASSERT_EQ(st.published_round(), 0);
  const ServerStatus s = SyncClient(server.address(), NodeId{}).status();
  EXPECT_THAT(s.publish_error, HasSubstr("disk full"));
  EXPECT_EQ(s.publish_error, st.status().publish_error);
  Proc table("status", {SPES_BINARY, "status", "--server", server.address()});
  Proc json("status", {SPES_BINARY, "status", "--server", server.address(), "--json"});
  ASSERT_TRUE(pump_until({&table, &json}, [&] { return table.exited && json.exited; }, 120));
  EXPECT_EQ(table.code, 0) << table.log();
  EXPECT_TRUE(table.saw("round 1 is closed but NOT published")) << table.log();
  EXPECT_TRUE(table.saw("disk full")) << table.log();
  EXPECT_EQ(json.code, 0) << json.log();
  EXPECT_TRUE(json.saw("\"publish_error\": \"")) << json.log();
  EXPECT_TRUE(json.saw("disk full")) << json.log();
}

// compression: topk over gRPC (docs/PROTOCOL.md "Sparse deltas"): a sparse upload whose
// payload is damaged (a NaN chunk scale, then bytes left over) is refused by the real server
// with the reason, naming the tensor, before anything is applied; the honest node's upload
// then publishes the round without it, and its digest is the one both nodes can rebuild.
TEST(HostileRpc, AHostileSparseUploadIsRefusedWithItsReason) {
  ServeSetup setup;
  setup.extra_config = "  compression: topk\n";
  ServeFixture f(setup);
  ASSERT_FALSE(f.address.empty()) << f.srv->log();
  FakeNode a(f.cfg, 0, 1), b(f.cfg, 1, 2);
  a.id.auth_token = ServeFixture::token(0);
  b.id.auth_token = ServeFixture::token(1);
  SyncClient ca(f.address, a.id), cb(f.address, b.id);
  const JoinResult ja = ca.join(a.join_info());
  cb.join(b.join_info());
  const std::string embed = "model.embed_tokens.weight";
  auto upload = [&](const FakeNode& n, const std::function<void(std::string&)>& spoil) {
    NamedTensors t = compressed_upload_parts(n, Compression::Topk, [&](const RegistryEntry& e) {
      return spoil ? torch::full(e.tensor.sizes(), 0.01f) : torch::zeros_like(e.tensor);
    });
    for (auto& [name, v] : t)
      if (name == embed && spoil) {
        std::string s = topk_payload_of(v);
        spoil(s);
        v = topk_payload_tensor(s);
      }
    UploadMeta m{n.id.node_id, 1, 10, 80, n.id.incarnation, n.reg->fingerprint()};
    m.compression = Compression::Topk;
    return SafetensorsStreamWriter::as_stored(std::move(t), upload_metadata(m));
  };
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const std::string why = error_of([&] {
    ca.upload(1, 10, upload(a, [&](std::string& s) {
      std::memcpy(&s[kTopkFixedHeader + 2 * static_cast<size_t>(topk_chunks(8192 * 32))], &nan,
                  4);
    }));
  });
  EXPECT_THAT(why, HasSubstr("tensor 'model.embed_tokens.weight': its topk delta is refused: "
                             "chunk 0: its scale is not finite"));
  // The node is out of the round: a second hostile try is refused too.
  EXPECT_NE(error_of([&] { ca.upload(1, 10, upload(a, [](std::string& s) { s += '\0'; })); }),
            "");
  ASSERT_TRUE(cb.upload(1, 10, upload(b, nullptr)).accepted);
  RoundStatus st;
  for (int i = 0; i < 100 && !st.published; ++i) st = cb.wait_round(1, 2000);
  ASSERT_TRUE(st.published) << f.srv->log();
  EXPECT_EQ(st.nodes, std::vector<int64_t>{1});
  EXPECT_EQ(st.model_sha256, ja.model_sha256) << "a zero change publishes the same model";
  f.srv->poll();
  EXPECT_TRUE(f.srv->saw("its topk delta is refused")) << f.srv->log();
}
