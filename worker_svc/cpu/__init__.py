"""The worker's CPU kernels, in one place: building C at first use, the CPU's instruction set, and
the kernels a model runs on a CPU.

``features``    the CPU's model and instruction set, from ``/proc/cpuinfo`` (torch-free);
``build``       compiles a ``csrc/*.c`` source with the system compiler and loads it (ctypes);
``attention``   paged attention (``csrc/attention.c``), which ``kvcache.paged`` dispatches to
                once the worker has registered it.

Importing this package imports nothing else (no torch).
"""
