"""``kiln serve``: an artifact behind an OpenAI-compatible HTTP API (the ``serve`` extra: Starlette + Uvicorn).

Imports ``kiln.runtimes`` only, never the compiler: a server installs ``kiln[serve]`` without torch. ``create_app`` is
imported on first use, so ``kiln.serve.guard`` (the CLI's defaults) loads without the extra.
"""

from typing import Any

__all__ = ["create_app"]


def __getattr__(name: str) -> Any:
    if name == "create_app":
        from kiln.serve.app import create_app

        return create_app
    raise AttributeError(f"module 'kiln.serve' has no attribute {name!r}")
