"""Issue 17.4: importing kvserve changes nothing in the process. OMP_WAIT_POLICY is set by
the ``kvserve`` command when it starts, prometheus-client's *_created switch by the server
when it is built; checked in fresh interpreters, since an import happens once per process."""

from __future__ import annotations

import os
import subprocess
import sys

IMPORT_EVERYTHING = """
import os, sys
import prometheus_client.metrics as prometheus_metrics
import kvserve, kvserve.core, kvserve.sim, kvserve.cli, kvserve.flags
import kvserve.engine.llm, kvserve.engine.async_engine
import kvserve.server.app, kvserve.server.metrics, kvserve.server.cli_serve
assert "torch" in sys.modules  # the engine was really imported
print(os.environ.get("OMP_WAIT_POLICY"), prometheus_metrics._use_created)
"""

CLI_START = """
import os
from kvserve.cli import set_process_defaults
set_process_defaults()
print(os.environ.get("OMP_WAIT_POLICY"))
"""


def run_clean(code: str, **env: str) -> str:
    clean = {k: v for k, v in os.environ.items()
             if k not in ("OMP_WAIT_POLICY", "PROMETHEUS_DISABLE_CREATED_SERIES")}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            env={**clean, **env}, timeout=300)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


def test_importing_kvserve_sets_no_environment_and_no_library_switch():
    assert run_clean(IMPORT_EVERYTHING) == "None True"


def test_the_command_sets_the_wait_policy_and_keeps_the_users():
    assert run_clean(CLI_START) == "PASSIVE"
    assert run_clean(CLI_START, OMP_WAIT_POLICY="ACTIVE") == "ACTIVE"
