#!/usr/bin/env python3
"""Writes the measured tables of docs/performance.md from the raw figures the
benchmark scripts leave in docs/perf/.

    bench/write_performance.py [--check]

docs/performance.md marks each generated table:

    <!-- table: perf/allreduce-np2.csv -->
    ... (this script's output: the date, the medians and ratios, #wrong) ...
    <!-- end of table -->

and everything between a pair of marks is replaced by the table computed from
that CSV (bench/compare_peers.py --csv writes them; compare_peers.py's
table() computes medians and ratios the same way for both). The prose around
the marks stays as people wrote it. --check: exit 1 when the page differs from
what the CSVs give, changing nothing.
"""
import argparse
import os
import re
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import compare_peers  # noqa: E402  (the same medians and ratios as its printed table)

DOCS = os.path.join(HERE, "..", "docs")
MARK = re.compile(r"(<!-- table: (?P<csv>[^ ]+) -->\n)(?P<body>.*?)(<!-- end of table -->)", re.S)


def render(csv_rel):
    when, coll, np, reps, results = compare_peers.read_csv(os.path.join(DOCS, csv_rel))
    body = compare_peers.table(results, coll, np, reps, with_gloo=any("gloo" in n for n in results))
    # The table's own heading line becomes a sentence: the section's heading is the page's.
    lines = body.split("\n")
    title = lines[0].lstrip("# ").strip()
    return (f"Measured {when} UTC: {title} (raw figures: docs/{csv_rel}).\n\n" + "\n".join(lines[2:]) + "\n")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true")
    args = ap.parse_args()
    page = os.path.join(DOCS, "performance.md")
    text = open(page).read()
    count = 0

    def replace(m):
        nonlocal count
        count += 1
        return m.group(1) + render(m.group("csv")) + m.group(4)

    new = MARK.sub(replace, text)
    if args.check:
        if new != text:
            sys.exit("docs/performance.md differs from its CSVs: run bench/write_performance.py")
        print(f"write_performance: {count} table(s) match their CSVs")
        return
    with open(page, "w") as f:
        f.write(new)
    print(f"write_performance: wrote {count} table(s) into docs/performance.md")


if __name__ == "__main__":
    main()
