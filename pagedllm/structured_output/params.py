"""What a request asks its output to follow: the plain data lives with ``SamplingParams`` (layer 0,
``sampling_params.py``), which carries it; this module hands the names on to the structured-output code."""

from pagedllm.sampling_params import GrammarKey, StructuredOutputsParams

__all__ = ["GrammarKey", "StructuredOutputsParams"]
