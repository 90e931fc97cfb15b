"""The worker's CPU kernels, in one place: building C at first use, the CPU's instruction set, and
the kernels a model runs on a CPU.

``prepare``      ``prepare_model``: the one entry point, which the runner calls after loading a
                 model on CPU: it picks and switches in the kernels below and registers attention;
``features``     the CPU's model and instruction set, from ``/proc/cpuinfo`` (torch-free);
``build``        compiles a ``csrc/*.c`` source with the system compiler and loads it (ctypes);
                 nothing outside this package builds or loads C;
``attention``    paged attention (``csrc/attention.c``), which ``kvcache.paged`` dispatches to
                 once the worker has registered it (kvcache never imports the worker);
``linear``       linears packed once: the C kernel (``csrc/linear.c``) or oneDNN;
``bf16_linear``  a bf16 model on a CPU without native bf16, computing in fp32;
``fused``        fused RMSNorm, SiLU-and-multiply and rotary (``csrc/fused.c``);
``sampler``      the sampler's argmax and draw (built into ``csrc/fused.c``).

Importing this package imports nothing else (no torch), so ``features`` serves torch-free callers.
"""
