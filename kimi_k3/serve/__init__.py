"""The OpenAI-compatible server's parts: the HTTP layer (``http``), the Starlette app
(``app``), the request schema and replies (``protocol``), the batching engine (``engine``)
and grammar-constrained decoding (``constrained``). ``python -m kimi_k3.server`` puts them together.
"""
