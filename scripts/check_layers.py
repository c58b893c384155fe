#!/usr/bin/env python3
"""Checks that every #include in cohort's tree follows the layers of docs/design.md.

    scripts/check_layers.py [--root DIR] [--list]

Each file belongs to one unit (its folder: src/core, src/transport/shm, ...,
include/cohort, tools, examples). A quoted #include names a file of another
unit (or of the same one). The table LAYERS below says, for every unit, which
other units it may include; docs/design.md explains it. Angle-bracket includes
(the standard library, fmt, LibTorch, ...) are not checked here.

Exit status 0 when every include is allowed; 1 with one line per violation
(file:line, the include, both units and what the including unit may use).
--list prints the unit of every file and the edges found, for reading.
"""
import argparse
import os
import re
import sys

# unit -> units it may include (besides itself). "api" is include/cohort/.
LAYERS = {
    "api": set(),
    "src/core": {"api"},
    "src/store": {"api", "src/core"},
    "src/data": {"api", "src/core"},
    "src/checkpoint": {"api", "src/core"},
    "src/topo": {"api", "src/core"},
    # The transport interface (Connection, Engine, shared buffers) and its
    # implementations; an implementation sees the interface, never the other one.
    "src/transport": {"api", "src/core"},
    "src/transport/shm": {"api", "src/core", "src/transport"},
    "src/transport/tcp": {"api", "src/core", "src/store", "src/transport"},
    # Algorithms see the transport interface only (design.md habit 2).
    "src/collectives": {"api", "src/core", "src/transport"},
    # The group reaches transports through their table (transport/registry.hpp), never by name.
    "src/group": {"api", "src/core", "src/store", "src/transport", "src/collectives", "src/group/mpi", "src/group/nccl"},
    "src/group/mpi": {"api", "src/core", "src/group"},
    "src/group/nccl": {"api", "src/core", "src/group"},
    # The reducer works through the public ProcessGroup, like any user.
    "src/ddp": {"api", "src/core"},
    # The LibTorch adapter is a client of the public API only.
    "src/torch": {"api"},
    "src/launch": {"api", "src/core", "src/store", "src/transport/tcp", "src/group", "src/topo"},
    # The planner reads the tuner (the same choices the groups make), nothing that runs.
    "src/plan": {"api", "src/core", "src/collectives"},
    "tools": {"api", "src/core", "src/plan", "src/store", "src/transport", "src/transport/shm", "src/transport/tcp",
              "src/collectives", "src/group", "src/group/mpi", "src/group/nccl", "src/ddp", "src/launch",
              "src/topo", "src/data", "src/checkpoint"},
    "examples": {"api"},
}

# Units that may include only some public headers (the rest may include any):
# the core implements the base types the public API is made of and must not
# see what is built on them (the process group, the reducer, the adapter).
PUBLIC_HEADERS = {
    "src/core": {"cohort/error.hpp", "cohort/types.hpp", "cohort/timeline.hpp"},
}

# Single includes that cross the table, as (file, include) pairs, each with the
# reason beside it. Empty now; a new entry needs its reason here and in
# docs/design.md ("Known exceptions").
EXCEPTIONS = set()

INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"')
SOURCE_EXT = (".hpp", ".cpp", ".h", ".cc")


def unit_of_file(rel):
    """The unit of a file, from its path relative to the root; None when unchecked."""
    parts = rel.split("/")
    if parts[0] == "include" and len(parts) > 2 and parts[1] == "cohort":
        return "api"
    if parts[0] == "src" and len(parts) > 2:
        if parts[1] in ("transport", "group") and len(parts) > 3:
            return "src/%s/%s" % (parts[1], parts[2])
        return "src/" + parts[1]
    if parts[0] in ("tools", "examples"):
        return parts[0]
    return None


def unit_of_include(inc, including_unit, including_dir, root):
    """The unit an include names: a path under include/ or src/, or one beside the file."""
    if inc.startswith("cohort/"):
        return "api"
    if os.path.exists(os.path.join(root, including_dir, inc)):  # beside the including file
        return unit_of_file(os.path.relpath(os.path.normpath(os.path.join(including_dir, inc)), root))
    if os.path.exists(os.path.join(root, "src", inc)):
        return unit_of_file("src/" + inc)
    return None  # a generated or third-party header: not ours to check


def scan(root):
    for top in ("include", "src", "tools", "examples"):
        for d, _, files in os.walk(os.path.join(root, top)):
            for f in sorted(files):
                if f.endswith(SOURCE_EXT):
                    path = os.path.join(d, f)
                    yield os.path.relpath(path, root)


def check(root):
    violations, edges, units = [], {}, {}
    for rel in scan(root):
        unit = unit_of_file(rel)
        if unit is None:
            continue
        if unit not in LAYERS:
            violations.append("%s: unit %s is not in scripts/check_layers.py's LAYERS table; add it there and "
                              "in docs/design.md" % (rel, unit))
            continue
        units[rel] = unit
        with open(os.path.join(root, rel), encoding="utf-8", errors="replace") as fh:
            for n, line in enumerate(fh, 1):
                m = INCLUDE.match(line)
                if not m:
                    continue
                inc = m.group(1)
                target = unit_of_include(inc, unit, os.path.dirname(rel), root)
                if target == "api" and unit in PUBLIC_HEADERS and inc not in PUBLIC_HEADERS[unit]:
                    violations.append('%s:%d: #include "%s": %s may include only %s of the public headers; see '
                                      'docs/design.md, "Layers"' % (rel, n, inc, unit,
                                                                    ", ".join(sorted(PUBLIC_HEADERS[unit]))))
                    continue
                if target is None or target == unit:
                    continue
                edges.setdefault(unit, set()).add(target)
                if target in LAYERS[unit] or (rel, inc) in EXCEPTIONS:
                    continue
                violations.append('%s:%d: #include "%s": %s may not include %s (it may use: %s); see '
                                  'docs/design.md, "Layers"' % (rel, n, inc, unit, target,
                                                                ", ".join(sorted(LAYERS[unit])) or "nothing"))
    return violations, edges, units


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    ap.add_argument("--list", action="store_true", help="print each file's unit and the edges found")
    a = ap.parse_args()
    root = os.path.abspath(a.root)
    violations, edges, units = check(root)
    if a.list:
        for rel, unit in sorted(units.items()):
            print("%-14s %s" % (unit, rel))
        for unit in sorted(edges):
            print("%s -> %s" % (unit, ", ".join(sorted(edges[unit]))))
    stale = [e for e in EXCEPTIONS if not os.path.exists(os.path.join(root, e[0]))]
    for rel, inc in stale:
        violations.append("scripts/check_layers.py: the exception for %s including %s names a file that is gone; "
                          "remove it" % (rel, inc))
    for v in violations:
        print(v)
    print("check_layers: %d files, %d violation%s" % (len(units), len(violations), "" if len(violations) == 1 else "s"))
    return 1 if violations else 0


if __name__ == "__main__":
    sys.exit(main())
