// Departed nodes, their measured rates and declared capacities (see departures.h).
#include "spes/sync/server/departures.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <cmath>

#include <fmt/format.h>

namespace spes::sync {

Departures::Departures(size_t num_nodes, int64_t reassign_after_rounds)
    : limit_(reassign_after_rounds), nodes_(num_nodes), opened_at_(Clock::now()) {}

void Departures::joined(int64_t node, int64_t capacity, int64_t memory_experts) {
  Node& n = nodes_.at(static_cast<size_t>(node));
  n.capacity = capacity;
  n.memory_experts = memory_experts;
  n.misses = 0;
  n.finished = false;
  n.left_for_good = false;
  if (departed_.erase(node)) {
    returned_.insert(node);
    spdlog::info("node {} joined again after it was declared departed: it is live again and "
                 "trains what the current ownership map gives it (an arrival when that is "
                 "nothing)", node);
  }
}

void Departures::left(int64_t node, bool departing, int64_t round) {
  Node& n = nodes_.at(static_cast<size_t>(node));
  if (!departing) {
    n.finished = true;  // the run ended for it: no handoff
    return;
  }
  n.left_for_good = true;
  if (departed_.count(node)) return;
  departed_[node] = fmt::format("node {} left for good (departing) during round {}", node, round);
  spdlog::warn("{}: its experts go to live nodes at the next round boundary", departed_[node]);
}

void Departures::upload_arrived(int64_t node, Clock::time_point at) {
  Node& n = nodes_.at(static_cast<size_t>(node));
  n.arrived = true;
  n.arrived_at = at;
}

std::vector<int64_t> Departures::round_published(int64_t round, const std::vector<int64_t>& nodes,
                                                 const std::vector<int64_t>& tokens,
                                                 Clock::time_point at,
                                                 const std::vector<bool>& takes_part) {
  std::vector<int64_t> declared;
  for (size_t i = 0; i < nodes_.size(); ++i) {
    Node& n = nodes_[i];
    const auto it = std::find(nodes.begin(), nodes.end(), static_cast<int64_t>(i));
    if (it != nodes.end()) {
      n.misses = 0;
      // Its upload made the round: it is live again (it trains what the current map gives it),
      // unless it left for good after sending it.
      if (!n.left_for_good && departed_.erase(static_cast<int64_t>(i)))
        spdlog::info("node {} was declared departed but its round {} upload was used: it is "
                     "live again", i, round);
      if (n.arrived) {
        const double s = std::chrono::duration<double>(n.arrived_at - opened_at_).count();
        n.recent.emplace_back(static_cast<double>(tokens[static_cast<size_t>(it - nodes.begin())]),
                              std::max(s, 1e-3));
        while (n.recent.size() > kRateRounds) n.recent.pop_front();
      }
    } else if (!n.finished && takes_part.at(i)) {
      ++n.misses;
      const int64_t node = static_cast<int64_t>(i);
      if (limit_ > 0 && n.misses >= limit_ && !departed_.count(node)) {
        departed_[node] = fmt::format("node {} missed {} consecutive rounds (to round {}; "
                                      "spes_config.reassign_after_rounds={})", node, n.misses,
                                      round, limit_);
        spdlog::warn("{}: declared departed, its experts go to live nodes", departed_[node]);
        declared.push_back(node);
      }
    }
    n.arrived = false;
  }
  opened_at_ = at;
  return declared;
}

double Departures::rate(int64_t node) const {
  const Node& n = nodes_.at(static_cast<size_t>(node));
  double tok = 0, sec = 0;
  for (const auto& [t, s] : n.recent) {
    tok += t;
    sec += s;
  }
  return sec > 0 ? tok / sec : NAN;
}

std::vector<LiveNode> Departures::live_nodes(const std::vector<int64_t>& live) const {
  std::vector<LiveNode> out;
  for (int64_t node : live)
    out.push_back({node, rate(node), nodes_.at(static_cast<size_t>(node)).capacity,
                   nodes_.at(static_cast<size_t>(node)).memory_experts});
  return out;
}

nlohmann::json Departures::to_json() const {
  nlohmann::json nodes = nlohmann::json::array();
  for (const Node& n : nodes_) {
    nlohmann::json recent = nlohmann::json::array();
    for (const auto& [t, s] : n.recent) recent.push_back({t, s});
    nodes.push_back({{"misses", n.misses}, {"finished", n.finished},
                     {"left_for_good", n.left_for_good}, {"recent", recent}});
  }
  nlohmann::json departed = nlohmann::json::object();
  for (const auto& [node, why] : departed_) departed[std::to_string(node)] = why;
  return {{"nodes", nodes}, {"departed", departed}, {"returned", returned_}};
}

bool Departures::restore(const nlohmann::json& j) {
  try {
    if (!j.is_object() || j.at("nodes").size() != nodes_.size()) return false;
    std::vector<Node> nodes(nodes_.size());
    for (size_t i = 0; i < nodes.size(); ++i) {
      const auto& n = j.at("nodes")[i];
      nodes[i].misses = n.at("misses").get<int64_t>();
      nodes[i].finished = n.at("finished").get<bool>();
      nodes[i].left_for_good = n.value("left_for_good", false);  // absent: an older server's
      for (const auto& r : n.at("recent"))
        nodes[i].recent.emplace_back(r.at(0).get<double>(), r.at(1).get<double>());
    }
    std::map<int64_t, std::string> departed;
    for (const auto& [k, v] : j.at("departed").items()) {
      const int64_t node = std::stoll(k);
      if (node < 0 || node >= static_cast<int64_t>(nodes.size())) return false;
      departed[node] = v.get<std::string>();
    }
    std::set<int64_t> returned;  // absent in the state of an older server
    if (j.contains("returned")) returned = j.at("returned").get<std::set<int64_t>>();
    nodes_ = std::move(nodes);
    departed_ = std::move(departed);
    returned_ = std::move(returned);
    return true;
  } catch (const std::exception&) {
    return false;
  }
}

}  // namespace spes::sync
