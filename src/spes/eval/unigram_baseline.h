// The unigram baseline: the cross-entropy (nats/token) on the validation targets of a unigram
// model fit on the training windows (add-one smoothing). A language model that has learned
// anything beyond token frequencies must be far below it.
#pragma once
#include "spes/io/config.h"

namespace spes {

// Uses the same windows and target positions as training and validation.
double unigram_baseline_loss(const Config& cfg);

}  // namespace spes
