"""kvforge.serve: ``kvforge serve``, one engine behind an OpenAI-compatible HTTP server.

* :mod:`~kvforge.serve.loop`: :class:`EngineLoop`, the engine stepped by one background thread; requests join
  and leave between steps; block events published in vLLM's wire format;
* :mod:`~kvforge.serve.app`: :class:`ServeApp`, the aiohttp routes (completions, chat, models, health, metrics);
* :mod:`~kvforge.serve.cli`: the command line (``python3 -m kvforge serve --help``).

Needs the ``router`` and ``engine`` extras (aiohttp, pyzmq, prometheus-client, tokenizers; torch, Triton, fla).
"""

__all__ = ["EngineLoop", "ServeApp", "ServeSettings"]


def __getattr__(name: str):
    if name == "EngineLoop":
        from kvforge.serve.loop import EngineLoop

        return EngineLoop
    if name in ("ServeApp", "ServeSettings"):
        from kvforge.serve import app

        return getattr(app, name)
    raise AttributeError(name)
