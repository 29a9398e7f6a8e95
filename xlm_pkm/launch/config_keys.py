"""Every config key with its default and its one-line doc, read from the settings dataclasses (config.Config
and the sections it composes, each beside its component's code) and the comments beside their fields, so
the list cannot go stale (train.py --keys [SECTION]: the values of the config the command would train, the
built-in default beside where it differs)."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import io
import json
import textwrap
import tokenize

from xlm_pkm.config import Config, flat, to_dict
from xlm_pkm.errors import ConfigError


def field_docs(cls) -> dict[str, str]:
    """{field: its comment in the source}: the comment ending the field's lines, else the comment lines
    just above it."""
    source = textwrap.dedent(inspect.getsource(cls))
    full_line, trailing = {}, {}  # line number -> comment text
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            text = tok.string.lstrip("#").strip()
            (full_line if tok.line.strip().startswith("#") else trailing)[tok.start[0]] = text
    docs = {}
    for node in ast.parse(source).body[0].body:
        if isinstance(node, ast.AnnAssign):
            above, line = [], node.lineno - 1
            while line in full_line:
                above.insert(0, full_line[line])
                line -= 1
            docs[node.target.id] = trailing.get(node.end_lineno) or " ".join(above)
    return docs


def _default(f: dataclasses.Field):
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


def keys(cls=Config, prefix: str = "") -> list[tuple[str, object, str]]:
    """(dotted key, default, doc) of every leaf of `cls`, nested sections in place."""
    docs, out = field_docs(cls), []
    for f in dataclasses.fields(cls):
        value = _default(f)
        if dataclasses.is_dataclass(value):
            out += keys(type(value), f"{prefix}{f.name}.")
        else:
            out.append((f"{prefix}{f.name}", value, docs.get(f.name, "")))
    return out


def describe_keys(section: str = "", cfg: Config | None = None) -> str:
    """The keys of `section` (model, model.memory, optim...; empty: all), one per line: `key = value  # doc`, as
    they are written in overrides (key=value) and YAML files; the value is `cfg`'s (a resolved config: what a
    command would train), with the built-in default after the doc where it differs; the default without `cfg`."""
    values = flat(to_dict(cfg)) if cfg is not None else {}
    rows = [(k, values.get(k, v), d + (f" (built-in default {json.dumps(v)})" if values.get(k, v) != v else ""))
            for k, v, d in keys() if not section or k == section or k.startswith(section + ".")]
    if not rows:
        sections = sorted({k.rsplit(".", 1)[0] for k, _, _ in keys() if "." in k})
        raise ConfigError(f"--keys {section}: no such section (sections: {', '.join(sections)})")
    width = max(len(f"{k} = {json.dumps(v)}") for k, v, _ in rows)
    return "\n".join((f"{k} = {json.dumps(v)}".ljust(width) + f"  # {d}" if d else f"{k} = {json.dumps(v)}")
                     for k, v, d in rows)
