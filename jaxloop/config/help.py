"""`--help` and `--dry-run`'s text, rendered from the schema."""

from __future__ import annotations

import textwrap
from typing import Any

import ml_collections

from jaxloop.config.schema import DESCRIPTIONS, SECTIONS, base_config, flat_items

HELP_WIDTH = 100

USAGE = "usage: python -m jaxloop.train --config NAME_OR_PATH [--config.key=value ...] [--dry-run]"


def _by_section(cfg) -> dict[str, list[tuple[str, Any]]]:
    sections: dict[str, list[tuple[str, Any]]] = {}
    for key, value in flat_items(cfg):
        section = key.rsplit(".", 1)[0] if "." in key else ""
        sections.setdefault(section, []).append((key, value))
    return sections


def format_help(cfg: ml_collections.ConfigDict | None = None, config_name: str = "") -> str:
    """Usage, the flags and every key by section with its value in `cfg` (default:
    base_config()) and its description."""
    cfg = base_config() if cfg is None else cfg
    source = config_name or "base_config(); configs/*.py change some"
    lines = [
        USAGE,
        "",
        "  --config NAME_OR_PATH   a config file (a bare name resolves in configs/)",
        "  --config.KEY=VALUE      override one key (also --config.KEY VALUE)",
        "  --dry-run               load, override and validate; print the resolved config; "
        "write nothing",
        "  -h, --help              this list",
        "",
        f"keys (values of {source}):",
    ]
    for section, items in _by_section(cfg).items():
        lines.append("")
        lines.append(f"[{section or 'top level'}] {SECTIONS.get(section, '')}".rstrip())
        cells = [(f"{key}={value!r}", DESCRIPTIONS.get(key, "")) for key, value in items]
        width = min(max(len(c) for c, _ in cells) + 2, 44)
        for cell, text in cells:
            wrapped = textwrap.wrap(text, max(40, HELP_WIDTH - width - 2)) or [""]
            if len(cell) > width - 2:  # a long value: the description starts on the next line
                lines.append(f"  {cell}")
                wrapped_first = []
            else:
                lines.append(f"  {cell:<{width}}{wrapped[0]}".rstrip())
                wrapped_first = wrapped[:1]
            lines.extend(" " * (width + 2) + w for w in wrapped[len(wrapped_first) :])
    return "\n".join(lines)


def format_tree(cfg: ml_collections.ConfigDict, base: ml_collections.ConfigDict | None = None):
    """The resolved config by section, `key = value`; values that differ from `base`
    (default: base_config()) are marked with the default."""
    base = dict(flat_items(base_config() if base is None else base))
    lines = []
    for section, items in _by_section(cfg).items():
        lines.append(f"{section or 'top level'}:")
        for key, value in items:
            name = key.rsplit(".", 1)[-1]
            mark = f"  # default {base[key]!r}" if key in base and base[key] != value else ""
            lines.append(f"  {name} = {value!r}{mark}")
    return "\n".join(lines)
