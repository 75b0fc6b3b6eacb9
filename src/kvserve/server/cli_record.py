"""``kvserve record start|stop|status --url URL``: switch a running server's recording
(POST /admin/record/start, /admin/record/stop; GET /admin/record; docs/recording.md)."""

from __future__ import annotations

import argparse
import json
import os
import urllib.error
import urllib.request
from typing import Any

from kvserve.flags import CLIError, add_command, check_url

SUMMARY = "start or stop a running server's recording"
DESCRIPTION = ("Start, stop or show the recording of a running kvserve server (what kvserve "
               "serve --record DIR does from boot). Needs an admin key when the server has "
               "keys.")


def add_parser(subparsers: Any) -> None:
    parser = add_command(subparsers, "record", run, SUMMARY, DESCRIPTION)
    parser.add_argument("action", choices=("start", "stop", "status"),
                        help="start (a new segment), stop, or show the status")
    parser.add_argument("--url", default="http://127.0.0.1:8000",
                        help="the server (default http://127.0.0.1:8000)")
    parser.add_argument("--dir", help="start: record into this directory on the server's "
                                      "machine, relative to the server's working directory "
                                      "(a tenant's admin key: under it; default: the current "
                                      "recording's, at first the server's --record DIR)")
    parser.add_argument("--api-key", help="an admin key, when the server has keys (default: "
                                          "$VLLM_API_KEY, as kvserve serve reads it)")
    parser.add_argument("--timeout", type=float, default=10.0, help="seconds to wait")


def run(args: argparse.Namespace) -> int:
    base = check_url("--url", args.url)
    if args.dir is not None and args.action != "start":
        raise CLIError("--dir is for start only")
    if not 0 < args.timeout < float("inf"):  # NaN fails too
        raise CLIError(f"--timeout must be a positive number of seconds, got {args.timeout}")
    path = "/admin/record" if args.action == "status" else f"/admin/record/{args.action}"
    data = None
    if args.action != "status":
        data = json.dumps({"dir": args.dir} if args.dir else {}).encode()
    request = urllib.request.Request(base + path, data=data,
                                     method="GET" if data is None else "POST")
    request.add_header("Content-Type", "application/json")
    key = args.api_key or os.environ.get("VLLM_API_KEY") or None
    if key:
        request.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(request, timeout=args.timeout) as response:
            raw = response.read()
    except urllib.error.HTTPError as error:  # a missing key: the flag that gives one
        hint = "; give --api-key KEY (an admin key)" if error.code == 401 and not key else ""
        raise CLIError(f"{base}: HTTP {error.code}: {_message(error.read())}{hint}") from None
    except (urllib.error.URLError, OSError) as error:
        reason = getattr(error, "reason", error)
        raise CLIError(f"cannot reach {base}: {reason}") from None
    try:
        body = json.loads(raw)
    except ValueError:
        body = None
    if not isinstance(body, dict) or "recording" not in body:  # QA: a traceback
        raise CLIError(f"{base}{path} answered, but not with kvserve's recording status: is "
                       "--url a kvserve server?")
    state = "recording" if body.get("recording") else "not recording"
    where = (" into " if body.get("recording") else "; last directory ") + body["directory"] \
        if body.get("directory") else ""
    counts = f" ({body['requests']} requests, {body['steps']} steps written)" \
        if "requests" in body else ""
    # the dashboard pass: a start that found it recording, or a stop that found it stopped,
    # read as one that did it; a recording stopped by a write error as one stopped by hand
    unchanged = "" if body.get("changed", True) else \
        (" (it was recording already)" if body.get("recording") else " (it was not recording)")
    error = f": {body['error']}" if body.get("error") else ""
    print(f"{state}{where}{counts}{unchanged}{error}")
    return 1 if error else 0


def _message(raw: bytes) -> str:
    """An OpenAI-style error's message, else the answer's first line (a proxy's HTML page
    was printed whole: QA)."""
    try:
        return str(json.loads(raw)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        lines = raw.decode(errors="replace").strip().splitlines()
        return (lines[0][:200] + (" ..." if len(lines) > 1 else "")) if lines else "no body"
