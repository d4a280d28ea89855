"""Print the comparison table from the JSON files benchmarks/compare.sh wrote."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def load(out: Path, name: str) -> dict | None:
    path = out / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def main() -> None:
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "results")
    rows = []

    def pair(label: str, ours: float | None, theirs: float | None, higher_better: bool = True) -> None:
        ratio = None
        if ours and theirs:
            ratio = ours / theirs if higher_better else theirs / ours
        fmt = lambda v: "-" if v is None else f"{v:,.1f}"
        rows.append((label, fmt(ours), fmt(theirs), "-" if ratio is None else f"{ratio:.2f}x"))

    # vLLM's throughput JSON has no output-token figure; these runs' output share is fixed by compare.sh.
    output_share = {"tp": 128 / 256, "prefill": 64 / 576}
    for step in ("tp", "prefill"):
        p, v = load(out, f"{step}_pagedllm"), load(out, f"{step}_vllm")
        pair(f"{step}: total tokens/s", p and p["tokens_per_second"], v and v["tokens_per_second"])
        v_out = v and (v.get("output_tokens_per_second") or v["tokens_per_second"] * output_share[step])
        pair(f"{step}: output tokens/s", p and p["output_tokens_per_second"], v_out)
    p, v = load(out, "latency_pagedllm"), load(out, "latency_vllm")
    pair("batch-1 latency, 128/128 (s)", p and p["avg_latency"], v and v["avg_latency"], higher_better=False)
    if p and v:
        pair("ms per output token (batch 1)", p["ms_per_output_token"], v["avg_latency"] * 1000 / 128, False)
    p, v = load(out, "serve_pagedllm"), load(out, "serve_vllm")
    for key in ("median_ttft_ms", "p99_ttft_ms", "median_itl_ms", "p99_itl_ms"):
        pair(f"serve: {key}", p and p[key], v and v[key], higher_better=False)
    p, v = load(out, "rss_pagedllm"), load(out, "rss_vllm")
    pair("peak RSS of run tp (GiB)", p and p["peak_rss_gib"], v and v["peak_rss_gib"], higher_better=False)
    hf, p = load(out, "tp_hf"), load(out, "tp_pagedllm")
    if hf and p:
        pair("vs HF generate: output tokens/s", p["output_tokens_per_second"], hf["output_tokens_per_second"])
    width = max(len(r[0]) for r in rows) if rows else 10
    print(f"{'metric':<{width}}  {'pagedllm':>12}  {'peer':>12}  {'ours vs peer':>12}")
    for label, a, b, r in rows:
        print(f"{label:<{width}}  {a:>12}  {b:>12}  {r:>12}")
    pc = load(out, "prefix_caching")
    if pc:
        print(f"prefix caching: {pc['speedup']:.2f}x end to end, {pc['ttft_speedup']:.2f}x mean TTFT, "
              f"hit rate {pc['on']['hit_rate']:.1%}")


if __name__ == "__main__":
    main()
