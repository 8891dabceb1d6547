"""Print the config reference (markdown) from the pydantic models, so README never drifts from code.

    python scripts/config_reference.py            # print it
    python scripts/config_reference.py --write    # replace the table in README.md
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, get_args, get_origin

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pydantic import BaseModel  # noqa: E402
from pydantic_core import PydanticUndefined  # noqa: E402

from llmpipe.config import PipelineConfig  # noqa: E402
from llmpipe.config_base import _RUN_ONLY  # noqa: E402


def _type_name(t: Any) -> str:
    if get_origin(t) is not None:
        args = ", ".join(_type_name(a) for a in get_args(t))
        return f"{getattr(get_origin(t), '__name__', str(get_origin(t)))}[{args}]"
    return getattr(t, "__name__", str(t)).replace("NoneType", "None")


def _default(field: Any) -> str:
    if field.default is not PydanticUndefined:
        d = field.default
    elif field.default_factory is not None:
        d = field.default_factory()
    else:
        return "(required)"
    if isinstance(d, BaseModel):
        return "(section)"
    text = repr(d)
    return text if len(text) < 60 else text[:57] + "..."


def rows(model: type[BaseModel], prefix: str = "") -> list[str]:
    out = []
    for name, field in model.model_fields.items():
        path = f"{prefix}{name}"
        ann = field.annotation
        extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            out += rows(ann, path + ".")
            continue
        run_only = " (run-only: not in the stage key)" if extra.get(_RUN_ONLY) else ""
        desc = (field.description or "").replace("|", "\\|") + run_only
        out.append(f"| `{path}` | `{_type_name(ann)}` | `{_default(field)}` | {desc.strip()} |")
        item = _list_item_model(ann)
        if item is not None:  # a list of sections (sources): the keys of each entry
            out += rows(item, path + "[].")
    return out


def _list_item_model(ann: Any) -> type[BaseModel] | None:
    """The model of ``list[Model]``, else None."""
    args = get_args(ann) if get_origin(ann) is list else ()
    item = args[0] if len(args) == 1 else None
    return item if isinstance(item, type) and issubclass(item, BaseModel) else None


def table() -> str:
    lines = ["| key | type | default | meaning |", "| --- | --- | --- | --- |"]
    lines += [r for r in rows(PipelineConfig) if not r.startswith("| `config_path`")]
    return "\n".join(lines)


def write_readme(readme: Path) -> None:
    """Replace the README's reference table (from its header row to the next blank line) in place."""
    text = readme.read_text(encoding="utf-8")
    start = text.index("| key | type | default | meaning |")
    end = text.find("\n\n", start)
    readme.write_text(text[:start] + table() + (text[end:] if end != -1 else "\n"), encoding="utf-8")


def main() -> None:
    if sys.argv[1:] == ["--write"]:
        write_readme(Path(__file__).resolve().parent.parent / "README.md")
    else:
        print(table())


if __name__ == "__main__":
    main()
