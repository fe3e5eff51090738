// YAML read with its alias expansion bounded before it is loaded: an alias (*a) stands for the
// whole node its anchor (&a) names, so a few lines whose anchors each repeat the one before
// ten times (an "alias bomb") describe billions of nodes; walking or copying the loaded tree
// expanded them and grew the process to 5 GB. check_yaml_expansion streams the text's events
// once (yaml-cpp's parser, no tree is built), counting every node as it would be once every
// alias is expanded, and refuses text above `max_nodes` with an error naming the file and the
// limit. Every real config has a few hundred nodes.
#pragma once
#include <cstdint>
#include <string>

namespace spes {

constexpr int64_t kMaxYamlNodes = 1'000'000;

// Throws spes::Error when `text` (from `origin`) would expand to more than `max_nodes` nodes.
// Malformed YAML is left for the loader to report.
void check_yaml_expansion(const std::string& text, const std::string& origin,
                          int64_t max_nodes = kMaxYamlNodes);

}  // namespace spes
