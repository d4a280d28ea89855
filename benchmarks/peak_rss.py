"""Run a command and report the peak resident memory of its whole process tree.

    python benchmarks/peak_rss.py OUT.json -- command args...

Samples every 0.2 s with psutil; writes {"peak_rss_bytes", "peak_rss_gib", "returncode"} to OUT.json.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import psutil


def tree_rss(proc: psutil.Process) -> int:
    total = 0
    for p in [proc, *proc.children(recursive=True)]:
        try:
            total += p.memory_info().rss
        except psutil.Error:
            pass
    return total


def main() -> int:
    out_path, sep, *cmd = sys.argv[1:]
    assert sep == "--", "usage: peak_rss.py OUT.json -- command ..."
    child = subprocess.Popen(cmd)
    proc = psutil.Process(child.pid)
    peak = 0
    while child.poll() is None:
        try:
            peak = max(peak, tree_rss(proc))
        except psutil.Error:
            pass
        time.sleep(0.2)
    with open(out_path, "w") as f:
        json.dump({"peak_rss_bytes": peak, "peak_rss_gib": peak / 2**30, "returncode": child.returncode,
                   "command": cmd}, f, indent=2)
    print(f"peak RSS of the process tree: {peak / 2**30:.2f} GiB")
    return child.returncode


if __name__ == "__main__":
    sys.exit(main())
