// Supervised fine-tuning examples a user writes, as rows to train on with the loss on the
// completion only. JSONL, one example per line:
//
//   {"prompt": "What is 2+2?", "completion": "4"}
//   {"messages": [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content":
//   "4"}]}
//
// A prompt is encoded with the vocabulary's special tokens (codec.h), the completion without,
// then the end token. A chat's last message is the assistant's reply, its completion; the
// messages before it are rendered with the generation prompt by the tokenizer's chat template
// (text/chat_template.h) and encoded as they are. Each example is one row of `seq` tokens
// (inputs, and the next token as target where the next token is the completion's, -100
// elsewhere and in the padding). An example held out by the hash rule (documents.h) is
// validation only. A line that is not such an object, a chat not ending with the assistant,
// or an example longer than seq + 1 tokens is an error naming the file and the line.
#pragma once

#include <cstdint>
#include <string>

#include "weightlift/core/status.h"
#include "weightlift/text/chat_template.h"
#include "weightlift/train/codec.h"
#include "weightlift/train/data.h"

namespace wl::train {

struct SftExamples {
  Batch train, validation;  // [examples, seq] each
  int64_t examples = 0, held_out = 0;
};

// `chat` may be null (a chat line is then an error).
Result<SftExamples> load_sft(const std::string& path, const Codec& codec,
                             const text::ChatTemplate* chat, int64_t seq);

}  // namespace wl::train
