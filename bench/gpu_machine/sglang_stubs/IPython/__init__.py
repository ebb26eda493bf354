"""Stand-in (reflow bench/gpu_machine/sglang_stubs): not IPython. Only `IPython.display` exists."""
