"""Loading: a config file (`configs/*.py` or a path) -> `--config.key=value` overrides ->
validation. `python -m jaxloop.train --config flow_dppo.py --config.optim.lr=3e-3`: a bare name
resolves in the repository's `configs/`, a path works too. Unknown keys and values of the wrong
type are errors (UsageError: one line, exit code 2)."""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
from pathlib import Path
from typing import Any

import ml_collections

from jaxloop.config.help import USAGE, format_help
from jaxloop.config.schema import TYPES
from jaxloop.config.validate import _missing_keys, validate
from jaxloop.errors import UsageError, UserCodeError

CONFIGS_DIR = Path(__file__).resolve().parents[2] / "configs"


def resolve_config_path(name: str) -> Path:
    path = Path(name)
    if path.is_file():
        return path
    for candidate in (CONFIGS_DIR / name, CONFIGS_DIR / f"{name}.py"):
        if candidate.is_file():
            return candidate
    raise UsageError(f"config file {name!r} not found (looked in . and {CONFIGS_DIR})")


def load_config_file(name: str) -> ml_collections.ConfigDict:
    path = resolve_config_path(name)
    spec = importlib.util.spec_from_file_location(f"jaxloop_config_{path.stem}", path)
    if spec is None or spec.loader is None:
        raise UserCodeError(f"config file {path} is not a Python file")
    module = importlib.util.module_from_spec(spec)
    try:  # user code: whatever it raises is reported in one line naming the file
        spec.loader.exec_module(module)
        if not hasattr(module, "get_config"):
            raise UsageError(f"config file {path} has no get_config()")
        cfg = module.get_config()
    except UsageError:
        raise
    except Exception as err:  # noqa: BLE001 - SyntaxError included
        raise UserCodeError(f"config file {path}: {_exception_text(err)}") from err
    if not isinstance(cfg, ml_collections.ConfigDict):
        raise UserCodeError(
            f"config file {path}: get_config() returned {type(cfg).__name__}, not a "
            "ml_collections.ConfigDict (start from jaxloop.config.base_config())"
        )
    missing = _missing_keys(cfg)
    if missing:
        raise UserCodeError(
            f"config file {path}: get_config() lacks key(s) {', '.join(missing[:5])} (start "
            "from jaxloop.config.base_config())"
        )
    cfg.lock()
    return cfg


def _exception_text(err: BaseException) -> str:
    """`Type: first line of the message` (SyntaxError: with its line number)."""
    text = str(err).strip().splitlines()[0] if str(err).strip() else ""
    if isinstance(err, SyntaxError) and err.lineno is not None:
        text = f"{err.msg} (line {err.lineno})"
    return f"{type(err).__name__}: {text}" if text else type(err).__name__


def _parse_value(raw: str, current: Any, key: str) -> Any:
    """The command line's text as a value of the key's declared type (TYPES; a key the schema
    does not declare: the type of its current value). `None` (any case) is the value None of a
    key that takes it."""
    kind = TYPES.get(key)
    if kind is not None and kind.optional and raw.strip().lower() == "none":
        return None
    base = kind.base if kind is not None else type(current)
    if base is bool:
        low = raw.lower()
        if low in ("true", "1", "yes"):
            return True
        if low in ("false", "0", "no"):
            return False
        raise UsageError(f"--config.{key}: expected a boolean, got {raw!r}")
    for number, noun in ((int, "an integer"), (float, "a number")):
        if base is number:
            try:
                return number(raw)
            except ValueError:
                also = " or None" if kind is not None and kind.optional else ""
                raise UsageError(f"--config.{key}: expected {noun}{also}, got {raw!r}") from None
    if base is str:
        return raw
    try:
        value = ast.literal_eval(raw)
    except (ValueError, SyntaxError):
        raise UsageError(f"--config.{key}: cannot parse {raw!r}") from None
    if not isinstance(value, type(current)):
        raise UsageError(f"--config.{key}: expected {type(current).__name__}, got {raw!r}")
    return value


def apply_override(cfg: ml_collections.ConfigDict, key: str, raw: str) -> None:
    parts = key.split(".")
    node = cfg
    for i, part in enumerate(parts):
        if not isinstance(node, ml_collections.ConfigDict) or part not in node:
            raise UsageError(f"unknown config key {'.'.join(parts[: i + 1])!r}")
        if i < len(parts) - 1:
            node = node[part]
    current = node[parts[-1]]
    if isinstance(current, ml_collections.ConfigDict):
        raise UsageError(f"--config.{key} is a section, not a value")
    with node.unlocked():
        node[parts[-1]] = _parse_value(raw, current, key)


@dataclasses.dataclass
class Command:
    """A parsed command line: the validated config (None with --help), and the flags."""

    cfg: ml_collections.ConfigDict | None
    dry_run: bool = False
    help: str = ""  # with -h / --help: the text to print (nothing else is done)


def parse_args(argv: list[str]) -> ml_collections.ConfigDict:
    """`--config NAME` then any number of `--config.key=value` / `--config.key value`."""
    command = parse_command(argv)
    if command.help:
        raise UsageError(USAGE)
    return command.cfg


def parse_command(argv: list[str]) -> Command:
    """parse_args plus `--dry-run` and `-h` / `--help` (help wins over everything else; with
    `--config NAME` it shows that config's values)."""
    if "-h" in argv or "--help" in argv:
        name = _config_name(argv)
        cfg = load_config_file(name) if name else None
        return Command(None, help=format_help(cfg, name or ""))
    dry_run = "--dry-run" in argv
    return Command(_parse_config(argv), dry_run=dry_run)


def _config_name(argv: list[str]) -> str | None:
    for i, arg in enumerate(argv):
        if arg.startswith("--config="):
            return arg.split("=", 1)[1]
        if arg == "--config" and i + 1 < len(argv):
            return argv[i + 1]
    return None


def _parse_config(argv: list[str]) -> ml_collections.ConfigDict:
    config_name = None
    overrides: list[tuple[str, str]] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--dry-run":
            i += 1
            continue
        if arg == "--config" or arg.startswith("--config="):
            if "=" in arg:
                config_name = arg.split("=", 1)[1]
            else:
                if i + 1 >= len(argv):
                    raise UsageError("--config needs a value")
                config_name = argv[i + 1]
                i += 1
        elif arg.startswith("--config."):
            body = arg[len("--config.") :]
            if "=" in body:
                key, value = body.split("=", 1)
            else:
                if i + 1 >= len(argv):
                    raise UsageError(f"{arg} needs a value")
                key, value = body, argv[i + 1]
                i += 1
            overrides.append((key, value))
        else:
            raise UsageError(f"unexpected argument {arg!r}")
        i += 1
    if config_name is None:
        raise UsageError("missing --config (e.g. --config flow_dppo.py)")
    cfg = load_config_file(config_name)
    for key, value in overrides:
        apply_override(cfg, key, value)
    validate(cfg)
    return cfg
