"""Config sections of the tokenizer and tokenize stages."""

from __future__ import annotations

from llmpipe.config_base import Section


class TokenizerConfig(Section):
    pass


class TokenizeConfig(Section):
    pass
