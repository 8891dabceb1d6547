"""Config section of the deploy stage and the serving checks."""

from __future__ import annotations

from llmpipe.config_base import Section


class DeployConfig(Section):
    pass
