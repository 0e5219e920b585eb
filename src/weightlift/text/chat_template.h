// Chat messages as a checkpoint's chat template renders them, for the templates weightlift
// knows by name. A tokenizer_config.json's `chat_template` is recognised by a fingerprint of
// its text (the published templates of the tokenizers tests/text uses); weightlift does not
// interpret Jinja. What each renders, for the messages it accepts:
//
//   qwen3        ChatML: "<|im_start|>{role}\n{content}<|im_end|>\n" per message; an assistant
//                message after the last user message and last of all opens with an empty
//                "<think>\n\n</think>\n\n" block (its content's leading newlines dropped);
//                the generation prompt is "<|im_start|>assistant\n", followed by the empty
//                think block when thinking is switched off. Roles system, user and assistant.
//   llama3       bos, then "<|start_header_id|>{role}<|end_header_id|>\n\n{content, trimmed}
//                <|eot_id|>" per message, then always "<|start_header_id|>assistant
//                <|end_header_id|>\n\n" (Llama 3's template adds it whether asked or not).
//                Any role.
//   deepseek_v3  bos, the system messages' contents joined by "\n\n", then "<｜User｜>{content}"
//                and "<｜Assistant｜>{content}<｜end▁of▁sentence｜>" in order; "<｜Assistant｜>"
//                as the generation prompt. Roles system, user and assistant.
//
// Outside that subset (a template not recognised, tool calls or a tool role, Qwen3 reasoning
// in an assistant message, an unknown role where the template would drop it) is an
// InvalidArgument naming what: a prompt that renders differently from the checkpoint's own
// template would be worse than none. `named()` renders as a named template whatever the
// config holds (weightlift tokenize --chat-template NAME).
#pragma once

#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "weightlift/core/status.h"

namespace wl::text {

struct ChatMessage {
  std::string role, content;
};

struct ChatOptions {
  bool add_generation_prompt = true;
  bool enable_thinking = true;  // qwen3: false adds the empty think block to the prompt
};

class ChatTemplate {
 public:
  // From `tokenizer_config.json`'s chat_template and bos_token.
  static Result<ChatTemplate> from_config(const std::string& tokenizer_config_path);
  // "qwen3", "llama3" or "deepseek_v3", with the bos token to begin with ("" for none).
  static Result<ChatTemplate> named(std::string_view name, std::string bos_token);

  Result<std::string> render(std::span<const ChatMessage> messages,
                             const ChatOptions& options = {}) const;
  const std::string& name() const { return name_; }

  // The messages of a JSON array [{"role": ..., "content": ...}, ...]; `where` prefixes errors.
  static Result<std::vector<ChatMessage>> messages_from_json(std::string_view json,
                                                             std::string_view where);

 private:
  std::string name_, bos_;
};

}  // namespace wl::text
