"""``docs/config.md`` from the schema: every key of the job config, grouped by section, with its
type, its default and the field's docstring (the string right after the field).

``python -m nemo_nutp.config.docs > docs/config.md`` (``make config-docs``) writes it;
``tests/docs/test_config_docs.py`` fails when the committed file differs from ``render()``.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap
from typing import Any

from .schema import JobConfig

COMMAND = "python -m nemo_nutp.config.docs > docs/config.md"
"""How to regenerate the page (``make config-docs``)."""
HEADER = f"""# Configuration reference

Generated from the dataclasses' field docstrings (`nemo_nutp/config/schema.py` and the specs
it reuses from `nemo_nutp/layout/`) by `make config-docs`
(`{COMMAND}`); do not edit it by hand:
`tests/docs/test_config_docs.py` fails when it is stale.

Defaults are the dataclasses'. `configs/config.yaml` picks a file per group (`model`, `cluster`,
`health`) and sets only what differs; a key is overridden on the command line as
`key=value` (Hydra syntax). Deprecated keys are accepted for one release with a warning.
"""


def _field_docs(cls: type) -> dict[str, tuple[str, str]]:
    """``{field: (annotation, docstring)}`` of a dataclass and its dataclass bases."""
    out: dict[str, tuple[str, str]] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        body = tree.body[0].body  # type: ignore[attr-defined]
        for node, nxt in zip(body, [*body[1:], None]):
            if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
                continue
            doc = ""
            if isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant) \
                    and isinstance(nxt.value.value, str):
                doc = inspect.cleandoc(nxt.value.value)
            out[node.target.id] = (ast.unparse(node.annotation), doc)
    return out


def _default(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def _entries(obj: Any, prefix: str) -> list[str]:
    """The list items of one section; nested dataclasses become sub-sections."""
    lines: list[str] = []
    nested: list[tuple[str, Any]] = []
    docs = _field_docs(type(obj))
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            nested.append((f.name, value))
            continue
        annotation, doc = docs[f.name]
        text = " ".join(doc.split()) or "(no docstring)"
        item = f"- `{prefix}{f.name}` (`{annotation}`, default `{_default(value)}`): {text}"
        lines += textwrap.wrap(item, width=100, subsequent_indent="  ",
                               break_long_words=False, break_on_hyphens=False)
    for name, value in nested:
        lines += ["", f"### `{prefix}{name}`", ""]
        summary = _field_docs(type(obj))[name][1]
        if summary:
            lines += [" ".join(summary.split()), ""]
        lines += _entries(value, f"{prefix}{name}.")
    return lines


def _deprecated(obj: Any, prefix: str) -> list[str]:
    """``key: docstring`` of every field whose docstring starts with "Deprecated"."""
    out: list[str] = []
    docs = _field_docs(type(obj))
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            out += _deprecated(value, f"{prefix}{f.name}.")
        elif docs[f.name][1].startswith("Deprecated"):
            out += textwrap.wrap(f"- `{prefix}{f.name}`: {' '.join(docs[f.name][1].split())}",
                                 width=100, subsequent_indent="  ", break_long_words=False,
                                 break_on_hyphens=False)
    return out


def _renamed_sections() -> list[str]:
    """A line per deprecated section name (``loading.SECTION_ALIASES``)."""
    from .loading import SECTION_ALIASES

    out: list[str] = []
    for old, new in SECTION_ALIASES.items():
        out += textwrap.wrap(f"- `{old}.*` (a section, and the config group `{old}`): `{new}.*` "
                             f"(`{old}=<option>` -> `{new}=<option>`), mapped at load time. "
                             "Removed in the next release.", width=100, subsequent_indent="  ",
                             break_long_words=False, break_on_hyphens=False)
    return out


def render() -> str:
    """The page's text."""
    job = JobConfig()
    out = [HEADER]
    for f in dataclasses.fields(job):
        section = getattr(job, f.name)
        doc = inspect.cleandoc(type(section).__doc__ or "")
        out += [f"## `{f.name}`", "", " ".join(doc.split()), ""]
        out += _entries(section, f"{f.name}.")
        out.append("")
    out += ["## Deprecated keys", "",
            "Each is a second name of another key: accepted for one release, mapped to the "
            "surviving", "name at load time with one warning line naming both (both set "
            "differently: one error", "naming both).", "", *_deprecated(job, ""),
            *_renamed_sections(), ""]
    return "\n".join(out).rstrip("\n") + "\n"


if __name__ == "__main__":
    print(render(), end="")
