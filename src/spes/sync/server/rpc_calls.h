// The sync protocol's calls as messages, without gRPC: each function takes the request
// message(s) of one call (proto/spes_sync.proto) from a caller whose credentials were already
// checked (call_auth.h), makes the RoundState call the RPC maps onto and fills the reply
// message. server.cpp wraps them in the gRPC handlers (credentials, rate limits, stream slots,
// long-poll limits, status codes, logging); the round_rpc fuzz target (tests/fuzz) drives the
// same functions directly against a real model. Every function throws SyncError (or
// spes::Error) for a refusal. Leaves out: credentials, transport, limits.
#pragma once
#include <functional>

#include "spes/sync/server/round_state.h"
#include "spes/sync/wire/protocol.h"
#include "spes_sync.pb.h"

namespace spes::sync {
namespace pb = ::spes::sync::v1;

// The node a message speaks for: the node its call's credentials prove, with the incarnation
// the message names. A message naming another node is refused (PermissionDenied).
NodeId message_caller(const NodeId& credentials, const pb::NodeIdentity& body);

void call_join(RoundState& st, const NodeId& credentials, const pb::JoinRequest& req,
               pb::JoinReply* rep);
// An Upload stream: `read` gives the next chunk (false at the end of the stream; it may throw
// to end the stream). A first chunk with resume_query asks how much of the upload the server
// kept and carries no data.
void call_upload(RoundState& st, const NodeId& credentials,
                 const std::function<bool(pb::UploadChunk*)>& read, pb::UploadReply* rep);
// `give_up` ends the wait early (see RoundState::wait_round).
void call_wait_round(RoundState& st, const NodeId& credentials, const pb::WaitRoundRequest& req,
                     const std::function<bool()>& give_up, pb::RoundInfo* rep);
// A Download stream: `write` sends one chunk, and throws to end the stream (the node went
// away, or a newer stream of it took over).
void call_download(RoundState& st, const NodeId& credentials, const pb::DownloadRequest& req,
                   const std::function<void(const pb::DownloadChunk&)>& write);
// A HandOver stream (protocol 9): `read` as for call_upload; the whole stream is checked before
// anything is kept.
void call_hand_over(RoundState& st, const NodeId& credentials,
                    const std::function<bool(pb::MomentsChunk*)>& read, pb::HandOverReply* rep);
// A FetchMoments stream: the moments handed over for the experts the node gains in the
// request's epoch, one safetensors stream (format spes-moments-v1) in chunks.
void call_fetch_moments(RoundState& st, const NodeId& credentials,
                        const pb::FetchMomentsRequest& req,
                        const std::function<void(const pb::DownloadChunk&)>& write);
void call_leave(RoundState& st, const NodeId& credentials, const pb::LeaveRequest& req);
void call_heartbeat(RoundState& st, const NodeId& credentials, const pb::HeartbeatRequest& req,
                    pb::HeartbeatReply* rep);
// Status needs read access (CallAuth::check_read), not a node's credentials.
void call_status(const RoundState& st, pb::StatusReply* rep);

}  // namespace spes::sync
