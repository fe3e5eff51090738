// Where a run's tokenizer lives: data.tokenizer, else the file named by the first prepared data
// directory's manifest.json.
#pragma once
#include <string>

#include "spes/io/config.h"

namespace spes {

// "" when no tokenizer can be found.
std::string resolve_tokenizer_path(const DataConfig& data);

}  // namespace spes
