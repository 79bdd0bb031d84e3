"""The run's configuration: the schema (one declaration per key: default, help, domain, resume
policy), loading from `configs/*.py` with `--config.key=value` overrides, validation, `--help`,
and the recipes the config files share.

    schema.py    sections as frozen dataclasses; base_config(), run_config(), derived tables
    load.py      config file -> overrides -> validate (parse_command / parse_args)
    validate.py  every key against its domain, then the cross-key rules
    help.py      --help and --dry-run's text
    recipes.py   official_config, learning_recipe, unit_overrides, TINY_MODEL_OVERRIDES

Only the trainer's layer (jaxloop.train, sft, evaluate) imports this package; the layers below
take their own settings (tests/test_layers.py).
"""

from jaxloop.config.help import HELP_WIDTH, USAGE, format_help, format_tree
from jaxloop.config.load import (
    CONFIGS_DIR,
    Command,
    apply_override,
    load_config_file,
    parse_args,
    parse_command,
    resolve_config_path,
)
from jaxloop.config.recipes import (
    ALGORITHM_CONFIGS,
    TINY_MODEL_OVERRIDES,
    learning_recipe,
    official_config,
    unit_overrides,
)
from jaxloop.config.schema import (
    DESCRIPTIONS,
    DOMAINS,
    RESUME_FREE_KEYS,
    SECTIONS,
    TYPES,
    RunConfig,
    base_config,
    default_logprob_diff,
    flat_items,
    run_config,
    schema_keys,
    upgrade_stored,
)
from jaxloop.config.validate import (
    LOG_LEVELS,
    LOOP_CREDITS,
    check_domains,
    check_early_exit,
    check_loop_credit,
    has_exit_gate,
    mesh_axis_sizes,
    validate,
    validate_mesh,
)
from jaxloop.errors import UsageError, UserCodeError
from jaxloop.models.loop_budget import check_loop_budget, loop_budget_at, parse_loop_budget
from jaxloop.settings import (
    ANY,
    FLOAT32_MAX,
    FREE,
    INT32_MAX,
    MATH,
    NON_NEGATIVE,
    Domain,
    count,
    knob,
    one_of,
    positive,
)

__all__ = [
    "ALGORITHM_CONFIGS",
    "ANY",
    "CONFIGS_DIR",
    "Command",
    "DESCRIPTIONS",
    "DOMAINS",
    "Domain",
    "FLOAT32_MAX",
    "FREE",
    "HELP_WIDTH",
    "INT32_MAX",
    "LOG_LEVELS",
    "LOOP_CREDITS",
    "MATH",
    "NON_NEGATIVE",
    "RESUME_FREE_KEYS",
    "RunConfig",
    "SECTIONS",
    "TYPES",
    "USAGE",
    "UsageError",
    "UserCodeError",
    "apply_override",
    "base_config",
    "check_domains",
    "check_early_exit",
    "check_loop_budget",
    "check_loop_credit",
    "count",
    "default_logprob_diff",
    "flat_items",
    "format_help",
    "format_tree",
    "has_exit_gate",
    "knob",
    "learning_recipe",
    "load_config_file",
    "loop_budget_at",
    "mesh_axis_sizes",
    "official_config",
    "one_of",
    "parse_args",
    "parse_command",
    "parse_loop_budget",
    "positive",
    "resolve_config_path",
    "run_config",
    "schema_keys",
    "unit_overrides",
    "TINY_MODEL_OVERRIDES",
    "upgrade_stored",
    "validate",
    "validate_mesh",
]
