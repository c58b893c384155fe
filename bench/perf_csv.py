"""The raw-figure CSVs of the benchmark scripts (docs/perf/*.csv): one header
line naming the columns, then one line per run and figure. Shared by
compare_peers.py, zero_compare.py and ddp_scaling.py, which each define their
header, and read by write_performance.py."""
import datetime


def now_utc():
    """The stamp every line of one CSV carries: when the run's figures were written."""
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M")


def write(path, header, lines):
    """`lines`: lists of fields, written comma-separated under `header`."""
    with open(path, "w") as f:
        f.write(header + "\n")
        for fields in lines:
            f.write(",".join(str(x) for x in fields) + "\n")


def rows(path, header, what):
    """Each data line's fields; SystemExit naming the file when its header is not `header` (`what` wrote it)."""
    with open(path) as f:
        first = f.readline().strip()
        if first != header:
            raise SystemExit(f"{path}: not a {what} CSV (header {first!r}, expected {header!r})")
        return [line.strip().split(",") for line in f if line.strip()]
