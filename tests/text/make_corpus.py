#!/usr/bin/env python3
"""Writes the mixed corpus check_tokenizers.py tokenizes: bytes, one test case per "\\n"-ended line.

Usage: make_corpus.py OUT_FILE BROWN_DIR

Deterministic (fixed choices and a fixed random seed) for a given checkout. Four sections:
  english       1500 lines of the Brown corpus (BROWN_DIR, from scripts/setup.sh) with its
                part-of-speech tags stripped, blank lines and leading tabs kept;
  multilingual  tests/text/data/multilingual.txt: Japanese, Chinese and Russian prose, lines
                copied from the project's seed documents (checked in: CI has no seeds);
  code          300 lines of the project's own C++ and Python sources, from this checkout
                (the middle of files spread evenly over src/, python/ and tests/);
  adversarial   what tokenizers get wrong: combining marks and normalization, emoji sequences,
                scripts without spaces, right-to-left text and bidi controls, every Unicode
                whitespace, contractions in all cases, digit runs, punctuation runs, the
                models' special-token strings inside text, "▁", private-use characters and
                noncharacters, invalid UTF-8, and lines of 5 to 20 kB. Each fragment is a line
                of its own, then random mixes of them.

No line holds a NUL byte. Every character is one Unicode 14 (Python 3.11) already assigns, or
a noncharacter, a private-use character or U+FFFD from invalid bytes: what the reference does
then does not depend on the Unicode version of the node that runs it.
"""
import glob
import itertools
import os
import random
import re
import sys
import unicodedata

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))

BROWN_LINES = 1500
CODE_FILES = {"C++": 6, "Python": 4}  # times CODE_LINES_PER_FILE: 300 lines
CODE_LINES_PER_FILE = 30
MIXED_LINES = 500
SEED = 20240117

# --- adversarial fragments by category: str is written as UTF-8, bytes as they are ---

# Visible text is written as it is; marks, controls and invisible characters as escapes.
COMBINING = [
    "e\u0301", "cafe\u0301 café", "été / e\u0301te\u0301",  # NFC / NFD pairs
    "a\u0301\u0302\u0303\u0304\u0306\u0307\u0308\u030a",  # stacked marks
    "s\u0323\u0307 s\u0307\u0323 \u1e69",  # canonical reordering, then composition
    "q\u0301 x\u0308\u0327",  # no precomposed form
    "\u0301 a mark opening the line",
    "Z\u0351\u036b\u0343\u036a\u0302\u036b\u033d\u034f\u0334\u0319\u0324\u031e\u0349\u035a"
    "\u032f\u031eA\u0310\u0344L\u0357\u0310G\u0351\u0364O",
    "\u212b \u00c5 A\u030a \u2126 \u03a9",  # singleton decompositions
    "\u0958 \u0915\u093c \ufb01 \u0344",  # composition exclusions, a ligature NFC keeps
    "Tiếng Việt / Tie\u0302\u0301ng Vie\u0323\u0302t",
    "한국어 / \u1112\u1161\u11ab\u1100\u116e\u11a8\u110b\u1165",  # syllables, then jamo
    "\u1100\u1161 \u1100\u1161\u11a8 ㄱㅏ \u1161\u11a8",  # conjoining and compatibility jamo
    "ภาษาไทยเป็นภาษาที่ไม่มีช่องว่าง",
    "हिन्दी देवनागरी", "Ελληνικά Ἀθῆναι σοφίας", "Straße STRASSE ẞ İstanbul ı",
]

EMOJI = [
    "👨\u200d👩\u200d👧\u200d👦 family", "👩🏽\u200d💻🧑🏿\u200d🔬",  # ZWJ sequences
    "🏳\ufe0f\u200d🌈 🏴\u200d☠\ufe0f",
    "🇯🇵🇺🇸🇫🇷🇦",  # flags, then a lone regional indicator
    "🏴\U000e0067\U000e0062\U000e0073\U000e0063\U000e0074\U000e007f",  # tag sequence
    "👍🏻👍🏼👍🏽👍🏾👍🏿 🏻",  # skin tones, then a lone modifier
    "1\ufe0f\u20e3 #\ufe0f\u20e3 ☺\ufe0e☺\ufe0f ❤\ufe0f", "I ❤\ufe0f unicode😀😂🤣!",
]

CJK = [
    "日本語のテキストと漢字かな交じり文。", "中文文本测试，没有空格。", "第123章abc漢字456。",
    "龥\u9fa6一々ーぁゟ゠ヿ",  # the edges of deepseek_v3's CJK class
    "\U00020000\U00020001\U0002a6a5\U0002b740",  # beyond the BMP
    "ｶﾀｶﾅ ＡＢＣａｂｃ", "「引用」、。・【括弧】", "안녕하세요 세계", "漢字\u3000全角スペース",
]

RTL = [
    "שלום עולם", "\u05e9\u05b8\u05c1\u05dc\u05d5\u05b9\u05dd",  # Hebrew, with niqqud
    "مرحبا بالعالم",
    "\u0645\u064e\u0631\u0652\u062d\u064e\u0628\u064b\u0627 "  # Arabic with harakat
    "\u0627\u0644\u0652\u0639\u064e\u0627\u0644\u064e\u0645\u064f",
    "كـــتاب", "می\u200cخواهم",  # tatweel; ZWNJ
    "abc \u202eedcba\u202c def \u202dLTR\u202c",  # bidi embedding and override
    "\u2067שלום\u2069 world \u2066ltr\u2069 \u2068first\u2069",  # bidi isolates
    "\u200fRLM\u200e LRM \u061cALM \u202aLRE\u202c \u202bRLE\u202c",
]

WHITESPACE = [
    "a    b", "a\tb\t\tc", " \t \t mixed", "a\u00a0b \u00a0\u00a0 c", "\u3000\u3000ideographic",
    "line\u2028separator para\u2029graph", "next\u0085line \u0085", "vertical\x0btab",
    "form\x0cfeed", "\ufeffBOM at start", "BOM\ufeffinside", "BOM at end\ufeff", "\ufeff\ufeff",
    "\u2000\u2001\u2002\u2003\u2004\u2005\u2006\u2007\u2008\u2009\u200a spaces",
    "\u1680ogham \u202fnarrow \u205fmath \u180emongolian \u200bzero width \u2060joiner",
    "trailing   ", "trailing tab\t", "trailing ideographic\u3000", "trailing nbsp\u00a0",
    "   ", "\t", " \t ", "\u3000\u3000", "\u00a0", " ", "\u2028", "\u0085",
    "CRLF line\r", "\r", " \r", "\r\r", "carriage\rreturn", "  leading spaces", "\tleading tab",
    "spaces before CR  \r", "\u00a0 \u00a0 x",
    # JavaScript's \s holds U+FEFF but not U+0085, unlike Unicode's White_Space.
    "a \ufeffb a\ufeff\ufeffb", "a \u0085b x\u0085\u0085y x \u0085\r",
]


def _all_cases(suffix):
    return ["".join(c) for c in itertools.product(*[(ch.lower(), ch.upper()) for ch in suffix])]


CONTRACTIONS = [
    " ".join(["it'" + s for s in _all_cases("s")] + ["x'" + s for s in _all_cases("t")]),
    " ".join("we'" + s for s in _all_cases("re") + _all_cases("ve")),
    " ".join("I'" + s for s in _all_cases("m") + _all_cases("d") + _all_cases("ll")),
    "don't DON'T Don'T won't can't it's IT'S He'LL they'Ve we'RE I'M you'D",
    "'s 'S 'LL 'Ve 're 'd' 'm'",  # at the start, alone
    "it’s IT’S we’ll ‘quoted’ don’t",  # curly apostrophes
    "donʼt ʼs x′s",  # modifier letter apostrophe, prime
    "''s '''ll x's's O'Neil rock'n'roll '90s 'tis",
    "'\u017f '\u212a 's\u0301",  # long s and Kelvin sign (case-fold to s and k), a mark
]

DIGITS = [
    " ".join(("9876543210" * 4)[:n] for n in range(1, 31)),  # runs of 1 to 30 digits
    "0 00 000 0000 00000 000000 0000000 00000000 000000000",
    "3.14159265358979 1,000,000 1e-9 0x1F2E 1_000 -42 +7 12:34:56 2024-01-15",
    "abc123def 123abc v1.2.3 x86_64 COVID19 4K60fps",
    " ".join("٠١٢٣٤٥٦٧٨٩"[:n] for n in range(1, 11)),  # Arabic-Indic
    " ".join("０１２３４５６７８９"[:n] for n in range(1, 11)) + " １２３円",  # full-width
    "۱۲۳۴ ०१२३",  # Extended Arabic-Indic, Devanagari
    "²³¹ ½¼⅓ ⅠⅡⅫ ①②③ \U0001d7d9\U0001d7da\U0001d7db",  # other numbers
    "+1 (555) 123-4567 €1.234,56 $1,234.56 100% 3×4=12",
]

PUNCTUATION = [
    "!!! ??? ?!?! ... …… --- === ===> <<<>>> ((())) {[()]} ;;; ~~~~",
    "@#$%^&*()_+-=[]{}|;:'\",.<>/?`~ \\\\ //",
    "```python\r", "/* comment */ // comment # comment <!-- html -->", "#!/usr/bin/env python3",
    "¡¿ «» —–- •· §¶ ©®™ €£¥₹", "∀∂∈∑√∞≈≠≤≥ ←↑→↓ ┌──┐",
    "**bold** __under__ | a | b | [link](http://x.y/z?q=1&r=2#f)",
    "\"\"\" ''' `` '' “double” „low“ 『quote』",
]

SPECIAL_TOKENS = [
    "<|im_start|>user hello<|im_end|>", "<|im_start|><|im_end|><|endoftext|>",
    "<|endoftext|>", "text<|endoftext|>text", "<|im_end|>\u0301 e<|im_end|>\u0301",
    " <|im_end|> ", "<think> reasoning </think>", "<|vision_pad|>x",
    "<tool_call>{}</tool_call> <|fim_prefix|>a<|fim_suffix|>b<|fim_middle|>",
    "<|begin_of_text|><|start_header_id|>user<|end_header_id|> hi<|eot_id|><|end_of_text|>",
    "<|reserved_special_token_0|><|reserved_special_token_250|>",
    "<s>", "</s>", "<unk>", "<s> hello </s>", "x<s>y</s>z", "<s><s></s></s>", "  <s>  ",
    "<｜begin▁of▁sentence｜>Hello<｜end▁of▁sentence｜>",
    "<｜User｜>hi<｜Assistant｜> <｜▁pad▁｜> <|EOT|>",
    "<｜place▁holder▁no▁1｜><｜place▁holder▁no▁12｜>",  # the longest match wins
    "<|im_sta", "<|im_start", "im_start|>", "<|IM_START|>", "<<|im_end|>>", "<|im_start|",
    "< s>", "<s >", "<S>", "<｜begin▁of▁sen", "<|begin_of_text", "<|endoftext|",
]

METASPACE = [
    "▁", "▁▁▁", "hello▁world", "▁leading", "trailing▁", " ▁ ", "_▁_", "▁ ▁x",
]

UNUSUAL = [
    "\ue000\uf8ff \U000f0000\U0010fffd",  # private use
    "\ufdd0\ufdef \ufffe\uffff \U0001fffe\U0001ffff \U0010fffe\U0010ffff",  # noncharacters
    "\ufffd literal replacement \ufffc",
    "\x01\x02\x07 bell \x1b[31mred\x1b[0m \x7f del",
    "\u0080\u0081\u009f C1 \u00ad soft\u00adhyphen \u034fcgj",
    "𝐀𝐁𝐂 𝒜𝓑 𐌰𐌱 𒀀 𓀀", "⠓⠑⠇⠇⠕ ქართული հայերեն", "ሀለም བོད ខ្មែរ ᎠᎡᎢ",
]

INVALID_UTF8 = [
    b"\x80", b"\xbf", b"\x80\x80\x80 lone continuation bytes", b"caf\xe9 latin-1",
    b"truncated \xc3", b"\xc3 truncated two", b"\xe6\x97 truncated three", b"\xe6\x97",
    b"\xf0\x9f\x98 truncated four", b"\xf0\x9f", b"\xf0\x9f\x98",
    b"\xc0\xaf \xc1\xbf \xe0\x80\xaf \xf0\x80\x80\xaf \xc0\x80 overlong",
    b"\xed\xa0\x80 \xed\xbf\xbf \xed\xa0\xbd\xed\xb8\x80 surrogates",
    b"\xff \xfe \xf8\x88\x80\x80\x80 \xfc\x84\x80\x80\x80\x80 \xf4\x90\x80\x80 \xf5\x80\x80\x80",
    b"abc\xffdef\xfeghi", b"\xe6\x97\xa5\x80\xe6\x9c\xac", b"\xe2\x82\xe2\x82\xac",
    b"\xef\xbb\xbf\xef\xbb", b"\xe0\xa0 \xf4\x8f\xbf \xf1\x80\x80",
    b"it\xe2\x80s \xe2\x80\x99s", b"<|im_\xffstart|> <s\x80>", b"\xff\xff\xff\xff\xff\xff",
]

CATEGORIES = {
    "combining": COMBINING, "emoji": EMOJI, "cjk": CJK, "rtl": RTL, "whitespace": WHITESPACE,
    "contractions": CONTRACTIONS, "digits": DIGITS, "punctuation": PUNCTUATION,
    "special_tokens": SPECIAL_TOKENS, "metaspace": METASPACE, "unusual": UNUSUAL,
    "invalid_utf8": INVALID_UTF8,
}

SEPARATORS = ["", " ", " ", " ", "  ", "\t", "\u00a0", "\u3000", "\r", "\u0085", "\ufeff", "'"]


def as_bytes(fragment):
    return fragment if isinstance(fragment, bytes) else fragment.encode("utf-8")


def strip_tags(line):
    """'\\tThe/at jury/nn ./.' -> '\\tThe jury .' (a tag is what follows a word's last '/')."""
    return re.sub(r"(\S+)/[^\s/]+", r"\1", line)


def english(brown_dir):
    """The first files of each genre (ca01, cb01, ...), as many lines of each as it takes."""
    files = glob.glob(os.path.join(brown_dir, "c[a-r][0-9][0-9]"))
    genres = sorted({os.path.basename(path)[:2] for path in files})
    if not genres:
        sys.exit(f"make_corpus: no Brown corpus (ca01, ...) in {brown_dir}: run scripts/setup.sh")
    per_genre = -(-BROWN_LINES // len(genres))
    lines = []
    for genre in genres:
        with open(os.path.join(brown_dir, genre + "01"), encoding="ascii") as f:
            lines += [strip_tags(line) for line in f.read().split("\n")[:per_genre]]
    return [line.encode("ascii") for line in lines[:BROWN_LINES]]


def multilingual():
    with open(os.path.join(HERE, "data", "multilingual.txt"), "rb") as f:
        return f.read().rstrip(b"\n").split(b"\n")


def code():
    """CODE_LINES_PER_FILE lines from the middle of files spread evenly over the sources."""
    def sources(*patterns):
        return sorted(path for pattern in patterns
                      for path in glob.glob(os.path.join(ROOT, pattern), recursive=True))

    languages = {"C++": sources("src/**/*.cc", "src/**/*.h"),
                 "Python": sources("python/**/*.py", "tests/**/*.py")}
    lines = []
    for language, paths in languages.items():
        count = CODE_FILES[language]
        for path in [paths[i * len(paths) // count] for i in range(count)]:
            with open(path, "rb") as f:
                text = f.read().split(b"\n")
            middle = max(0, len(text) // 2 - CODE_LINES_PER_FILE // 2)
            lines += text[middle:middle + CODE_LINES_PER_FILE]
    return lines


def long_lines(rng, fragments):
    """Lines of 5 to 20 kB: one mix of everything, and runs that make huge words."""
    mix = b""
    while len(mix) < 20000:
        mix += as_bytes(rng.choice(fragments)) + as_bytes(rng.choice(SEPARATORS))
    words = "the of and to in that is was he for it with as his on".split()
    return [
        mix,
        " ".join(rng.choices(words, k=1200)).encode(),
        b"a" * 8000,
        b"1234567890" * 600,
        "日本語中文漢字かなカナ".encode() * 300,
        b" \t  " * 1500 + b"x",
        "👨\u200d👩\u200d👧👍🏽🇯🇵".encode() * 200,
        b"\xff\x80\xe6\x97 \xf0\x9f\x98" * 700,
        "<|im_start|><s><｜User｜><|im_sta".encode() * 150,
        ("▁" * 2000 + " ▁" * 1000).encode(),
    ]


def adversarial():
    rng = random.Random(SEED)
    fragments = [f for group in CATEGORIES.values() for f in group]
    lines = [as_bytes(f) for f in fragments]
    for _ in range(MIXED_LINES):
        parts = [rng.choice(fragments) for _ in range(rng.randint(2, 6))]
        lines.append(b"".join(as_bytes(p) + as_bytes(rng.choice(SEPARATORS)) for p in parts))
    return lines + long_lines(rng, fragments)


def check_characters(lines):
    """No NUL, no line break; no character Unicode 14 leaves unassigned but noncharacters."""
    for number, line in enumerate(lines, 1):
        assert b"\n" not in line and b"\0" not in line, f"line {number}: {line!r}"
        for c in line.decode("utf-8", "replace"):
            code_point = ord(c)
            noncharacter = 0xFDD0 <= code_point <= 0xFDEF or code_point & 0xFFFE == 0xFFFE
            assert unicodedata.category(c) != "Cn" or noncharacter, (
                f"line {number}: U+{code_point:04X} is not assigned in Unicode "
                f"{unicodedata.unidata_version}")


def make_corpus(out_file, brown_dir):
    """Writes the corpus; returns {section: (first line number, line count)}."""
    sections = {"english": english(brown_dir), "multilingual": multilingual(), "code": code(),
                "adversarial": adversarial()}
    lines, index = [], {}
    for name, section in sections.items():
        index[name] = (len(lines) + 1, len(section))
        lines += section
    check_characters(lines)
    with open(out_file, "wb") as f:
        f.write(b"".join(line + b"\n" for line in lines))
    return index


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: make_corpus.py OUT_FILE BROWN_DIR")
    for name, (first, count) in make_corpus(sys.argv[1], sys.argv[2]).items():
        print(f"{name}: {count} lines from line {first}")
