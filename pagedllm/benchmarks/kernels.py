"""``pagedllm bench kernels``: the CPU kernel autotuner's table as measured on this machine.

One line per shape class (format, N x K, group) and bucket of rows: the kernel chosen and the milliseconds per
call of every candidate (medians), with when the entry was measured and how busy other processes kept the CPUs
then. The table is written the first time a model's layers are tuned (``--cpu-kernel-autotune on``, the
default); ``--cpu-kernel-autotune force`` measures it again.

    python -m pagedllm.entrypoints.cli.main bench kernels
    python -m pagedllm.entrypoints.cli.main bench kernels --json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from pagedllm.kernels import autotune


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--table", type=Path, default=None,
                        help="The table to print (default: the one saved in pagedllm's cache folder, "
                             "PAGEDLLM_CACHE_DIR).")
    parser.add_argument("--json", action="store_true", help="Print the rows as JSON instead of a table.")


def table_rows(data: dict[str, Any]) -> list[dict[str, Any]]:
    """A saved table -> one row per shape class and bucket: shape, rows (the bucket's timed rows and range),
    chosen, ms (candidate -> ms per call), measured, load, busy, suspect (this bucket disagreed with its
    neighbours)."""
    lows, highs = zip(*autotune.bucket_ranges(), strict=True)
    rows = []
    for key in sorted(data.get("entries", {})):
        entry = data["entries"][key]
        for b, chosen in enumerate(entry.get("choices", [])):
            span = f"{lows[b]}-{highs[b]}" if highs[b] is not None else f"{lows[b]}+"
            rows.append({"shape": key, "rows": autotune.BUCKET_ROWS[b], "range": span, "chosen": chosen,
                         "ms": {name: ts[b] for name, ts in entry.get("ms", {}).items() if b < len(ts)},
                         "measured": entry.get("measured"), "load": entry.get("load"),
                         "busy": bool(entry.get("busy")), "suspect": b in entry.get("suspect", [])})
    return rows


def format_table(data: dict[str, Any]) -> str:
    """The saved table as text: a header on what it was measured on, then a line per shape and bucket."""
    fp = data.get("fingerprint", {})
    lines = [f"CPU: {fp.get('cpu', '?')} ({', '.join(fp.get('flags', []))}); threads {fp.get('threads', '?')}; "
             f"torch {fp.get('torch', '?')}; kernels {fp.get('kernels', '?')}"]
    rows = table_rows(data)
    if not rows:
        return "\n".join(lines + ["(no entries)"])
    width = max(len(r["shape"]) for r in rows)
    lines.append(f"{'shape':<{width}}  {'rows':>7}  {'chosen':<20} {'ms':>9}  others (ms)")
    for r in rows:
        mine = r["ms"].get(r["chosen"])
        others = ", ".join(f"{n} {t:.3f}" for n, t in r["ms"].items() if n != r["chosen"])
        flags = (" [busy]" if r["busy"] else "") + (" [disagrees with neighbours]" if r["suspect"] else "")
        ms = f"{mine:9.3f}" if mine is not None else f"{'-':>9}"
        lines.append(f"{r['shape']:<{width}}  {r['range']:>7}  {r['chosen']:<20} {ms}  {others}{flags}")
    measured = sorted({(r["shape"], r["measured"], r["load"]) for r in rows if r["measured"]})
    if measured:
        lines.append("measured: " + "; ".join(f"{shape} at {when} (others kept {100 * (load or 0):.0f}% of the "
                                              f"CPUs busy)" for shape, when, load in measured))
    return "\n".join(lines)


def main(args: argparse.Namespace) -> dict[str, Any]:
    path = args.table or autotune.default_path()
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        print(f"no kernel autotune table at {path}: start a model on the CPU (--cpu-kernel-autotune on, the "
              "default) to measure one")
        return {"table": str(path), "rows": []}
    except ValueError as e:
        raise ValueError(f"table: {path} is not a kernel autotune table ({e})") from e
    print(json.dumps(table_rows(data), indent=1) if args.json else format_table(data))
    return {"table": str(path), "rows": table_rows(data)}
