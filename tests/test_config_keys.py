"""Every config key is described once (its `knob` help in its layer's section,
jaxloop/*/settings.py or jaxloop/config/schema.py), `--help` lists every key with its default and
description, and the README names no key that does not exist."""

import re
from pathlib import Path

import pytest

from jaxloop.config import (
    DESCRIPTIONS,
    SECTIONS,
    base_config,
    flat_items,
    format_help,
    load_config_file,
)
from jaxloop.train.cli import main

REPO = Path(__file__).resolve().parent.parent
# the README and the docs pages it moved into (tests/test_docs.py checks their commands and links)
DOC_PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
KEYS = dict(flat_items(base_config()))
# backticked names in the README that look like `section.key` but are not config keys
NOT_CONFIG_KEYS = {
    "model.norm",  # Nanbeige's final-norm weight name
    "learner.old_logprobs",  # Learner methods (docs/architecture.md)
    "learner.place_batch",
    "model.safetensors",  # HF file names
    "model.safetensors.index.json",
}


def test_every_key_has_a_description_and_none_is_stale():
    missing = sorted(set(KEYS) - set(DESCRIPTIONS))
    stale = sorted(set(DESCRIPTIONS) - set(KEYS))
    assert not missing, f"keys without a description (knob help): {missing}"
    assert not stale, f"DESCRIPTIONS of keys that do not exist: {stale}"
    assert all(text.strip() and "\n" not in text for text in DESCRIPTIONS.values())
    sections = {k.rsplit(".", 1)[0] if "." in k else "" for k in KEYS}
    assert sections == set(SECTIONS), "SECTIONS must describe exactly the config's sections"


def test_one_default_task():
    from jaxloop.data.datasets import make_source
    from jaxloop.data.tasks import DEFAULT_TASK, BuiltinTask

    assert KEYS["data.task"] == DEFAULT_TASK == BuiltinTask().name == "copy_first"
    # a data config without a task gets the same one
    assert make_source({"source": "builtin"}).state()["task"] == KEYS["data.task"]


def test_flat_items_is_in_definition_order():
    keys = list(KEYS)
    assert keys[:3] == ["run_dir", "seed", "algorithm"]
    assert keys.index("model.hf_dir") < keys.index("model.vocab_size") < keys.index("data.source")


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_help_lists_every_key_with_default_and_description(capsys, tmp_path, monkeypatch, flag):
    monkeypatch.chdir(tmp_path)
    code = main([flag])
    out, err = capsys.readouterr()
    assert code == 0 and err == ""
    assert out.startswith("usage: python -m jaxloop.train --config")
    assert "--dry-run" in out
    lines = out.splitlines()
    for key, value in KEYS.items():
        at = [i for i, line in enumerate(lines) if line.strip().startswith(f"{key}=")]
        assert len(at) == 1, f"{key} is not listed once in --help"
        assert lines[at[0]].strip().startswith(f"{key}={value!r}")
        # the description, possibly wrapped onto the following lines
        text = " ".join(line.strip() for line in lines[at[0] : at[0] + 4])
        first_words = " ".join(DESCRIPTIONS[key].split()[:3])
        assert first_words in text, (key, text)
    for section, text in SECTIONS.items():
        assert f"[{section or 'top level'}] {text}" in out
    assert list(tmp_path.iterdir()) == []  # nothing written


def test_help_shows_the_named_configs_values(capsys):
    assert main(["--config", "grpo.py", "--help"]) == 0
    out = capsys.readouterr().out
    assert "keys (values of grpo.py)" in out and "algorithm='grpo'" in out
    assert format_help(load_config_file("grpo.py"), "grpo.py") == out.rstrip("\n")


def _readme_keys(text: str) -> set[str]:
    """Config keys the README names: `--config.KEY` anywhere, and `section.key` in backticks
    for the config's sections."""
    found = set(re.findall(r"--config\.([A-Za-z_][\w.]*[A-Za-z_\d])", text))
    sections = {s for s in SECTIONS if s}
    for token in re.findall(r"`([a-z_]+(?:\.[a-z_]+)+)`", text):
        if token.split(".")[0] in sections:
            found.add(token)
    return found


def test_readme_names_only_existing_keys():
    text = "\n".join(page.read_text() for page in DOC_PAGES)
    named = _readme_keys(text)
    assert len(named) > 10  # the check sees the README's keys (not an empty set)
    unknown = sorted(named - set(KEYS) - NOT_CONFIG_KEYS - {"key", "KEY"})  # the placeholder
    assert not unknown, f"README.md or docs/ name config keys that do not exist: {unknown}"
    assert "--help" in text and "--dry-run" in text


def test_readme_check_catches_a_stale_key():
    assert _readme_keys("set `rollout.no_such_key` or --config.algo.nope=1") == {
        "rollout.no_such_key",
        "algo.nope",
    }
