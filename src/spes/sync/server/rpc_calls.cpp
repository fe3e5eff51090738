// The sync protocol's calls as messages, mapped onto RoundState (see rpc_calls.h).
#include "spes/sync/server/rpc_calls.h"

#include "spes/sync/round/moments_handoff.h"

#include <algorithm>
#include <cmath>
#include <memory>
#include <string>

#include "spes/sync/wire/checksum.h"
#include "spes/sync/wire/chunk_coding.h"
#include "spes/sync/wire/framing.h"
#include "spes/sync/wire/ownership_message.h"

namespace spes::sync {

NodeId message_caller(const NodeId& credentials, const pb::NodeIdentity& body) {
  if (body.node_id() != credentials.node_id)
    sync_fail(SyncErrc::PermissionDenied, "the message names node {} but the call's "
              "credentials are node {}'s", body.node_id(), credentials.node_id);
  NodeId n = credentials;
  n.incarnation = body.incarnation();
  return n;
}

void call_join(RoundState& st, const NodeId& credentials, const pb::JoinRequest& req,
               pb::JoinReply* rep) {
  JoinInfo j;
  j.node = message_caller(credentials, req.node());
  j.protocol_version = req.protocol_version();
  j.settings.insert(req.settings().begin(), req.settings().end());
  j.step = req.step();
  j.ownership_epoch = req.ownership_epoch();
  j.ownership_fingerprint = req.held_ownership_fingerprint();
  j.expert_capacity = req.expert_capacity();
  j.memory_capacity_gib = req.memory_capacity_gib();
  j.precision = req.precision();
  const JoinResult r = st.join(j);
  rep->set_server_incarnation(r.server_incarnation);
  rep->set_published_round(r.published_round);
  rep->set_published_step(r.published_step);
  rep->set_model_sha256(r.model_sha256);
  rep->set_max_chunk_bytes(r.max_chunk_bytes);
  rep->set_heartbeat_interval_ms(r.heartbeat_interval_ms);
  for (int64_t n : r.published_nodes) rep->add_published_nodes(n);
  ownership_to_message(r.ownership, rep->mutable_ownership());
}

void call_upload(RoundState& st, const NodeId& credentials,
                 const std::function<bool(pb::UploadChunk*)>& read, pb::UploadReply* rep) {
  pb::UploadChunk c;
  if (!read(&c)) sync_fail(SyncErrc::InvalidArgument, "empty upload stream");
  const NodeId node = message_caller(credentials, c.node());
  const int64_t round = c.round(), step = c.step();
  const uint64_t total = c.total_bytes();
  if (c.resume_query()) {
    // "How much of this upload do you hold?": answered at once, no data in this stream.
    rep->set_resume_offset(st.upload_resume_offset(node, round, step, total));
    return;
  }
  std::unique_ptr<UploadSession> s = st.begin_upload(node, round, step, total, c.offset());
  std::string whole_checksum;
  do {
    if (c.node().node_id() != node.node_id || c.round() != round || c.total_bytes() != total ||
        c.resume_query())
      sync_fail(SyncErrc::InvalidArgument, "upload chunks disagree on node, round or size");
    if (!c.upload_checksum().empty()) whole_checksum = c.upload_checksum();
    s->chunk(c.offset(), c.data(), c.checksum(), c.encoding());
  } while (read(&c));
  const UploadResult r = s->finish(whole_checksum);
  rep->set_accepted(r.accepted);
  rep->set_bytes_received(r.bytes);
  rep->set_upload_checksum(r.checksum);
  rep->set_duplicate(r.duplicate);
}

void call_wait_round(RoundState& st, const NodeId& credentials, const pb::WaitRoundRequest& req,
                     const std::function<bool()>& give_up, pb::RoundInfo* rep) {
  const RoundStatus r = st.wait_round(message_caller(credentials, req.node()), req.round(),
                                      req.max_wait_ms(), give_up);
  rep->set_round(r.round);
  rep->set_published(r.published);
  rep->set_step(r.step);
  rep->set_model_sha256(r.model_sha256);
  rep->set_alpha(r.alpha);
  rep->set_download_bytes(r.download_bytes);
  for (int64_t n : r.waiting_for) rep->add_waiting_for(n);
  rep->set_published_round(r.published_round);
  rep->set_published_step(r.published_step);
  for (int64_t n : r.nodes) rep->add_nodes(n);
  ownership_to_message(r.ownership, rep->mutable_ownership());
}

void call_download(RoundState& st, const NodeId& credentials, const pb::DownloadRequest& req,
                   const std::function<void(const pb::DownloadChunk&)>& write) {
  const Selection sel =
      req.selection() == pb::SELECTION_ALL ? Selection::All : Selection::ForNode;
  std::unique_ptr<DownloadSession> s =
      st.begin_download(message_caller(credentials, req.node()), req.round(), sel, req.offset(),
                        req.has_from_round() ? req.from_round() : -1);
  pb::DownloadChunk c;
  std::string data, packed;
  uint64_t offset = 0;
  while (s->next(&data, &offset)) {
    c.set_round(s->round());
    c.set_offset(offset);
    c.set_total_bytes(s->total_bytes());
    c.set_checksum(chunk_checksum(data));
    // Coded only for a node that asked, and only where that makes the chunk smaller.
    const ChunkEncoding enc = req.accept_zstd() ? pack_chunk(data, &packed) : ChunkEncoding::Raw;
    c.set_encoding(static_cast<uint32_t>(enc));
    std::string& bytes = enc == ChunkEncoding::Raw ? data : packed;
    s->sent_on_wire(bytes.size());
    c.set_data(std::move(bytes));
    write(c);
    bytes = std::move(*c.mutable_data());  // reuses the buffer
  }
}

void call_hand_over(RoundState& st, const NodeId& credentials,
                    const std::function<bool(pb::MomentsChunk*)>& read, pb::HandOverReply* rep) {
  pb::MomentsChunk c;
  if (!read(&c)) sync_fail(SyncErrc::InvalidArgument, "empty moments handover stream");
  const NodeId node = message_caller(credentials, c.node());
  const uint64_t total = c.total_bytes();
  std::unique_ptr<MomentsIntake> in = st.begin_hand_over(node, total);
  std::string whole_checksum;
  do {
    if (c.node().node_id() != node.node_id || c.total_bytes() != total)
      sync_fail(SyncErrc::InvalidArgument, "moments handover chunks disagree on node or size");
    if (!c.stream_checksum().empty()) whole_checksum = c.stream_checksum();
    in->chunk(c.offset(), c.data(), c.checksum());
  } while (read(&c));
  in->finish(whole_checksum);
  const auto [experts, epoch] = st.finish_hand_over(node, *in);
  rep->set_experts(experts);
  rep->set_ownership_epoch(epoch);
  rep->set_bytes_received(total);
}

void call_fetch_moments(RoundState& st, const NodeId& credentials,
                        const pb::FetchMomentsRequest& req,
                        const std::function<void(const pb::DownloadChunk&)>& write) {
  const NodeId node = message_caller(credentials, req.node());
  const SafetensorsStreamWriter stream = SafetensorsStreamWriter::as_stored(
      st.handed_moments(node, req.ownership_epoch()),
      {{"format", kMomentsFormat}, {"ownership_epoch", std::to_string(req.ownership_epoch())}});
  pb::DownloadChunk c;
  std::string data;
  for (uint64_t off = 0; off < stream.total_bytes(); off += kChunkBytes) {
    data.clear();
    stream.read(off, kChunkBytes, &data);
    c.set_offset(off);
    c.set_total_bytes(stream.total_bytes());
    c.set_checksum(chunk_checksum(data));
    c.set_data(data);
    write(c);
  }
}

void call_leave(RoundState& st, const NodeId& credentials, const pb::LeaveRequest& req) {
  st.leave(message_caller(credentials, req.node()), req.step(), req.reason(),
           req.kind() == pb::LEAVE_DEPARTING ? LeaveKind::Departing : LeaveKind::Finished);
}

void call_heartbeat(RoundState& st, const NodeId& credentials, const pb::HeartbeatRequest& req,
                    pb::HeartbeatReply* rep) {
  NodeMetrics m;
  if (req.has_loss()) m.loss = req.loss();
  if (req.has_tokens_per_s()) m.tokens_per_s = req.tokens_per_s();
  const size_t n = std::min<size_t>(req.losses_size(), kMaxHeartbeatLosses);
  for (size_t i = 0; i < n; ++i)
    m.losses.push_back({req.losses(static_cast<int>(i)).step(),
                        req.losses(static_cast<int>(i)).loss()});
  rep->set_published_round(st.heartbeat(message_caller(credentials, req.node()), req.step(), m));
}

void call_status(const RoundState& st, pb::StatusReply* rep) {
  const ServerStatus s = st.status();
  rep->set_published_round(s.published_round);
  rep->set_published_step(s.published_step);
  rep->set_model_sha256(s.model_sha256);
  rep->set_collecting_round(s.collecting_round);
  rep->set_round_open_s(s.round_open_s);
  rep->set_protocol_version(s.protocol_version);
  rep->set_publish_error(s.publish_error);
  rep->set_ownership_epoch(s.ownership_epoch);
  for (int64_t n : s.departed) rep->add_departed(n);
  for (const std::string& e : s.frozen_experts) rep->add_frozen_experts(e);
  for (const auto& n : s.nodes) {
    pb::NodeStatus* p = rep->add_nodes();
    p->set_node_id(n.node_id);
    p->set_state(n.state);
    p->set_step(n.step);
    p->set_last_seen_s(n.last_seen_s);
    p->set_detail(n.detail);
    if (std::isfinite(n.loss)) p->set_loss(n.loss);
    if (std::isfinite(n.tokens_per_s)) p->set_tokens_per_s(n.tokens_per_s);
  }
}

}  // namespace spes::sync
