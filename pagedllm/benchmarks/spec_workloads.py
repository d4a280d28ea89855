"""Chat workloads for speculative decoding, as users send them (``pagedllm bench spec``).

- ``repeat``: ask to repeat a passage of about 300 tokens (the model copies some and paraphrases some);
- ``code-edit``: a Python file of about 300-400 tokens and an instruction to return it with one small change (a
  rename), as vLLM's blazedit dataset does;
- ``agent-loop``: a five-turn conversation where each turn sends the same tool output back and the model answers
  again (each turn's prompt holds the earlier answers);
- ``random-words``: a story from a list of random words (nothing to copy: where drafting must not cost).

Each workload is a list of conversations; a conversation is a list of user turns, and ``next_turn`` builds the
messages of a turn from the answers so far. Deterministic: the same prompts on every run.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from pagedllm.benchmarks.grounded import _SENTENCES

Message = dict[str, str]

_WORDS = ("river apple window quiet engine garden silver paper candle market orange winter thunder pocket ladder "
          "forest button mirror violin basket planet tunnel harbor marble feather castle rocket pepper blanket "
          "canyon lemon bridge pencil meadow anchor dragon velvet island shadow copper saddle lantern falcon "
          "mustard glacier pillow compass orchard").split()


@dataclass
class Conversation:
    """``turns[i]``: what the user says at turn i (the first holds the task); the answers are the model's."""

    turns: list[str]

    def messages(self, answers: list[str]) -> list[Message]:
        """The messages of turn ``len(answers)``: every earlier turn with its answer, then the new one."""
        out: list[Message] = []
        for turn, answer in zip(self.turns, answers):
            out += [{"role": "user", "content": turn}, {"role": "assistant", "content": answer}]
        return out + [{"role": "user", "content": self.turns[len(answers)]}]


def _repeat(n: int, rng: np.random.Generator) -> list[Conversation]:
    out = []
    for _ in range(n):
        order = rng.permutation(len(_SENTENCES))
        passage = " ".join(_SENTENCES[i] for i in np.concatenate([order, order[:6]]))  # about 300 tokens
        out.append(Conversation([f"Repeat the following text exactly, word for word.\n\n{passage}"]))
    return out


_SOURCES = [('''\
from collections import OrderedDict


class LRUCache:
    """A mapping that keeps the most recently used entries, up to a capacity."""

    def __init__(self, capacity: int) -> None:
        if capacity <= 0:
            raise ValueError("capacity must be positive")
        self.capacity = capacity
        self.entries: OrderedDict[str, bytes] = OrderedDict()
        self.hits = 0
        self.misses = 0

    def get(self, key: str) -> bytes | None:
        value = self.entries.get(key)
        if value is None:
            self.misses += 1
            return None
        self.entries.move_to_end(key)
        self.hits += 1
        return value

    def put(self, key: str, value: bytes) -> None:
        self.entries[key] = value
        self.entries.move_to_end(key)
        while len(self.entries) > self.capacity:
            self.entries.popitem(last=False)

    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 0.0
''', "hit_rate"), ('''\
import csv
from dataclasses import dataclass


@dataclass
class Order:
    order_id: int
    customer: str
    status: str
    total: float


def load_orders(path: str) -> list[Order]:
    orders = []
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            orders.append(Order(int(row["order_id"]), row["customer"], row["status"], float(row["total"])))
    return orders


def pending_orders(orders: list[Order]) -> list[Order]:
    return [order for order in orders if order.status == "pending"]


def revenue_by_customer(orders: list[Order]) -> dict[str, float]:
    totals: dict[str, float] = {}
    for order in orders:
        if order.status == "shipped":
            totals[order.customer] = totals.get(order.customer, 0.0) + order.total
    return totals


def summary(orders: list[Order]) -> str:
    shipped = sum(1 for order in orders if order.status == "shipped")
    return f"{len(orders)} orders, {shipped} shipped, {len(pending_orders(orders))} pending"
''', "revenue_by_customer")]


def _code_edit(n: int, rng: np.random.Generator) -> list[Conversation]:
    out = []
    for i in range(n):
        source, name = _SOURCES[i % len(_SOURCES)]
        out.append(Conversation([f"Here is a Python file:\n\n```python\n{source}```\n\nReturn the whole file with the "
                                 f"function `{name}` renamed to `{name}_v2`, and nothing else."]))
    return out


_TOOL_OUTPUT = ("Tool `list_orders` returned:\n" + "\n".join(
    f'{{"order_id": {1040 + i}, "customer": "{name}", "status": "{status}", "total": {12.5 * (i + 3):.2f}}}'
    for i, (name, status) in enumerate([("Ada", "shipped"), ("Ben", "pending"), ("Cleo", "shipped"),
                                         ("Dev", "cancelled"), ("Eli", "pending"), ("Fay", "shipped")])))


def _agent_loop(n: int, rng: np.random.Generator) -> list[Conversation]:
    tasks = ["Which orders are still pending? List their ids.", "Which customers have shipped orders?",
             "What is the total of all shipped orders?", "Which orders were cancelled, and by whom?"]
    out = []
    for i in range(n):
        first = f"You are an assistant with a tool. Task: {tasks[i % len(tasks)]}\n\n{_TOOL_OUTPUT}"
        again = f"I ran the tool again. {_TOOL_OUTPUT}\n\nAnswer the task again from this output."
        out.append(Conversation([first] + [again] * 4))
    return out


def _random_words(n: int, rng: np.random.Generator) -> list[Conversation]:
    return [Conversation(["Write a short story that uses these words: " + ", ".join(rng.choice(_WORDS, 24)) + "."])
            for _ in range(n)]


WORKLOADS: dict[str, Callable[[int, np.random.Generator], list[Conversation]]] = {
    "repeat": _repeat, "code-edit": _code_edit, "agent-loop": _agent_loop, "random-words": _random_words}


def conversations(workload: str, n: int, seed: int = 0) -> list[Conversation]:
    if workload not in WORKLOADS:
        raise ValueError(f"workload: {workload!r} is not one of {sorted(WORKLOADS)}")
    return WORKLOADS[workload](n, np.random.default_rng(seed))
