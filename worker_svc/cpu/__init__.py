"""The worker's CPU kernels, in one place: building C at first use, the CPU's instruction set, and
the kernels a model runs on a CPU.

``build``       compiles a ``csrc/*.c`` source with the system compiler and loads it (ctypes);
``attention``   paged attention (``csrc/attention.c``), which ``kvcache.paged`` dispatches to
                once the worker has registered it.

Importing this package imports nothing else (no torch).
"""
