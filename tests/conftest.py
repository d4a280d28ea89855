"""Settings every test shares, applied before any test module is imported."""

import os

# Triton fixes interpreter or compiler mode when triton (and each @triton.jit kernel) is first imported: on a
# machine without a GPU every test must find the interpreter on, whichever test module imports triton first.
if os.environ.get("PAGEDLLM_TEST_DEVICE", "cpu") == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")
