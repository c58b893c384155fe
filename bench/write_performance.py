#!/usr/bin/env python3
"""Writes the measured tables of docs/performance.md from the raw figures the
benchmark scripts leave in docs/perf/.

    bench/write_performance.py [--check]

docs/performance.md marks each generated table:

    <!-- table: perf/allreduce-np2.csv -->
    ... (this script's output: the date, the medians and ratios, #wrong) ...
    <!-- end of table -->

and everything between a pair of marks is replaced by the table computed from
that CSV (bench/compare_peers.py, bench/zero_compare.py and
bench/ddp_scaling.py write them with --csv, told apart by their header; each script's table() computes the medians
and ratios the same way for its printed table and for the page). The prose around
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
import ddp_scaling  # noqa: E402
import zero_compare  # noqa: E402

DOCS = os.path.join(HERE, "..", "docs")
MARK = re.compile(r"(<!-- table: (?P<csv>[^ ]+) -->\n)(?P<body>.*?)(<!-- end of table -->)", re.S)


def render(csv_rel):
    path = os.path.join(DOCS, csv_rel)
    with open(path) as f:
        header = f.readline().strip()
    if header == ddp_scaling.CSV_HEADER:
        when, models, whos, reps, res = ddp_scaling.read_csv(path)
        body = ddp_scaling.table(res, models, whos, reps)
        body = re.sub(r"^## (.*)$", r"**\1**", body, flags=re.M)  # its headings would cut the page's section
        return f"Measured {when} UTC (raw figures: docs/{csv_rel}).\n\n{body}\n"
    if header == zero_compare.CSV_HEADER:
        when, model, world, reps, results = zero_compare.read_csv(path)
        title, rest = zero_compare.table(results, model, world, reps).split("\n", 1)
        return f"Measured {when} UTC: {title} (raw figures: docs/{csv_rel}).\n{rest}\n"
    when, coll, np, reps, results = compare_peers.read_csv(path)
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
