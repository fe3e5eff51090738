// The byte counts of a node's per-round sync record (the "sync" object of its metrics.jsonl
// lines, written by sync/node/node_round.cpp), as the readers of a run directory (report/,
// cluster/) count them: on the wire. A record has the stream sizes (bytes_up, bytes_down) and,
// since chunk coding (sync/wire/chunk_coding.h), the sizes as they crossed the wire
// (bytes_up_sent over every attempt, bytes_down_wire); records of older runs have only the
// stream sizes, which were then the wire sizes. The record belongs with the run directory's
// layout (io/run_layout.h), below every layer that writes or reads it.
#pragma once
#include <nlohmann/json.hpp>

namespace spes {

inline double sync_record_bytes_up(const nlohmann::json& sync) {
  return sync.value("bytes_up_sent", sync.value("bytes_up", 0.0));
}

inline double sync_record_bytes_down(const nlohmann::json& sync) {
  return sync.value("bytes_down_wire", sync.value("bytes_down", 0.0));
}

}  // namespace spes
