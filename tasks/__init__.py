"""Prefect wrappers: one task per library stage (cache key, retries on I/O, UI artifacts)."""

import os

# Library modules log to "llmpipe.*": route them into the Prefect run logs (set before prefect loads).
os.environ.setdefault("PREFECT_LOGGING_EXTRA_LOGGERS", "llmpipe")
