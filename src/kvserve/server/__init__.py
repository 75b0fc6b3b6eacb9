"""The OpenAI-compatible HTTP server over :class:`kvserve.engine.async_engine.AsyncEngine`:
FastAPI app, protocol models, SSE, Prometheus metrics, API keys and priorities."""
