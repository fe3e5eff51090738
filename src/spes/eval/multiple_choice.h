// Multiple-choice evaluation in the OLMo "requests.jsonl.gz" format (ARC, PIQA, COPA,
// OpenBookQA, ...): every request is (context, continuation) for one choice of one document;
// a choice's score is the log-likelihood of its continuation tokens given the context.
// Reports accuracy (highest raw log-likelihood) and length-normalised accuracy (log-likelihood
// per character of the continuation, OLMo's acc_per_char).
#pragma once
#include <string>
#include <vector>

#include "spes/data/tokenizer.h"
#include "spes/model/transformer.h"

namespace spes {

struct ChoiceRequest {
  std::string context, continuation;
};

struct McDocument {
  int64_t doc_id = 0;
  int64_t gold = 0;
  std::vector<ChoiceRequest> choices;  // indexed by choice number
};

struct McResult {
  std::string task;
  int64_t documents = 0;
  double acc = 0;           // raw log-likelihood
  double acc_per_char = 0;  // log-likelihood / characters of the continuation
  double acc_per_token = 0; // log-likelihood / tokens of the continuation
};

// Reads a requests.jsonl(.gz) file; documents in doc_id order.
std::vector<McDocument> mc_read_requests(const std::string& path);

// Sum of log p(continuation | context) for each choice, one batched forward per document.
std::vector<double> mc_choice_logprobs(const Transformer& model, const Tokenizer& tok,
                                       const McDocument& doc, std::vector<int64_t>* n_tokens);

// Scores the first `limit` documents (0: all).
McResult mc_evaluate(const Transformer& model, const Tokenizer& tok, const std::string& task,
                     const std::vector<McDocument>& docs, int64_t limit);

}  // namespace spes
