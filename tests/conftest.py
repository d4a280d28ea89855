"""Settings every test shares, applied before any test module is imported."""

import os

# Triton fixes interpreter or compiler mode when triton (and each @triton.jit kernel) is first imported: on a
# machine without a GPU every test must find the interpreter on, whichever test module imports triton first.
if os.environ.get("PAGEDLLM_TEST_DEVICE", "cpu") == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Kernel choices timed on a shared CI machine would differ from run to run, and with them the last bits of
# quantized outputs: tests run the packing's own kernel unless they test the autotuner, which they do with
# fake timers or a forced table (tests/quantization/test_kernel_autotune.py, test_kernel_autotune_engine.py).
os.environ.setdefault("PAGEDLLM_CPU_KERNEL_AUTOTUNE", "off")

# Writing a 2 GiB KV cache whole takes up to 8 s on a VM whose host backs guest memory on first touch, and a
# hundred tests start engines with the default budget: they map it lazily (same outputs, tested with both in
# tests/worker/test_kv_cache_prefault.py, which sets the flag explicitly).
os.environ.setdefault("PAGEDLLM_KV_CACHE_PREFAULT", "0")


def pytest_unconfigure(config) -> None:  # noqa: ANN001 - pytest's hook signature
    """A run must end: if the interpreter is still exiting a minute after the last test (a thread or socket that
    never closes), print every thread's stack and leave with the run's status instead of hanging CI."""
    import faulthandler
    import sys
    import threading
    import time

    status = int(getattr(config, "_pagedllm_exitstatus", 0))

    def watchdog() -> None:
        time.sleep(60)
        sys.stderr.write("pytest: the interpreter did not exit within 60 s of the last test; stacks:\n")
        faulthandler.dump_traceback(all_threads=True)
        sys.stderr.flush()
        os._exit(status)

    threading.Thread(target=watchdog, name="exit-watchdog", daemon=True).start()


def pytest_sessionfinish(session, exitstatus) -> None:  # noqa: ANN001 - pytest's hook signature
    session.config._pagedllm_exitstatus = exitstatus
