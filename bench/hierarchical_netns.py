#!/usr/bin/env python3
"""Allreduce across 2 "hosts" of 2 ranks each: network namespaces joined by
veth links through a bridge, as tests/hierarchical_test.cpp builds them.
Runs, interleaved REPS times, cohort's node-aware allreduce (the tuner's
default there) on ordinary buffers and on shared buffers (`cohort bench
--shared-buffers`, as DDP's buckets are: each host's phases then run by
single copy), cohort's flat algorithms on both (COHORT_HIERARCHICAL=0: recursive doubling
up to 64 KiB, the ring above) and PyTorch
2.13's gloo on the same namespaces, and prints busbw side by side with ratios,
plus the bytes each configuration moved over machine 0's link per allreduce
of the largest size. Needs root and iproute2; never touches the host's own
network. With --rate (e.g. 1gbit) each machine's link is limited by tc.

  sudo bench/hierarchical_netns.py --cohort build/cohort [--reps 3] [--rate 1gbit] [--congestion cubic] [--csv docs/perf/F.csv]

cohort's sockets take cubic where the namespaces' default is bbr (COHORT_TCP_CONGESTION=auto), gloo's keep
the default. --congestion NAME sets this host's net.ipv4.tcp_congestion_control while the namespaces are
made (they take it as their default) and puts the old value back at the end: gloo then runs NAME too.
"""
import argparse
import os
import re
import signal
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import compare_peers  # noqa: E402

PEER_PYTHON = os.path.expanduser("~/.cache/cohort/pytorch-2.13.0/bin/python")


def sh(cmd, check=True):
    p = subprocess.run(cmd, shell=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if check and p.returncode != 0:
        raise SystemExit(f"hierarchical_netns: `{cmd}` failed: {p.stdout.strip()}")
    return p.stdout


def _exit_on_first_sigterm(signum, frame):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    sys.exit(128 + signum)


class Lab:
    """MACHINES machines coh_hb_<pid>_n0, _n1, ... (10.82.0.1, .2, ...) on a bridge in coh_hb_<pid>_sw."""

    def __init__(self, rate, machines=2):
        self.tag = f"coh_hb_{os.getpid()}"
        self.machines = machines
        self.made = []
        # `timeout` and kill send SIGTERM: make it an exit, so that the callers' finally blocks remove the
        # namespaces (left behind by a killed run before 2026-12-07). The first one only: `timeout` signals
        # its child and then the child's process group, and a second exit would cut the removal short.
        signal.signal(signal.SIGTERM, _exit_on_first_sigterm)
        try:
            self._make(rate)
        except BaseException:
            self.remove()
            raise

    def _make(self, rate):
        sw = self.tag + "_sw"
        sh(f"ip netns add {sw}")
        self.made.append(sw)
        sh(f"ip -n {sw} link add br0 type bridge && ip -n {sw} link set br0 up")
        for i in range(self.machines):
            ns = self.name(i)
            sh(f"ip netns add {ns}")
            self.made.append(ns)
            sh(f"ip link add eth0 netns {ns} type veth peer name p{i} netns {sw}")
            sh(f"ip -n {sw} link set p{i} master br0 && ip -n {sw} link set p{i} up")
            sh(f"ip -n {ns} addr add {self.addr(i)}/24 dev eth0 && ip -n {ns} link set eth0 up && ip -n {ns} link set lo up")
            if rate:
                sh(f"ip netns exec {ns} tc qdisc add dev eth0 root tbf rate {rate} burst 512kb latency 100ms")
        for _ in range(50):
            if subprocess.run(f"ip netns exec {self.name(0)} ping -c1 -W1 {self.addr(1)}", shell=True,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode == 0:
                break

    def name(self, i):
        return f"{self.tag}_n{i}"

    @staticmethod
    def addr(i):
        return f"10.82.0.{i + 1}"

    def link_bytes(self, i):
        """RX + TX bytes of machine i's eth0."""
        text = sh(f"ip -n {self.name(i)} -s link show eth0")
        m = re.search(r"RX:[^\n]*\n\s*(\d+)[^\n]*\n\s*TX:[^\n]*\n\s*(\d+)", text)
        return int(m.group(1)) + int(m.group(2))

    def remove(self):
        for ns in reversed(self.made):
            sh(f"ip netns del {ns}", check=False)
        self.made = []


def run_on_both(lab, cohort, program, env, port, timeout=900, per_host=2):
    """`cohort run` of per_host ranks on each machine; node 0's output (its ranks' lines carry [rankN]: prefixes)."""
    procs = []
    for i in range(lab.machines):
        cmd = ["ip", "netns", "exec", lab.name(i), "env", "OMP_NUM_THREADS=1", "COHORT_TIMEOUT=300s"]
        cmd += [f"{k}={v}" for k, v in env.items()]
        cmd += [cohort, "run", "--nnodes", str(lab.machines), "--node-rank", str(i), "--nproc-per-node", str(per_host), "--master-addr",
                lab.addr(0), "--master-port", str(port), *program]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outs = [p.communicate(timeout=timeout)[0] for p in procs]
    for i, p in enumerate(procs):
        if p.returncode != 0:
            sys.stderr.write(f"machine {i} failed ({p.returncode}):\n{outs[i][-3000:]}\n")
    return outs[0]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cohort", required=True, help="path of the cohort binary")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--rate", default="", help="limit each machine's link with tc tbf (e.g. 1gbit); default: none")
    ap.add_argument("--no-gloo", action="store_true")
    ap.add_argument("--congestion", default="",
                    help="the namespaces' default TCP congestion control (gloo's too), e.g. cubic; default: the host's")
    ap.add_argument("--csv", metavar="FILE", help="also write every rep's raw figures (compare_peers.py's CSV format)")
    args = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("hierarchical_netns: needs root to create network namespaces")
    cohort = os.path.abspath(args.cohort)
    sizes = ",".join(str(s) for s in compare_peers.SIZES)
    top = max(compare_peers.SIZES)
    bench = [cohort, "bench", "allreduce", "--sizes", sizes, "-n", "0", "-w", "5", "-c", "1"]
    configs = {
        "cohort hierarchical": (bench, {}, True),
        "cohort hierarchical shared": (bench + ["--shared-buffers"], {}, True),
        "cohort flat ring": (bench, {"COHORT_HIERARCHICAL": "0"}, True),
        # The ring passes every byte through the slots or sockets whatever the buffers: the same job, to show it.
        "cohort flat ring shared": (bench + ["--shared-buffers"], {"COHORT_HIERARCHICAL": "0"}, True),
    }
    if not args.no_gloo:
        if not os.access(PEER_PYTHON, os.X_OK):
            sys.exit(f"hierarchical_netns: {PEER_PYTHON} is missing; run scripts/install-pytorch-peer.sh 2.13.0 "
                     "or pass --no-gloo")
        configs["gloo tcp"] = ([PEER_PYTHON, os.path.join(HERE, "peers/gloo_allreduce.py"), "-c", "allreduce", "-b", "8",
                                "-e", str(top), "-f", "4"], {"GLOO_SOCKET_IFNAME": "eth0"}, False)
    # Allreduces of the largest size, to count what crosses the link per call: out of place and in place, one
    # timed and one checked each (cohort bench's loop), so 4 calls.
    count_prog = [cohort, "bench", "allreduce", "--sizes", str(top), "-n", "1", "-w", "0", "-c", "1"]
    count_calls = 4
    host_cc = sh("sysctl -n net.ipv4.tcp_congestion_control").strip()
    if args.congestion:
        sh(f"sysctl -qw net.ipv4.tcp_congestion_control={args.congestion}")
    try:
        lab = Lab(args.rate)
    finally:
        sh(f"sysctl -qw net.ipv4.tcp_congestion_control={host_cc}")
    ns_cc = sh(f"ip netns exec {lab.name(0)} sysctl -n net.ipv4.tcp_congestion_control").strip()
    print(f"# the namespaces' default congestion control: {ns_cc} (cohort's sockets: COHORT_TCP_CONGESTION, "
          f"{os.environ.get('COHORT_TCP_CONGESTION', 'auto')})", file=sys.stderr, flush=True)
    try:
        results = {k: [] for k in configs}
        link = {}
        port = 29700
        for rep in range(args.reps):
            for name, (prog, env, has_root) in configs.items():
                print(f"# rep {rep + 1}/{args.reps}: {name}", file=sys.stderr, flush=True)
                port += 2
                results[name].append(compare_peers.parse_rows(run_on_both(lab, cohort, prog, env, port), has_root))
        for name, extra in (("cohort hierarchical", []), ("cohort hierarchical shared", ["--shared-buffers"]),
                            ("cohort flat ring", [])):
            before = lab.link_bytes(0)
            port += 2
            run_on_both(lab, cohort, count_prog + extra, configs[name][1], port)
            link[name] = (lab.link_bytes(0) - before) / count_calls
    finally:
        lab.remove()
    # No commas: it is a CSV field.
    what = (f"allreduce across 2 hosts x 2 ranks (veth{' limited to ' + args.rate if args.rate else ''}; "
            f"namespaces' TCP congestion control {ns_cc})")
    print(compare_peers.table(results, what, 4, args.reps, with_gloo=not args.no_gloo))
    print(f"\nBytes over machine 0's link per {top >> 20} MiB allreduce (both directions, with a quarter of the job's "
          f"start-up): " + ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in link.items()) +
          f"; hierarchical / flat ring = {link['cohort hierarchical'] / link['cohort flat ring']:.3f}")
    if args.csv:
        compare_peers.write_csv(args.csv, results, what, 4)


if __name__ == "__main__":
    main()
