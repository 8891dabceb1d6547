"""Base classes for typed, validated config sections.

Every stage's settings are a ``Section``: a pydantic model that forbids unknown keys, so a typo in
YAML fails before any work. Fields declared with :func:`run_setting` change *how* a stage runs
(worker counts, I/O batch sizes, timeouts) but not *what* it produces; they are left out of the
stage key, so changing them never invalidates the cache.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

_RUN_ONLY = "llmpipe_run_only"


def run_setting(default: Any = ..., **kwargs: Any) -> Any:
    """A field that does not change a stage's output; excluded from the stage key."""
    extra = dict(kwargs.pop("json_schema_extra", None) or {})
    extra[_RUN_ONLY] = True
    return Field(default, json_schema_extra=extra, **kwargs)


class Section(BaseModel):
    """A config section: unknown keys are errors, assignment is validated."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    def key_dict(self) -> dict[str, Any]:
        """The settings that determine the output: everything except run-only fields, recursively."""
        out: dict[str, Any] = {}
        for name, field in type(self).model_fields.items():
            extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
            if extra.get(_RUN_ONLY):
                continue
            out[name] = _key_value(getattr(self, name))
        return out


def _key_value(value: Any) -> Any:
    if isinstance(value, Section):
        return value.key_dict()
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json")
    if isinstance(value, dict):
        return {str(k): _key_value(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_key_value(v) for v in value]
    if hasattr(value, "__fspath__"):
        return str(value)
    return value
