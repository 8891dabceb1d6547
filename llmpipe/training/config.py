"""Config section of the pretrain stage."""

from __future__ import annotations

from llmpipe.config_base import Section


class TrainConfig(Section):
    pass
