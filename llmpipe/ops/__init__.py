"""Operations helpers with no Prefect import: background process management, ports, readiness probes.

The Prefect-side commands (server, worker, deploy) live in ``flows/ops.py`` and use these.
"""

from llmpipe.ops.process import ManagedProcess, free_port, wait_for_http

__all__ = ["ManagedProcess", "free_port", "wait_for_http"]
