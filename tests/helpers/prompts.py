"""Sixteen different prompts shared by the engine tests."""

PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea.",
    "List three prime numbers:",
    "def fibonacci(n):",
    "Once upon a time, in a land far away,",
    "The quick brown fox",
    "Translate 'good morning' to Spanish:",
    "What is the boiling point of water?",
    "My favourite colour is",
    "Explain photosynthesis in one sentence.",
    "1, 2, 3, 4,",
    "The best way to learn programming is",
    "SELECT * FROM",
    "In 1969, humans first",
    "A recipe for pancakes needs",
    "The meaning of life is",
]
