"""``kiln serve``: an artifact behind an OpenAI-compatible HTTP API (the ``serve`` extra: Starlette + Uvicorn).

Imports ``kiln.runtimes`` only, never the compiler: a server installs ``kiln[serve]`` without torch.
"""

from kiln.serve.app import create_app

__all__ = ["create_app"]
