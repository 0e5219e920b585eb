// Pretraining text a user gives, as token streams: a JSONL file ({"text": "..."} per line; other
// fields ignored) or a plain text file whose documents are separated by blank lines. Each
// document is encoded (codec.h: with the begin token the vocabulary adds, if any) and ended by
// the end token, and the documents are packed one after another into one stream, which
// WindowSampler cuts into windows that may span documents (as GPT-style pretraining does).
//
// A document is held out for validation when a hash of its text falls in the lowest 1/8
// (rl/tasks.h's rule): the same documents in every run, never trained on. A JSONL line that is
// not an object with a string "text" is an error naming the file and the line.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "weightlift/core/status.h"
#include "weightlift/train/codec.h"

namespace wl::train {

struct DocumentStreams {
  std::vector<int64_t> train, validation;
  int64_t documents = 0, held_out = 0;
};

Result<DocumentStreams> load_documents(const std::string& path, const Codec& codec);

}  // namespace wl::train
