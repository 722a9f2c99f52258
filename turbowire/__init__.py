"""turbowire: compressed KV-cache transfer for disaggregated vLLM serving."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("turbowire")
except PackageNotFoundError:  # running from a source tree without an install
    __version__ = "0.0.0+local"

__all__ = ["__version__"]
