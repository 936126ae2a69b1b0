#!/usr/bin/env python3
"""PyTorch side of the GEMM/GEMV bench (crates/ferrotron-tensor/benches/gemm.rs).

Runs the same cases as the Rust bench with the same timing method (warm-up, then samples of
>= 2 ms each for a fixed budget per case; median and best) and prints the same table.

    tools/.venv/bin/python tools/bench_gemm_torch.py                 # torch only
    tools/.venv/bin/python tools/bench_gemm_torch.py --compare FILE  # + join with saved Rust output
    tools/.venv/bin/python tools/bench_gemm_torch.py --side-by-side  # interleaved, see below

``--side-by-side`` builds the Rust bench (``cargo bench --no-run``) and, case by case, runs the
Rust binary on that one case and then torch on it, so both see the same background load (the
machine is shared); ``--rounds N`` repeats that and keeps, per case and side, the median of the
N medians (and the highest of the N medians: the least disturbed round). It prints the table
ours | torch | ratio (ours / torch), with the CPU load other processes put on the machine meanwhile;
``--wait-idle S`` waits up to S seconds before each case for the machine to go idle, and
``--max-load C`` reruns a case (at most ``--max-tries`` times) while other processes used more
than C cores during it, keeping the quietest run.

Cases (a linear layer y[m, n] = x[m, k] . W[n, k]^T; GF/s = 2*m*n*k / time):
  gemm/f32_fwd   y = x @ W.T                       (f32)
  gemm/f32_dx    dX = dY @ W                        (f32)
  gemm/f32_dw    dW = dY.T @ X                      (f32)
  gemm/bf16_fwd  y = x @ W.T with x and W in bf16   (torch's native bf16 GEMM, what autocast
                 runs; ours keeps x in f32 and widens the bf16 W to f32 before an f32 GEMM)
  gemv/<dtype>   y = W @ x (torch.mv; bf16: W, x, y all bf16), GB/s of W's bytes; each call
                 reads the next of several copies of W (>= 96 MiB in all) so W streams from DRAM.
"""

import argparse
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

GEMM_SHAPES = [(2048, 576, 1536), (2048, 1536, 576), (1024, 1024, 1024)]
GEMV_SHAPES = [(1536, 576), (576, 1536), (49152, 576)]
THREADS = [1, 2]
GEMV_STREAM_BYTES = 96 << 20
REPO = Path(__file__).resolve().parent.parent


def time_case(budget_s, f):
    """Per-call seconds (median, best, samples), same method as the Rust bench."""
    t0 = time.perf_counter()
    calls = 0
    while calls < 3 or time.perf_counter() - t0 < 0.1:
        f()
        calls += 1
    per_call = (time.perf_counter() - t0) / calls
    inner = max(1, int(-(-2e-3 // per_call)))
    samples = []
    start = time.perf_counter()
    while len(samples) < 5 or (time.perf_counter() - start < budget_s and len(samples) < 200):
        t = time.perf_counter()
        for _ in range(inner):
            f()
        samples.append((time.perf_counter() - t) / inner)
    samples.sort()
    return samples[len(samples) // 2], samples[0], len(samples)


def data(shape, gen, dtype=torch.float32):
    return (torch.rand(shape, generator=gen) * 2 - 1).to(dtype)


def cases():
    """(name, threads, work per call, unit, setup) in the Rust bench's order; setup() -> step."""
    out = []
    for t in THREADS:
        for m, n, k in GEMM_SHAPES:
            flops = 2.0 * m * n * k
            for op in ["f32_fwd", "f32_dx", "f32_dw", "bf16_fwd"]:
                out.append((f"gemm/{op}/{m}x{n}x{k}/t{t}", t, flops, "GF/s", gemm_setup(op, m, n, k)))
        for n, k in GEMV_SHAPES:
            for dtype, name in [(torch.float32, "f32"), (torch.bfloat16, "bf16")]:
                nbytes = n * k * torch.tensor([], dtype=dtype).element_size()
                out.append((f"gemv/{name}/{n}x{k}/t{t}", t, float(nbytes), "GB/s", gemv_setup(dtype, n, k)))
    return out


def gemm_setup(op, m, n, k):
    def setup():
        gen = torch.Generator().manual_seed(0)
        if op == "f32_fwd":
            x, w, y = data((m, k), gen), data((n, k), gen), torch.empty(m, n)
            return lambda: torch.mm(x, w.t(), out=y)
        if op == "f32_dx":
            dy, w, dx = data((m, n), gen), data((n, k), gen), torch.empty(m, k)
            return lambda: torch.mm(dy, w, out=dx)
        if op == "f32_dw":
            dy, x, dw = data((m, n), gen), data((m, k), gen), torch.empty(n, k)
            return lambda: torch.mm(dy.t(), x, out=dw)
        bf = torch.bfloat16
        xb, wb, yb = data((m, k), gen, bf), data((n, k), gen, bf), torch.empty(m, n, dtype=bf)
        return lambda: torch.mm(xb, wb.t(), out=yb)

    return setup


def gemv_setup(dtype, n, k):
    def setup():
        gen = torch.Generator().manual_seed(0)
        nbytes = n * k * torch.tensor([], dtype=dtype).element_size()
        copies = max(2, -(-GEMV_STREAM_BYTES // nbytes))
        ws = [data((n, k), gen, dtype) for _ in range(copies)]
        x, y = data((k,), gen, dtype), torch.empty(n, dtype=dtype)
        state = [0]

        def step():
            torch.mv(ws[state[0]], x, out=y)
            state[0] = (state[0] + 1) % copies

        return step

    return setup


def run_torch_case(case, budget_s):
    name, t, work, unit, setup = case
    torch.set_num_threads(t)
    with torch.inference_mode():
        step = setup()
        med, best, n = time_case(budget_s, step)
    del step
    return work / med / 1e9, work / best / 1e9, n


ROW = re.compile(r"^(gem[mv]/\S+)\s+([0-9.]+)\s+([0-9.]+)\s+(\S+)\s*$")


def parse_table(text):
    """`case -> (median, best, unit)` from a Rust bench output (the last row per case)."""
    out = {}
    for line in text.splitlines():
        mt = ROW.match(line.strip())
        if mt:
            out[mt.group(1)] = (float(mt.group(2)), float(mt.group(3)), mt.group(4))
    return out


def build_rust_bench():
    """Builds the Rust bench with cargo and returns the path of its executable."""
    cmd = ["cargo", "bench", "-p", "ferrotron-tensor", "--bench", "gemm", "--no-run", "--message-format=json"]
    res = subprocess.run(cmd, cwd=REPO, check=True, stdout=subprocess.PIPE, text=True)
    for line in res.stdout.splitlines():
        msg = json.loads(line)
        if msg.get("reason") == "compiler-artifact" and msg["target"]["name"] == "gemm" and msg.get("executable"):
            if "bench" in msg["target"]["kind"]:
                return msg["executable"]
    sys.exit("could not find the gemm bench executable in cargo's output")


def run_rust_case(exe, name, case_ms):
    env = dict(os.environ, FERROTRON_BENCH_CASE_MS=str(case_ms))
    res = subprocess.run([exe, "--bench", name], check=True, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    row = parse_table(res.stdout).get(name)
    if row is None:
        sys.exit(f"the Rust bench printed no row for {name}")
    return row[0], row[1]


def print_table(title, rows):
    print(title)
    print(f"{'case':<34} {'median':>8} {'best':>8}  unit")
    for name, med, best, unit in rows:
        print(f"{name:<34} {med:>8.1f} {best:>8.1f}  {unit}")


def cpu_jiffies():
    """(busy, total) jiffies of the whole machine from /proc/stat (Linux)."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    idle = v[3] + v[4]
    return sum(v) - idle, sum(v)


class LoadMeter:
    """Cores used by other processes while a case ran: machine busy cores minus our own
    CPU time (this process and its finished children) per wall second."""

    def __enter__(self):
        self.j0, self.t0, self.c0 = cpu_jiffies(), time.perf_counter(), self._own()
        return self

    def __exit__(self, *exc):
        (b0, t0), (b1, t1) = self.j0, cpu_jiffies()
        wall = time.perf_counter() - self.t0
        busy_cores = (b1 - b0) / max(1, t1 - t0) * (os.cpu_count() or 1)
        self.other = max(0.0, busy_cores - (self._own() - self.c0) / wall)

    @staticmethod
    def _own():
        s, c = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        return s.ru_utime + s.ru_stime + c.ru_utime + c.ru_stime


def wait_idle(max_s):
    """Waits (at most max_s) until the machine is idle: < 10% busy over 0.5 s."""
    deadline = time.perf_counter() + max_s
    while time.perf_counter() < deadline:
        (b0, t0) = cpu_jiffies()
        time.sleep(0.5)
        (b1, t1) = cpu_jiffies()
        if (b1 - b0) < 0.1 * max(1, t1 - t0):
            return


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("filter", nargs="?", help="keep cases whose name contains this")
    p.add_argument(
        "--case-ms",
        type=int,
        default=int(os.environ.get("FERROTRON_BENCH_CASE_MS", "1500")),
        help="time budget per case and side (default 1500, or $FERROTRON_BENCH_CASE_MS)",
    )
    p.add_argument("--compare", metavar="FILE", help="saved output of the Rust bench to join with")
    p.add_argument("--side-by-side", action="store_true", help="interleave the Rust bench and torch case by case")
    p.add_argument("--rounds", type=int, default=1, help="with --side-by-side: repeat, keep the median of medians")
    p.add_argument(
        "--wait-idle",
        type=float,
        default=0.0,
        metavar="S",
        help="with --side-by-side: before each case wait up to S seconds for the machine to be idle",
    )
    p.add_argument(
        "--max-load",
        type=float,
        default=float("inf"),
        metavar="CORES",
        help="with --side-by-side: rerun a case while other processes used more than CORES cores meanwhile",
    )
    p.add_argument("--max-tries", type=int, default=5, help="with --max-load: runs per case at most (keeps the quietest)")
    args = p.parse_args()

    selected = [c for c in cases() if not args.filter or args.filter in c[0]]
    budget_s = args.case_ms / 1000.0
    t_start = time.perf_counter()

    if not args.side_by_side:
        rows = []
        for case in selected:
            med, best, n = run_torch_case(case, budget_s)
            print(f"{case[0]:<34} {med:>8.1f} {best:>8.1f}  {case[3]}  ({n} samples)", file=sys.stderr)
            rows.append((case[0], med, best, case[3]))
        print()
        total = time.perf_counter() - t_start
        print_table(f"torch {torch.__version__} GEMM/GEMV ({args.case_ms} ms per case, {total:.0f} s total)", rows)
        if args.compare:
            ours = parse_table(Path(args.compare).read_text())
            print()
            print("side by side (median; ratio = ours / torch)")
            print(f"{'case':<34} {'ours':>8} {'torch':>8} {'ratio':>6}  unit")
            for name, med, _best, unit in rows:
                o = ours.get(name, (float("nan"),))[0]
                print(f"{name:<34} {o:>8.1f} {med:>8.1f} {o / med:>6.2f}  {unit}")
        return

    exe = build_rust_bench()
    print(f"Rust bench: {exe}", file=sys.stderr)
    ours = {c[0]: [] for c in selected}
    theirs = {c[0]: [] for c in selected}
    others = {c[0]: [] for c in selected}
    for r in range(args.rounds):
        for case in selected:
            tries = []  # (other load, ours, torch)
            while not tries or (tries[-1][0] > args.max_load and len(tries) < args.max_tries):
                wait_idle(args.wait_idle)
                with LoadMeter() as load:
                    o = run_rust_case(exe, case[0], args.case_ms)
                    t = run_torch_case(case, budget_s)[:2]
                tries.append((load.other, o, t))
                print(
                    f"round {r + 1} {case[0]:<34} ours {o[0]:>7.1f} (best {o[1]:>7.1f})  "
                    f"torch {t[0]:>7.1f} (best {t[1]:>7.1f})  {case[3]}  other load {load.other:.2f} cores",
                    file=sys.stderr,
                )
            other, o, t = min(tries, key=lambda x: x[0])
            ours[case[0]].append(o)
            theirs[case[0]].append(t)
            others[case[0]].append(other)
    total = time.perf_counter() - t_start
    print()
    print(
        f"ferrotron-tensor vs torch {torch.__version__}, interleaved case by case, {args.rounds} round(s), "
        f"{args.case_ms} ms per case and side, {total:.0f} s total"
    )
    print("median GF/s or GB/s: median of the rounds' medians, and the highest round median (the least")
    print("disturbed round, a proxy for an idle machine); ratio = ours / torch; load = median CPU cores")
    print("used by other processes while the case ran (machine has %d)" % (os.cpu_count() or 1))
    print(
        f"{'case':<34} {'ours':>8} {'torch':>8} {'ratio':>6} {'ours max':>9} {'torch max':>9} {'ratio':>6} "
        f"{'load':>5}  unit"
    )
    for name, _t, _w, unit, _s in selected:
        o = statistics.median(m for m, _ in ours[name])
        t = statistics.median(m for m, _ in theirs[name])
        oq = max(m for m, _ in ours[name])
        tq = max(m for m, _ in theirs[name])
        bg = statistics.median(others[name])
        print(f"{name:<34} {o:>8.1f} {t:>8.1f} {o / t:>6.2f} {oq:>9.1f} {tq:>9.1f} {oq / tq:>6.2f} {bg:>5.2f}  {unit}")


if __name__ == "__main__":
    main()
