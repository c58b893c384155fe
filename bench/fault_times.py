#!/usr/bin/env python3
"""How fast cohort notices failures and gets training going again. Measures,
REPS times each (min / median / max):

  sigkill    a worker SIGKILLed inside an allreduce (tests/progs/coll_worker
             kill-mid, 2 ranks, per transport): from the victim's last line to
             the peer's error naming it.
  linkcut    two "machines" (network namespaces, 10.81.0.0/24, made and
             removed here) under `cohort run --rdzv-backend c10d`; machine 1's
             link is taken down: from `ip link set down` to machine 0's
             launcher reporting the lost node.
  agentkill  the same, machine 1's launcher SIGKILLed instead.
  restart    the Fashion-MNIST example, 2 ranks, --max-restarts 1, rank 1
             SIGKILLs itself after step 30 (checkpoint every 20): from the
             kill (rank 0's step-30 line) to the first training step after the
             restart (which resumes from step 20 by itself).

linkcut / agentkill need root and iproute2 (skipped otherwise); restart needs
the example (LibTorch build) and the dataset. Results go to
docs/fault-tolerance.md by hand. Usage:

  sudo bench/fault_times.py --build build --reps 3 [--only sigkill,linkcut,...]
"""
import argparse
import os
import queue
import re
import signal
import statistics
import subprocess
import threading
import time

TAG = "coh_el_b%d" % os.getpid()


def sh(cmd):
    return subprocess.run(cmd, shell=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode == 0


class Lines:
    """Reads a process's stdout and stderr on threads, stamping each line."""

    def __init__(self, proc):
        self.q = queue.Queue()
        self.all = []
        for stream in (proc.stdout, proc.stderr):
            threading.Thread(target=self._read, args=(stream,), daemon=True).start()

    def _read(self, stream):
        for line in iter(stream.readline, ""):
            self.q.put((time.monotonic(), line.rstrip("\n")))

    def wait_for(self, pattern, timeout):
        """Time of the first line (from now on) matching pattern, or None."""
        deadline = time.monotonic() + timeout
        rx = re.compile(pattern)
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            try:
                t, line = self.q.get(timeout=left)
            except queue.Empty:
                return None
            self.all.append(line)
            if rx.search(line):
                return t


def popen(cmd, env=None):
    e = dict(os.environ)
    e.update(env or {})
    p = subprocess.Popen(cmd, env=e, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True)
    # Reap at once, as a launcher does: the shm transport sees a dead peer by
    # its pid, and an unreaped zombie still has one.
    threading.Thread(target=p.wait, daemon=True).start()
    return p


def stop(p):
    if p.poll() is None:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    p.wait()


def free_port():
    import socket
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def sigkill(build, transport):
    port = free_port()
    prog = os.path.join(build, "tests", "coll_worker")
    procs = []
    for r in range(2):
        env = {"RANK": str(r), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "COHORT_TRANSPORT": transport, "COHORT_TIMEOUT": "120s", "COHORT_RUN_ID": "ft%d" % port}
        procs.append(popen([prog, "kill-mid", "1", str(32 << 20), "20"], env))
    lines = [Lines(p) for p in procs]
    t_kill = lines[1].wait_for(r"VICTIM: rank 1", 60)
    t_err = lines[0].wait_for(r"ERROR: .*rank 1", 60)
    for p in procs:
        stop(p)
    if t_kill is None or t_err is None:
        raise RuntimeError("no kill or no error seen: %s" % lines[0].all[-3:])
    return t_err - t_kill


class Lab:
    def __init__(self, n):
        self.made = []
        if os.geteuid() != 0 or not sh("ip -V"):
            raise PermissionError("needs root and iproute2")
        sw = TAG + "_sw"
        ok = sh("ip netns add " + sw)
        self.made.append(sw)
        ok = ok and sh("ip -n %s link add br0 type bridge" % sw) and sh("ip -n %s link set br0 up" % sw)
        for i in range(n):
            ns = self.name(i)
            ok = ok and sh("ip netns add " + ns)
            self.made.append(ns)
            ok = ok and sh("ip link add eth0 netns %s type veth peer name p%d netns %s" % (ns, i, sw))
            ok = ok and sh("ip -n %s link set p%d master br0" % (sw, i)) and sh("ip -n %s link set p%d up" % (sw, i))
            ok = ok and sh("ip -n %s addr add 10.81.0.%d/24 dev eth0" % (ns, i + 1))
            ok = ok and sh("ip -n %s link set eth0 up" % ns) and sh("ip -n %s link set lo up" % ns)
        if not ok:
            self.remove()
            raise PermissionError("cannot make network namespaces")
        for _ in range(50):
            if sh("ip netns exec %s ping -c1 -W1 10.81.0.2" % self.name(0)):
                break

    def name(self, i):
        return "%s_n%d" % (TAG, i)

    def remove(self):
        for ns in reversed(self.made):
            sh("ip netns del " + ns)
        self.made = []


def node_failure(build, how):
    lab = Lab(2)
    try:
        cohort = os.path.join(build, "cohort")
        nodes = []
        for i in range(2):
            cmd = ["ip", "netns", "exec", lab.name(i), cohort, "run", "--nnodes", "2", "--nproc-per-node", "1",
                   "--rdzv-backend", "c10d", "--rdzv-endpoint", "10.81.0.1:29400", "--rdzv-id", "bench",
                   "/bin/sh", "-c", "sleep 120"]
            nodes.append(popen(cmd, {"COHORT_TERM_TIMEOUT": "2s"}))
        lines = [Lines(p) for p in nodes]
        for l in lines:
            if l.wait_for(r"round 0: this is node", 60) is None:
                raise RuntimeError("rendezvous failed: %s" % l.all[-3:])
        time.sleep(1)
        t0 = time.monotonic()
        if how == "linkcut":
            sh("ip -n %s link set eth0 down" % lab.name(1))
        else:
            os.kill(nodes[1].pid, signal.SIGKILL)
        t1 = lines[0].wait_for(r"lost node", 60)
        for p in nodes:
            stop(p)
        if t1 is None:
            raise RuntimeError("lost node not reported: %s" % lines[0].all[-3:])
        return t1 - t0
    finally:
        lab.remove()


def restart(build):
    """Rank 1 SIGKILLs itself right after step 30, when rank 0 prints step 30's
    loss: from that line to the first step after the restart (step 21)."""
    import tempfile
    ckpt = tempfile.mkdtemp(prefix="cohort_fault_times_")
    cmd = [os.path.join(build, "cohort"), "run", "--standalone", "--nproc-per-node", "2", "--max-restarts", "1",
           os.path.join(build, "fashion_mnist"), "--epochs", "1", "--batch-size", "256", "--checkpoint-dir", ckpt,
           "--checkpoint-every", "20", "--log-losses", "--fault-kill-rank", "1", "--fault-at-step", "30",
           "--max-steps", "40"]
    p = popen(cmd, {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"})
    lines = Lines(p)
    t_fail = lines.wait_for(r"LOSS step=30 ", 300)
    t_line = lines.wait_for(r"was killed by signal 9", 300)
    t_step = lines.wait_for(r"LOSS step=21 ", 300)
    p.wait(timeout=600)
    subprocess.run(["rm", "-rf", ckpt])
    if t_fail is None or t_line is None or t_step is None:
        raise RuntimeError("no failure or no resumed step: %s" % lines.all[-5:])
    print("  restart: kill -> launcher's failure line %.2f s, -> first resumed step %.2f s" %
          (t_line - t_fail, t_step - t_fail), flush=True)
    return t_step - t_fail


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build", default="build")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--only", default="sigkill,linkcut,agentkill,restart")
    args = ap.parse_args()
    cases = {
        "sigkill-tcp": lambda: sigkill(args.build, "tcp"),
        "sigkill-shm": lambda: sigkill(args.build, "shm"),
        "linkcut": lambda: node_failure(args.build, "linkcut"),
        "agentkill": lambda: node_failure(args.build, "agentkill"),
        "restart": lambda: restart(args.build),
    }
    wanted = args.only.split(",")
    print("COHORT_HEARTBEAT_TIMEOUT=%s" % os.environ.get("COHORT_HEARTBEAT_TIMEOUT", "15s (default)"))
    print("%-12s %8s %8s %8s  (seconds, %d runs)" % ("case", "min", "median", "max", args.reps))
    for name, fn in cases.items():
        if not any(name.startswith(w) for w in wanted):
            continue
        try:
            xs = [fn() for _ in range(args.reps)]
        except (PermissionError, FileNotFoundError, RuntimeError) as e:
            print("%-12s skipped: %s" % (name, e))
            continue
        print("%-12s %8.2f %8.2f %8.2f" % (name, min(xs), statistics.median(xs), max(xs)), flush=True)


if __name__ == "__main__":
    main()
