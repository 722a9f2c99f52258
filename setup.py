"""Build of the C codec extension (kernels/cpu/); all other metadata lives in pyproject.toml.

The flags are part of the codec's contract: no FMA contraction, no fast-math (the encoded bytes
must equal the reference's). ISA variants are chosen at run time inside the library, so the build
itself targets the compiler's default CPU and the wheel runs anywhere. ``optional=True``: without
a compiler the install still succeeds and CPU caches use the reference codec (one warning).
``TURBOWIRE_SKIP_C_BUILD=1`` leaves the extension out altogether: the GPU machine's offline install
(``make gpu-install``) needs only the Triton kernels, and may lack Python's headers.
"""

import os

from setuptools import Extension, setup

CPU_DIR = "kernels/cpu"
SOURCES = [
    f"{CPU_DIR}/{name}"
    for name in ("twcpu.c", "twcpu_base.c", "twcpu_v2.c", "twcpu_v3.c", "twcpu_module.c")
]
HEADERS = [f"{CPU_DIR}/twcpu.h", f"{CPU_DIR}/twcpu_impl.h"]
CFLAGS = [
    "-std=c11",
    "-O3",
    "-ffp-contract=off",
    "-fno-fast-math",
    "-fno-math-errno",
    "-fno-strict-aliasing",
    "-Wno-sign-compare",
]

SKIP_C_BUILD = os.environ.get("TURBOWIRE_SKIP_C_BUILD") == "1"

setup(
    ext_modules=[] if SKIP_C_BUILD else [
        Extension(
            "turbowire.kernels._twcpu",
            sources=SOURCES,
            depends=HEADERS,
            include_dirs=[CPU_DIR],
            extra_compile_args=CFLAGS,
            libraries=["m"],
            optional=True,
        )
    ]
)
