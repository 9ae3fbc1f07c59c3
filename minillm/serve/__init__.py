"""Chapter 9: an OpenAI-compatible HTTP server for the engine (`python -m minillm serve
MODEL`). Exported from chapters/09_serving.ipynb: protocol.py (request bodies, errors),
async_engine.py (the engine thread and per-request queues), metrics.py (Prometheus),
app.py (the FastAPI routes and server-sent events), cli.py (the command line and a
server in a background thread). Needs the `serve` extra: fastapi, uvicorn,
prometheus_client."""

# Later chapters register their parts of the server (command-line flags, metrics, request
# fields) in chapter 9's registries; importing any part of the server imports them, so a
# server built with build_app() is the whole server, as `import minillm` is the whole engine.
from ..spec import serve as _spec  # noqa: E402,F401  --speculative-config, spec_decode_*
from ..structured import serve as _structured  # noqa: E402,F401  response_format
