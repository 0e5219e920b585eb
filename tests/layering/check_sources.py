#!/usr/bin/env python3
"""The layer rule for sources: a library's files include weightlift headers only from its own
folder and from the libraries it links (directly or through them), and no library source
prints to stdout (what a person reads is made in apps/). Reads the layers the build wrote
(cmake/layers.cmake -> <build>/layers.json).

Usage: check_sources.py <build>/layers.json <source root>"""
import json
import os
import re
import sys

INCLUDE = re.compile(r'^\s*#\s*include\s+"weightlift/([^"]+)"', re.M)
# Writing to stdout: printf-family to stdout, iostreams, puts. snprintf/fprintf(stderr) pass.
PRINTS = re.compile(r'(?<![\w.])(std::)?(printf|puts|putchar|vprintf)\s*\(|std::cout|'
                    r'\bf(put[sc]|printf|write)\s*\([^;]*\bstdout\b')


def strip_comments(text):
    text = re.sub(r'/\*.*?\*/', '', text, flags=re.S)
    return re.sub(r'//[^\n]*', '', text)


def main():
    layers = json.load(open(sys.argv[1]))
    root = sys.argv[2]
    by_target = {l["target"]: l for l in layers}
    # Longest folder first, so a file belongs to the innermost library that holds it.
    owners = sorted(layers, key=lambda l: -len(l["dir"]))

    def owner(path):
        for l in owners:
            if path == l["dir"] or path.startswith(l["dir"] + "/"):
                return l["target"]
        return None

    def closure(target, seen=None):
        seen = set() if seen is None else seen
        for d in by_target[target]["deps"]:
            if d not in seen:
                seen.add(d)
                closure(d, seen)
        return seen

    problems = []
    checked = 0
    for l in layers:
        allowed = closure(l["target"]) | {l["target"]}
        for dirpath, _, files in os.walk(os.path.join(root, l["dir"])):
            for f in files:
                if not f.endswith((".h", ".cc")):
                    continue
                rel = os.path.relpath(os.path.join(dirpath, f), root)
                if owner(rel) != l["target"]:
                    continue
                checked += 1
                text = strip_comments(open(os.path.join(root, rel)).read())
                for inc in INCLUDE.findall(text):
                    target = owner("src/weightlift/" + inc)
                    if target is None:
                        problems.append(f"{rel}: includes weightlift/{inc}, which no library holds")
                    elif target not in allowed:
                        problems.append(f"{rel}: includes weightlift/{inc} ({target}), which "
                                        f"{l['target']} does not link")
                for m in PRINTS.finditer(text):
                    line = text[:m.start()].count("\n") + 1
                    problems.append(f"{rel}:{line}: prints to stdout ({m.group(0).strip()}...); "
                                    "return the values and let apps/ print them")
    for p in problems:
        print(p)
    print(f"{checked} library sources checked, {len(problems)} problems")
    sys.exit(1 if problems or checked == 0 else 0)


if __name__ == "__main__":
    main()
