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
import sys
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")

# tests/support/ (importable as ``support``): test and benchmark helpers that the turbowire package
# does not ship. pytest's default import mode already puts tests/ on sys.path for this file; say
# so explicitly, so that ``--import-mode=importlib`` finds them too.
_TESTS = str(Path(__file__).resolve().parent)
if _TESTS not in sys.path:
    sys.path.insert(0, _TESTS)
# the repository root, for the ``bench`` package (tests/support/fakes.py takes the stand-ins the
# GPU path bench shares with the tests from it): ``python -m pytest`` from the root (make test)
# puts it there too; last, so that it shadows nothing installed
_ROOT = str(Path(__file__).resolve().parents[1])
if _ROOT not in sys.path:
    sys.path.append(_ROOT)


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    """State which vLLM CPU attention ISA (and so which KV placement) engines get on this machine:
    AMX hosts and others place KV differently, and CI runs on whichever it gets. Also which
    cache-write ISAs the tests ran with vLLM's live op and which they replayed from the recorded
    reference (tests/data/vllm_cpu_attn), since that differs by machine too."""
    from pathlib import Path

    try:
        import torch
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
    except ImportError:
        return
    amx = "yes" if "amx_tile" in Path("/proc/cpuinfo").read_text() else "no"
    terminalreporter.section("vLLM CPU attention on this machine")
    terminalreporter.write_line(f"CPU has AMX tiles: {amx}")
    for dtype in (torch.bfloat16, torch.float16):
        for bs in (32, 128):
            isa = _get_attn_isa(dtype, bs, 64)
            terminalreporter.write_line(
                f"engines with {str(dtype).replace('torch.', '')} KV, block size {bs}: isa {isa}"
            )
    from turbowire.kernels import cpu_binding

    # TURBOWIRE_CPU_ISA pins it (make test-matrix runs the generic build)
    runs = ", ".join(cpu_binding.supported_isas()) if cpu_binding.available() else "none"
    terminalreporter.write_line(f"turbowire C codec build: {cpu_binding.isa()} "
                                f"(this CPU runs: {runs})")
    cache_writes = sys.modules.get("support.vllm_cpu_attn")  # only if a test used it
    if cache_writes is not None:
        terminalreporter.write_line(cache_writes.summary_line())
