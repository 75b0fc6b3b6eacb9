"""The composition root: the Engine step loop and the offline LLM API."""
