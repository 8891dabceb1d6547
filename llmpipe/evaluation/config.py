"""Config section of the evaluate stage."""

from __future__ import annotations

from llmpipe.config_base import Section


class EvaluateConfig(Section):
    pass
