"""laswrr: a load-aware smooth weighted round-robin router for LLM inference on Ascend NPU pools.

The design card's folders stay at the repository's top level (schemas/, scheduler/, collectors/,
replay/, services/, bench/); pyproject.toml installs them under this one package, so they import
as ``laswrr.schemas``, ``laswrr.scheduler``, ... and ``pip install .`` adds a single top-level name.
"""

from importlib import metadata as _metadata

try:
    __version__ = _metadata.version("laswrr")
except _metadata.PackageNotFoundError:  # running from a checkout that was never installed
    __version__ = "0+unknown"
