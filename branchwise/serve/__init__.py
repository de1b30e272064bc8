"""`branchwise serve`: an OpenAI-compatible HTTP server over a branchwise backend.

Needs the ``serve`` extra (FastAPI, uvicorn): ``pip install 'branchwise[serve]'``. See
``docs/SERVING.md`` for pointing DSPy, LangChain, the OpenAI client or `RemoteBackend` at it.
"""

from branchwise.serve.app import create_app

__all__ = ["create_app"]
