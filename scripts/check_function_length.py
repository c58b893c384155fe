#!/usr/bin/env python3
"""Finds functions longer than --max lines (default 120) in cohort's C++ tree.

    scripts/check_function_length.py [--root DIR] [--max N] [--list]

docs/design.md, habit 11: a function over ~120 lines says beside it why it is
one function. "Beside it" means a comment in the lines just above its
signature that contains the words "long function" and the reason, e.g.

    // A long function: the steps share the listening socket and the deadline,
    // and reading them in order is the point.

Exit status 0 when every long function has such a comment; 1 with one line per
function that lacks it (file:line, name, length). --list prints every function
over the limit, with or without a reason.

How it finds functions: comments, strings and character literals are blanked,
then braces are matched. A brace opens a function body when the text before it
(since the last ';', '{' or '}') has a parameter list and is not a class,
struct, union, enum or namespace head, an initializer ("= {"), or a control
statement; only bodies whose enclosing scope is a namespace or a class count
(lambdas and blocks inside a function are part of that function). Length is
from the signature's first line to the closing brace.
"""
import argparse
import os
import re
import sys

SOURCE_DIRS = ("src", "include", "tools", "examples", "tests", "bench", "fuzz")
EXT = (".cpp", ".hpp", ".h", ".cc")
REASON = re.compile(r"long function", re.IGNORECASE)
NOT_FUNCTION = re.compile(r"^\s*(?:template\s*<[^>]*>\s*)?(?:class|struct|union|enum|namespace)\b|"
                          r"=\s*$|^\s*(?:if|for|while|switch|catch|do|else|return)\b")


def blank(text):
    """Comments, strings and char literals replaced by spaces (newlines kept)."""
    out = []
    i, n = 0, len(text)
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
            out.append("".join(ch if ch == "\n" else " " for ch in text[i:j]))
            i = j
        elif text.startswith('R"', i):
            m = re.match(r'R"([^(]*)\(', text[i:])
            if not m:
                out.append(c)
                i += 1
                continue
            end = text.find(")" + m.group(1) + '"', i)
            j = n if end < 0 else end + len(m.group(1)) + 2
            out.append("".join(ch if ch == "\n" else " " for ch in text[i:j]))
            i = j
        elif c in "\"'":
            j = i + 1
            while j < n and text[j] != c:
                if text[j] == "\\":
                    j += 1
                if j < n and text[j] == "\n":
                    break
                j += 1
            out.append(" " * (j + 1 - i))
            i = j + 1
        else:
            out.append(c)
            i += 1
    return "".join(out)


def functions(text):
    """(first line, last line, name) of each function body at namespace or class scope."""
    code = blank(text)
    found = []
    stack = []  # one entry per open brace: "scope" (namespace, class, extern) or "body" (function, block)
    head_start = 0  # offset where the current head began (after the last ; { })
    for i, c in enumerate(code):
        if c == "{":
            head = code[head_start:i]
            in_function = any(kind == "body" for kind, _, _ in stack)
            is_function = (not in_function and "(" in head and ")" in head and not NOT_FUNCTION.search(head)
                           and not head.rstrip().endswith("="))
            if is_function:
                stripped = head.lstrip()
                start = i - len(head) + (len(head) - len(stripped))
                name_m = re.search(r"([~\w:<>]+)\s*\(", head)
                stack.append(("body", start, name_m.group(1) if name_m else "?"))
            elif in_function:
                stack.append(("block", i, ""))
            else:
                stack.append(("scope", i, ""))
            head_start = i + 1
        elif c == "}":
            if stack:
                kind, start, name = stack.pop()
                if kind == "body":
                    first = code.count("\n", 0, start) + 1
                    last = code.count("\n", 0, i) + 1
                    found.append((first, last, name))
            head_start = i + 1
        elif c == ";":
            head_start = i + 1
        elif c == "#" and (i == 0 or code[i - 1] == "\n"):
            # A preprocessor line is not part of a head.
            j = code.find("\n", i)
            head_start = len(code) if j < 0 else j + 1
    return found


def has_reason(lines, first):
    """A 'long function' comment in the 8 lines above the signature."""
    for k in range(max(0, first - 9), first - 1):
        line = lines[k].strip()
        if line.startswith("//") and REASON.search(line):
            return True
    return False


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--root", default=os.path.join(os.path.dirname(__file__), ".."))
    ap.add_argument("--max", type=int, default=120)
    ap.add_argument("--list", action="store_true")
    args = ap.parse_args()
    root = os.path.abspath(args.root)
    missing, total, files = [], 0, 0
    for d in SOURCE_DIRS:
        for dirpath, _, names in os.walk(os.path.join(root, d)):
            for name in sorted(names):
                if not name.endswith(EXT):
                    continue
                path = os.path.join(dirpath, name)
                rel = os.path.relpath(path, root)
                text = open(path, encoding="utf-8", errors="replace").read()
                lines = text.split("\n")
                files += 1
                for first, last, fname in functions(text):
                    n = last - first + 1
                    if n <= args.max:
                        continue
                    total += 1
                    ok = has_reason(lines, first)
                    if args.list or not ok:
                        print(f"{rel}:{first}: {fname}: {n} lines{'' if ok else ' (no long function comment above it)'}")
                    if not ok:
                        missing.append(rel)
    print(f"check_function_length: {files} files, {total} function(s) over {args.max} lines, "
          f"{len(missing)} without a reason", file=sys.stderr)
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
