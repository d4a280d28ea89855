"""A grounded workload for speculative decoding: the prompt holds a passage the answer repeats.

Edits, summaries with quotes, code refactors and retrieval answers copy long runs of their input; n-gram
prompt lookup and small drafters do well there and gain nothing on random prompts, so benchmarks report
both. Passages are built from fixed sentences in a seeded order, so every run sees the same prompts.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from pagedllm.benchmarks.datasets import SampledRequest

_SENTENCES = [
    "The river rose slowly through the night and by morning the lower fields were under water.",
    "Farmers moved their animals to the hills and waited for the rain to stop.",
    "A small bridge near the mill was closed because its wooden posts had started to crack.",
    "The town council met at noon to decide how to share the sandbags that were left.",
    "Children from the school carried blankets and bread to the families on the east side.",
    "By evening the clouds broke apart and the first stars appeared over the valley.",
    "Engineers arrived the next day with pumps, rope and two flat boats.",
    "They worked in shifts, clearing the drains and checking every wall along the bank.",
    "An old map in the library showed where the river had flooded a hundred years before.",
    "The mayor thanked the volunteers and promised a stronger bridge before the next winter.",
    "Merchants reopened their shops once the roads were dry enough for carts.",
    "In the weeks that followed, the fields turned green again and the mill began to turn.",
]
_INSTRUCTION = "Repeat the following text exactly, word for word, and write nothing else.\n\n"


def grounded_requests(tokenizer: Any, num_prompts: int, input_len: int, output_len: int,
                      seed: int = 0) -> list[SampledRequest]:
    """``num_prompts`` prompts of about ``input_len`` tokens asking to repeat a passage (chat template
    applied when the tokenizer has one); the passage holds at least ``output_len`` tokens."""
    for name, value in (("num_prompts", num_prompts), ("input_len", input_len), ("output_len", output_len)):
        if value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value}")
    rng = np.random.default_rng(seed)
    requests = []
    for _ in range(num_prompts):
        order = rng.permutation(len(_SENTENCES)).tolist()
        passage_ids: list[int] = []
        text, i = "", 0
        while len(passage_ids) < max(input_len, output_len + 8):
            text += (" " if text else "") + _SENTENCES[order[i % len(order)]]
            i += 1
            passage_ids = tokenizer.encode(text, add_special_tokens=False)
        message = _INSTRUCTION + tokenizer.decode(passage_ids[:max(input_len, output_len + 8)])
        if getattr(tokenizer, "chat_template", None):
            text = tokenizer.apply_chat_template([{"role": "user", "content": message}], tokenize=False,
                                                 add_generation_prompt=True)
            ids = tokenizer.encode(text, add_special_tokens=False)
        else:
            ids = tokenizer.encode(message + "\n\n")
        requests.append(SampledRequest(ids, output_len))
    return requests
