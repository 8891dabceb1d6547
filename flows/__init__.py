"""Prefect flows composing the stage tasks, and the ``llmpipe`` command on top."""

import os

os.environ.setdefault("PREFECT_LOGGING_EXTRA_LOGGERS", "llmpipe")
