"""Entity recognition: the ``entities`` stage, its recognizers (rules + gazetteer, a transformers
token-classification model) and the span helpers other stages use to keep spans exact."""
