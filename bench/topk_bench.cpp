// Top-k sparse deltas at the sync bench's shape, in one process (issue 37): N simulated nodes
// with their error feedback (sync/round/topk_feedback.h) encode each round's change of their
// trainable tensors, the server decodes every upload (checked), averages the shared tensors,
// copies the owners' experts and publishes its change top-k sparse with its residual
// (sync/round/sparse_publication.h); every node rebuilds the published model and checks it bit
// for bit against the server's. Reports per round the bytes per node up and down (the
// payloads, and coded with zstd level 1 in 2 MiB chunks as the wire's chunk coding does),
// next to what fp32, bf16 and int8 move for the same tensors (the codecs' exact sizes), and
// the server's CPU seconds for decoding, averaging and publishing (one thread). Merge rounds
// (every --merge-interval rounds) change every expert on the server (simulated by a
// perturbation of 1e-4 standard deviation: the bytes do not depend on its size) and are
// reported apart. Changes are seeded Gaussian noise of standard deviation 1e-4, as in
// bench/sync_bench: top-k sizes barely depend on the values (k per chunk is fixed; only the
// Rice-coded gaps do). This is not the gRPC round of sync_bench: the rounds do not carry
// top-k deltas yet.
//   build/bench/topk_bench [--nodes 4] [--rounds 4] [--merge-interval 2] [--density 0.015625]
//                          [--bits 2] [--decay 1] and the shape's options (bench/sync_shape.h)
#include <fmt/format.h>
#include <torch/torch.h>

#include <algorithm>
#include <cstring>
#include <ctime>
#include <stdexcept>
#include <string>
#include <vector>

#include "spes/common/error.h"
#include "spes/io/config.h"
#include "spes/model/transformer.h"
#include "spes/sync/round/plan.h"
#include "spes/sync/round/sparse_publication.h"
#include "spes/sync/wire/chunk_coding.h"
#include "spes/sync/wire/delta_codec.h"
#include "spes/sync/wire/protocol.h"
#include "sync_shape.h"

namespace {

struct Args {
  int64_t nodes = 4, rounds = 4, merge_interval = 2;
  spes::bench::SyncShape shape;
  double density = 1.0 / 64, decay = 1.0;
  int64_t bits = 2;
};

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i], v = argv[i + 1];
    if (k == "--nodes") a.nodes = std::stoll(v);
    else if (k == "--rounds") a.rounds = std::stoll(v);
    else if (k == "--merge-interval") a.merge_interval = std::stoll(v);
    else if (k == "--density") a.density = std::stod(v);
    else if (k == "--bits") a.bits = std::stoll(v);
    else if (k == "--decay") a.decay = std::stod(v);
    else if (!a.shape.parse(k, v)) throw std::runtime_error("unknown option " + k);
  }
  return a;
}

spes::Config bench_config(const Args& a) {
  spes::Config c;
  a.shape.apply(c);
  c.spes_config.mode = "spes";
  c.spes_config.num_peers = a.nodes;
  return c;
}

double thread_cpu_s() {
  timespec ts;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

// Bytes of a stream of payloads as the wire codes it: 2 MiB chunks, each raw or zstd-1.
uint64_t coded_bytes(const std::string& stream) {
  uint64_t n = 0;
  std::string packed;
  for (size_t at = 0; at < stream.size(); at += spes::sync::kChunkBytes) {
    const std::string_view chunk(stream.data() + at,
                                 std::min<size_t>(spes::sync::kChunkBytes, stream.size() - at));
    n += spes::sync::pack_chunk(chunk, &packed) == spes::sync::ChunkEncoding::Zstd
             ? packed.size() : chunk.size();
  }
  return n;
}

// Payload bytes of `tensors` in codec c (none: fp32).
uint64_t codec_bytes(spes::Compression c, const spes::sync::RoundPlan& plan,
                     const std::vector<size_t>& tensors) {
  uint64_t n = 0;
  for (size_t i : tensors) {
    int64_t numel = 1;
    for (int64_t d : plan.tensors()[i].shape) numel *= d;
    n += spes::sync::delta_payload_bytes(c, numel);
  }
  return n;
}

}  // namespace

int main(int argc, char** argv) {
  using namespace spes;
  using namespace spes::sync;
  try {
    const Args a = parse(argc, argv);
    torch::set_num_threads(1);
    const Config cfg = bench_config(a);
    Transformer model(cfg.model);
    const RoundPlan plan(cfg, model);  // the shapes, owners and uploaders (compression none)
    const auto& ts = plan.tensors();
    const TopkParams p{a.density, static_cast<int>(a.bits)};
    std::vector<torch::Tensor> published;
    for (const auto& prm : model.params())
      published.push_back(prm.tensor.detach().to(torch::kFloat32).contiguous().clone());
    std::vector<std::vector<torch::Tensor>> held(a.nodes, published);  // each node's copy
    for (auto& h : held)
      for (auto& t : h) t = t.clone();
    std::vector<TopkFeedback> fb(a.nodes, TopkFeedback(p, a.decay));
    for (auto& f : fb) f.reset(ts.size());
    SparsePublisher server(p, ts.size());
    const int64_t P = model.num_params();
    fmt::print("topk_bench: {:.1f}M parameters, {} nodes, {} rounds, density {:.5f}, {} bits, "
               "decay {}, merging every {} rounds\n", P / 1e6, a.nodes, a.rounds, a.density,
               a.bits, a.decay, a.merge_interval);
    torch::manual_seed(0);
    for (int64_t r = 1; r <= a.rounds; ++r) {
      const bool merged = a.merge_interval > 0 && r % a.merge_interval == 0;
      // Nodes: encode this round's change (noise of 1e-4) of every trainable tensor.
      std::vector<std::vector<std::string>> up(a.nodes, std::vector<std::string>(ts.size()));
      std::vector<std::string> up_stream(a.nodes);
      for (int64_t k = 0; k < a.nodes; ++k)
        for (size_t i : plan.upload_of(k)) {
          const torch::Tensor change = torch::randn(published[i].sizes()) * 1e-4;
          up[k][i] = fb[k].encode(i, change, ts[i].name).payload;
          up_stream[k] += up[k][i];
        }
      // Server: decode, rebuild, average or copy, publish with the residual.
      const double c0 = thread_cpu_s();
      std::vector<std::string> down(ts.size());
      for (size_t i = 0; i < ts.size(); ++i) {
        if (ts[i].uploaders.empty()) continue;
        torch::Tensor sum = torch::zeros_like(published[i]);
        for (int64_t k : ts[i].uploaders) {
          const TopkSparse s = topk_decode_checked(up[k][i], published[i].numel(), p,
                                                   ts[i].name, "upload");
          sum += topk_rebuild_tensor(published[i], s);
        }
        torch::Tensor agg = sum / static_cast<double>(ts[i].uploaders.size());
        const bool owner_copy = ts[i].rule == Combine::OwnerCopy;
        if (owner_copy && !merged) {
          // The owner's rebuilt upload is the published value; D is its payload.
          agg = topk_rebuild_tensor(published[i], topk_decode_checked(
              up[ts[i].uploaders[0]][i], published[i].numel(), p, ts[i].name, "upload"));
          server.publish_exact(i);
          down[i] = up[ts[i].uploaders[0]][i];
        } else {
          if (owner_copy) agg += torch::randn(agg.sizes()) * 1e-4;  // merging moved it
          down[i] = server.publish(i, published[i], agg, ts[i].name);
        }
        published[i] = agg;
      }
      const double server_s = thread_cpu_s() - c0;
      // Nodes: what each downloads, rebuilt and checked bit for bit.
      uint64_t up_raw = 0, up_coded = 0, down_raw = 0, down_coded = 0;
      for (int64_t k = 0; k < a.nodes; ++k) {
        // Its own experts in a plain round: the node holds its rebuilt upload, which is the
        // published value (they are not downloaded).
        if (!merged)
          for (size_t i : plan.upload_of(k))
            if (ts[i].rule == Combine::OwnerCopy)
              held[k][i] = topk_rebuild_tensor(held[k][i], topk_decode_checked(
                  up[k][i], published[i].numel(), p, ts[i].name, "own upload"));
        std::string stream;
        for (size_t i : plan.download_for(k, merged)) {
          stream += down[i];
          const TopkSparse s = topk_decode_checked(down[i], published[i].numel(), p,
                                                   ts[i].name, "download");
          held[k][i] = topk_rebuild_tensor(held[k][i], s);
        }
        for (size_t i = 0; i < ts.size(); ++i)
          SPES_CHECK(std::memcmp(held[k][i].data_ptr(), published[i].data_ptr(),
                                 static_cast<size_t>(published[i].numel()) * 4) == 0,
                     "node {} does not hold the published '{}' after round {}", k, ts[i].name, r);
        up_raw += up_stream[k].size();
        up_coded += coded_bytes(up_stream[k]);
        down_raw += stream.size();
        down_coded += coded_bytes(stream);
      }
      // The same round in the other codecs (node 0's tensors; exact codec sizes).
      const auto up0 = plan.upload_of(0);
      const auto down0 = plan.download_for(0, merged);
      const double n = static_cast<double>(a.nodes);
      fmt::print("{{\"round\": {}, \"merge\": {}, \"topk_up_bytes\": {:.0f}, "
                 "\"topk_down_bytes\": {:.0f}, \"topk_up_coded\": {:.0f}, "
                 "\"topk_down_coded\": {:.0f}, \"fp32_up\": {}, \"fp32_down\": {}, "
                 "\"bf16_up\": {}, \"bf16_down\": {}, \"int8_up\": {}, \"int8_down\": {}, "
                 "\"server_cpu_s\": {:.3f}, \"server_residual_sq\": {:.4g}}}\n",
                 r, merged, up_raw / n, down_raw / n, up_coded / n, down_coded / n,
                 codec_bytes(Compression::None, plan, up0),
                 codec_bytes(Compression::None, plan, down0),
                 codec_bytes(Compression::Bf16, plan, up0),
                 codec_bytes(Compression::Bf16, plan, down0),
                 codec_bytes(Compression::Int8, plan, up0),
                 codec_bytes(Compression::Int8, plan, down0), server_s,
                 server.residual().held_sq());
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "topk_bench: %s\n", e.what());
    return 1;
  }
  return 0;
}
