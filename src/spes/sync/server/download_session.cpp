// Download streams of a published round (see download_session.h).
#include "spes/sync/server/download_session.h"

#include <algorithm>

namespace spes::sync {

std::unique_ptr<SafetensorsStreamWriter> download_writer(const RoundPlan& plan,
                                                         const PublishedRound& published,
                                                         const std::string& path, int64_t node,
                                                         int64_t round, Selection selection,
                                                         const DeltaSource& delta) {
  const bool used = std::find(published.nodes.begin(), published.nodes.end(), node) !=
                    published.nodes.end();
  if (selection == Selection::ForNode && round > 0 && plan.compression() != Compression::None) {
    const DeltaRecord* r = delta.record;
    // The file must still hold that delta: a later round's replaces it before that round is
    // persisted, and a round whose save failed leaves it there (round_state.h).
    if (r && r->valid() && r->round == round && delta.from_round >= 0 &&
        delta.from_round == r->from_round && delta_file_holds(delta.path, *r))
      return std::make_unique<SafetensorsStreamWriter>(SafetensorsStreamWriter::from_file_as_stored(
          delta.path, delta_download_names(plan, *r, node, used),
          Metadata{{"format", "spes-download-delta-v1"},
                   {"round", std::to_string(round)},
                   {"from_round", std::to_string(r->from_round)},
                   {"step", std::to_string(published.step)},
                   {"model_sha256", published.sha256},
                   {"compression", compression_name(plan.compression())}}));
    // No delta from what the node holds: the whole model (its own experts included, whose
    // published value need not be its rebuilt upload).
    selection = Selection::All;
  }
  std::vector<size_t> idx;
  if (selection == Selection::All || round == 0) {
    for (size_t i = 0; i < plan.tensors().size(); ++i) idx.push_back(i);
  } else {
    // A node whose upload the round did not use gets its own experts back too.
    idx = plan.download_for(node, published.merged || !used);
  }
  std::vector<std::string> names;
  for (size_t i : idx) names.push_back(plan.tensors()[i].name);
  // Served from the persisted file, not from memory: the bytes of this round stay valid
  // whatever is published next, and cost no memory beyond one chunk.
  return std::make_unique<SafetensorsStreamWriter>(SafetensorsStreamWriter::from_file(
      path, names, wire_scalar_type(plan.wire()),
      Metadata{{"format", "spes-download-v1"},
               {"round", std::to_string(round)},
               {"step", std::to_string(published.step)},
               {"model_sha256", published.sha256},
               {"selection", selection == Selection::All ? "all" : "for_node"}}));
}

DownloadSession::DownloadSession(std::unique_ptr<SafetensorsStreamWriter> writer, int64_t round,
                                 uint64_t offset,
                                 std::function<void(uint64_t, uint64_t)> on_complete)
    : writer_(std::move(writer)), round_(round), offset_(offset), start_(offset),
      on_complete_(std::move(on_complete)) {}

DownloadSession::~DownloadSession() = default;

uint64_t DownloadSession::total_bytes() const { return writer_->total_bytes(); }

bool DownloadSession::next(std::string* data, uint64_t* offset) {
  if (offset_ >= writer_->total_bytes()) {
    if (!reported_) {
      reported_ = true;
      if (on_complete_) on_complete_(writer_->total_bytes() - start_, wire_);
    }
    return false;
  }
  data->clear();
  // The writer reads the persisted file through a descriptor opened when the download began:
  // a later publication (a rename over the file) does not change these bytes.
  writer_->read(offset_, kChunkBytes, data);
  *offset = offset_;
  offset_ += data->size();
  return true;
}

}  // namespace spes::sync
