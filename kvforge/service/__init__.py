"""kvforge.service: the conversation router as an HTTP service in front of a fleet of engines.

- :mod:`~kvforge.service.proxy`: the aiohttp OpenAI-compatible proxy (routing, streaming, health, admin).
- :mod:`~kvforge.service.keys`: request bodies to block keys, and the one seam to ``kvforge.routing``.
- :mod:`~kvforge.service.kv_events`: vLLM's KV-event wire format, subscriber (gap replay) and publisher.
- :mod:`~kvforge.service.metrics`: Prometheus metrics and JSON-lines logs.
- :mod:`~kvforge.service.cli`: ``kvforge router`` arguments.

Importing this package needs aiohttp, msgspec, pyzmq, prometheus-client (and tokenizers for ``--tokenizer``).
"""
