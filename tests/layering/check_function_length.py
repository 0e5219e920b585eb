#!/usr/bin/env python3
"""No function in the project's C++ is longer than the limit (80 lines of body): a function
that long does several things, and each should have a name.

Reads clang-format's output (one brace style, one statement layout), so a function is found
by its braces: at namespace or class scope, an opening brace whose head (the text since the
last ';', '{' or '}') is a call signature opens a function body; everything until the
matching brace is its body, lambdas and local classes included. Comments, string and
character literals (raw strings too) are blanked first, so their braces do not count.

Usage: check_function_length.py <source root> [limit]
Prints every function over the limit with its file, line and length; exits 1 if there is one.
It first checks itself on a made-up source whose functions' lengths are known."""
import os
import re
import sys

FOLDERS = ("src", "apps", "python")
CONTROL = re.compile(r"^(if|for|while|switch|catch|do|else|try|return)\b|\b(class|struct|union|"
                     r"enum|namespace)\b[^(]*$|=\s*$|\[[^\]]*\]\s*(\([^)]*\))?[^)]*$")
SIGNATURE = re.compile(r"\)\s*(const\s*)?(noexcept\s*)?(override\s*|final\s*)*"
                       r"(->\s*[\w:<>,\s*&]+)?$|\)\s*:\s*.*$", re.S)


def blank(text):
    """Comments and literals replaced by spaces, line breaks kept (so line numbers hold)."""
    out, i, n = [], 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            out.append(" " * (j - i))
            i = j
        elif text.startswith("/*", i):
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
            out.append(re.sub(r"[^\n]", " ", text[i:j]))
            i = j
        elif c == "R" and text.startswith('R"', i) and (i == 0 or not text[i - 1].isalnum()):
            m = re.match(r'R"([^(\s]*)\(', text[i:])
            if not m:
                out.append(c)
                i += 1
                continue
            end = text.find(")" + m.group(1) + '"', i)
            j = n if end < 0 else end + len(m.group(1)) + 2
            out.append(re.sub(r"[^\n]", " ", text[i:j]))
            i = j
        elif c in "\"'":
            if c == "'" and i > 0 and text[i - 1].isdigit():  # a digit separator: 1'000
                out.append(" ")
                i += 1
                continue
            j = i + 1
            while j < n and text[j] != c:
                j += 2 if text[j] == "\\" else 1
            out.append(" " * (min(j + 1, n) - i))
            i = j + 1
        else:
            out.append(c)
            i += 1
    return "".join(out)


def functions(text):
    """(first line, body lines, head) of every function defined at namespace or class scope."""
    text = blank(text)
    found = []
    # The stack of open braces: 'scope' (namespace, class, extern, other aggregate) or
    # ('function', line of its brace, head).
    stack = []
    head_start = 0
    for i, c in enumerate(text):
        if c in ";":
            head_start = i + 1
        elif c == "{":
            head = " ".join(text[head_start:i].split())
            inside_function = any(isinstance(s, tuple) for s in stack)
            if i > 0 and (text[i - 1].isalnum() or text[i - 1] == "_"):
                stack.append("init")  # x_{1} in an initializer list, Type{...}
                continue
            if (not inside_function and "(" in head and not CONTROL.search(head) and
                    SIGNATURE.search(head)):
                stack.append(("function", text.count("\n", 0, i) + 1, head))
            else:
                stack.append("scope")
            head_start = i + 1
        elif c == "}":
            top = stack.pop() if stack else "scope"
            if isinstance(top, tuple):
                end = text.count("\n", 0, i) + 1
                found.append((top[1], max(0, end - top[1] - 1), top[2]))
            if top != "init":
                head_start = i + 1
    return found


SELF_TEST = r'''
namespace a {
int one(int x) {
  const char* s = "{{{";  // }
  char c = '{';
  return x + 1'000;
}
class K {
 public:
  K(int x) : x_(x), y_{x} {
    auto f = [&](int z) {
      if (z) {
        return 1;
      }
      return 2;
    };
    const std::string r = R"x({ ")" })x";
  }
  int get() const { return x_; }
  int x_, y_;
};
std::vector<int> kTable = {1, 2};
}  // namespace a
'''


def self_test():
    got = [(line, body) for line, body, _ in functions(SELF_TEST)]
    want = [(3, 3), (10, 7), (19, 0)]
    if got != want:
        sys.exit(f"check_function_length.py misreads its own example: {got}, not {want}")


def main():
    self_test()
    root = sys.argv[1]
    limit = int(sys.argv[2]) if len(sys.argv) > 2 else 80
    long_ones, checked = [], 0
    for folder in FOLDERS:
        for dirpath, _, files in os.walk(os.path.join(root, folder)):
            for f in sorted(files):
                if not f.endswith((".h", ".cc")):
                    continue
                path = os.path.join(dirpath, f)
                for line, body, head in functions(open(path).read()):
                    checked += 1
                    if body > limit:
                        name = re.sub(r"\s*\(.*", "", head, flags=re.S).split()[-1]
                        long_ones.append((body, f"{os.path.relpath(path, root)}:{line}: {name} "
                                          f"has {body} lines (at most {limit})"))
    for _, what in sorted(long_ones, reverse=True):
        print(what)
    print(f"{checked} functions checked, {len(long_ones)} over {limit} lines")
    sys.exit(1 if long_ones or checked == 0 else 0)


if __name__ == "__main__":
    main()
