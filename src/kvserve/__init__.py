"""kvserve: an LLM serving engine built around one transparent, pluggable scheduler.

Importing kvserve changes nothing in the process: no environment variable, no library-wide
switch. The ``kvserve`` command sets its process defaults when it starts (:mod:`kvserve.cli`),
the server its metrics exposition when it is built (:func:`kvserve.server.app.build_app`).
"""

__version__ = "0.1.0"
