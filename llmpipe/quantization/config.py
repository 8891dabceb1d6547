"""Config section of the quantize stage (and its quality gate)."""

from __future__ import annotations

from llmpipe.config_base import Section


class QuantizeConfig(Section):
    pass
