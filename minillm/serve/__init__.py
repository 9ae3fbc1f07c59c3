"""Chapter 9: an OpenAI-compatible HTTP server for the engine (`python -m minillm serve
MODEL`). Exported from chapters/09_serving.ipynb: protocol.py (request bodies, errors),
async_engine.py (the engine thread and per-request queues), metrics.py (Prometheus),
app.py (the FastAPI routes and server-sent events), cli.py (the command line and a
server in a background thread). Needs the `serve` extra: fastapi, uvicorn,
prometheus_client."""

# Later chapters register their parts of the server (command-line flags, metrics, request
# fields) in chapter 9's registries; minillm/features.py names them, and each registry's
# reader loads them on first use.
