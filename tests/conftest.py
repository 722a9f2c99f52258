"""Session-wide test environment.

Triton decides at import time whether its own ``@triton.jit`` library functions (``tl.sum``'s
combiners, ``tl.cdiv``, ...) are interpreter functions, and vLLM imports triton as a side effect.
The Triton kernel tests run under ``TRITON_INTERPRET=1`` on CPU, so the variable has to be set
before the first test module imports vllm or triton, i.e. here. It is harmless elsewhere: the
CPU machines have no GPU backend (vLLM's CPU build disables Triton) and dispatch picks Triton only
for CUDA caches or when asked explicitly.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
