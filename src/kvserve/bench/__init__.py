"""Load generation against any OpenAI-compatible server (``kvserve bench serve``)."""
