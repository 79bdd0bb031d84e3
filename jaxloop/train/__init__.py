"""Training: `python -m jaxloop.train --config flow_dppo.py [--config.key=value ...]`.

cli.py (the command line, checks before anything is written), setup.py (config -> learner, state
and rollout source), loop.py (`Trainer`), hooks.py (eval, log-prob check, draft features,
metrics, checkpoints around each update), checkpoint.py (save, restore, resume checks),
consistency.py (the checks of one update).
"""


def main(argv: list[str] | None = None) -> int:
    """The `jaxloop-train` entry point (jaxloop.train.cli.main)."""
    from jaxloop.train.cli import main as cli_main

    return cli_main(argv)
