"""``pagedllm models``: the architectures this build can run, and in which formats."""

from __future__ import annotations

import argparse
import json


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="Print the list as JSON (one object per architecture).")


def main(args: argparse.Namespace) -> int:
    from pagedllm.model_executor.models.registry import architecture_infos

    infos = architecture_infos()
    if args.json:
        print(json.dumps([{"architecture": a.name, "family": a.family, "formats": list(a.formats),
                           "gguf_architecture": a.gguf_arch or None, "inputs": list(a.inputs),
                           "notes": a.notes}
                          for a in infos], indent=2))
        return 0
    rows = [("ARCHITECTURE", "MODELS", "FORMATS", "INPUTS", "NOTES")]
    names = {"hf": "HF folder", "ct2": "CTranslate2 folder"}
    rows += [(a.name, a.family, ", ".join(names.get(f, f"GGUF ({a.gguf_arch})") for f in a.formats),
              "+".join(a.inputs), a.notes) for a in infos]
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r[:4], widths)) + "  " + r[4])
    return 0
