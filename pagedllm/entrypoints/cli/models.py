"""``pagedllm models``: the architectures this build runs natively, and in which formats; with ``--fallback``, the
transformers causal LMs the transformers fallback runs (``--model-impl``, docs/models.md)."""

from __future__ import annotations

import argparse
import json

FALLBACK_NOTE = ("Any other causal LM whose transformers class supports the attention interface runs through the "
                 "transformers fallback (--model-impl auto|transformers; HF folders, float weights, eagerly): "
                 "`pagedllm models --fallback` lists them.")


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="Print the list as JSON (one object per architecture).")
    parser.add_argument("--fallback", action="store_true",
                        help="Also list transformers' causal-LM architectures without native code and whether the "
                             "transformers fallback can run them (imports every transformers class: ~20 s).")


def main(args: argparse.Namespace) -> int:
    from pagedllm.model_executor.models.registry import architecture_infos

    infos = architecture_infos()
    fallback = []
    if args.fallback:
        from pagedllm.model_executor.models.transformers_fallback.support import transformers_causal_lm_architectures

        fallback = transformers_causal_lm_architectures({a.name for a in infos})
    if args.json:
        rows = [{"architecture": a.name, "family": a.family, "formats": list(a.formats),
                 "gguf_architecture": a.gguf_arch or None, "inputs": list(a.inputs), "notes": a.notes,
                 "model_impl": "pagedllm"} for a in infos]
        rows += [{"architecture": name, "family": model_type, "formats": ["hf"], "gguf_architecture": None,
                  "inputs": ["text"], "notes": "" if ok else "no attention-interface support: cannot run",
                  "model_impl": "transformers" if ok else None} for name, model_type, ok in fallback]
        print(json.dumps(rows, indent=2))
        return 0
    rows = [("ARCHITECTURE", "MODELS", "FORMATS", "INPUTS", "NOTES")]
    names = {"hf": "HF folder", "ct2": "CTranslate2 folder"}
    rows += [(a.name, a.family, ", ".join(names.get(f, f"GGUF ({a.gguf_arch})") for f in a.formats),
              "+".join(a.inputs), a.notes) for a in infos]
    _print_table(rows)
    if not fallback:
        print(f"\n{FALLBACK_NOTE}")
        return 0
    print("\nThrough the transformers fallback (--model-impl auto|transformers):")
    _print_table([("ARCHITECTURE", "MODEL_TYPE", "RUNS", "INPUTS", "")] +
                 [(name, model_type, "fallback" if ok else "no (no attention-interface support)", "text", "")
                  for name, model_type, ok in fallback])
    return 0


def _print_table(rows: list[tuple[str, ...]]) -> None:
    """Columns padded to their widest cell; the last column (notes) as it is."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    for r in rows:
        print(("  ".join(c.ljust(w) for c, w in zip(r[:-1], widths)) + "  " + r[-1]).rstrip())
