"""Docs that cannot drift: every `--config.KEY` in README.md and docs/*.md is a schema key, every
`python -m jaxloop...` / `python -m conversion...` / `python scripts/...` line in a fenced code
block uses only flags its own `--help` lists, and every relative markdown link resolves."""

import os
import re
import shlex
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from functools import cache
from pathlib import Path

from jaxloop.config import base_config, flat_items

REPO = Path(__file__).resolve().parent.parent
PAGES = [REPO / "README.md", REPO / "scripts" / "README.md", *sorted((REPO / "docs").glob("*.md"))]
KEYS = set(dict(flat_items(base_config())))
PLACEHOLDER_KEYS = {"KEY", "key"}
PYTHONS = {"python", "python3", sys.executable}
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def config_keys_named(text: str) -> set[str]:
    return set(re.findall(r"--config\.([A-Za-z_][\w.]*[A-Za-z_\d])", text))


def unknown_keys(text: str) -> list[str]:
    return sorted(config_keys_named(text) - KEYS - PLACEHOLDER_KEYS)


def fenced_lines(text: str) -> list[str]:
    """The lines of fenced code blocks, backslash continuations joined."""
    out, inside, pending = [], False, ""
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            inside, pending = not inside, ""
            continue
        if not inside:
            continue
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        out.append(pending + line)
        pending = ""
    return out


def commands(line: str) -> list[tuple[str, list[str]]]:
    """(entry point, its arguments) for each jaxloop / conversion / scripts command on a line:
    `jaxloop.train`, `conversion.to_hf`, `scripts/plan_memory.py`."""
    line = line.replace("[", " ").replace("]", " ")  # optional arguments written [--x=1]
    try:
        tokens = shlex.split(line, comments=True)
    except ValueError:
        tokens = line.split()
    found, i = [], 0
    while i < len(tokens):
        token = tokens[i]
        entry = None
        if Path(token).name in PYTHONS or token in PYTHONS:
            if tokens[i + 1 : i + 2] == ["-m"] and i + 2 < len(tokens):
                module = tokens[i + 2]
                if module.split(".")[0] in {"jaxloop", "conversion"}:
                    entry, i = module, i + 3
            elif i + 1 < len(tokens) and tokens[i + 1].startswith("scripts/"):
                entry, i = tokens[i + 1], i + 2
        if entry is None:
            i += 1
            continue
        args = []
        while i < len(tokens) and tokens[i] not in {"&&", "||", ";", "|", "--"}:
            if Path(tokens[i]).name in PYTHONS:
                break
            args.append(tokens[i])
            i += 1
        found.append((entry, args))
    return found


def flags(args: list[str]) -> set[str]:
    return {
        a.split("=", 1)[0] for a in args if a.startswith("--") and not a.startswith("--config.")
    }


@cache
def help_text(entry: str) -> str:
    argv = [sys.executable, entry] if entry.endswith(".py") else [sys.executable, "-m", entry]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    r = subprocess.run(
        [*argv, "--help"], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0, f"{entry} --help exited {r.returncode}: {r.stderr[-500:]}"
    return r.stdout


def unknown_flags(entry: str, args: list[str], help_out: str) -> list[str]:
    listed = set(re.findall(r"--[A-Za-z][\w-]*", help_out))
    return sorted(f for f in flags(args) if f not in listed)


def broken_links(page: Path, text: str) -> list[str]:
    broken = []
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue  # a URL or an anchor on the same page
        path = target.split("#", 1)[0]
        if not (page.parent / path).exists():
            broken.append(target)
    return broken


def _where(page: Path) -> str:
    return str(page.relative_to(REPO))


def test_every_config_key_in_the_docs_exists():
    found = {}
    for page in PAGES:
        for key in unknown_keys(page.read_text()):
            found.setdefault(_where(page), []).append(key)
    assert sum(len(config_keys_named(p.read_text())) for p in PAGES) > 30  # it sees the keys
    assert not found, f"config keys that are not in the schema: {found}"


def test_every_command_in_a_code_block_uses_its_parsers_flags():
    uses = [
        (_where(page), line, entry, args)
        for page in PAGES
        for line in fenced_lines(page.read_text())
        for entry, args in commands(line)
    ]
    entries = sorted({entry for _, _, entry, _ in uses})
    assert "jaxloop.train" in entries and "scripts/learning_check.py" in entries
    with ThreadPoolExecutor(2) as pool:  # one --help per entry point, two at a time (2 cores)
        helps = dict(zip(entries, pool.map(help_text, entries), strict=True))
    bad = []
    for where, line, entry, args in uses:
        stale = unknown_flags(entry, args, helps[entry])
        stale += [f"--config.{k}" for k in unknown_keys(" ".join(args))]
        if stale:
            bad.append(f"{where}: {stale} in: {line.strip()}")
    assert not bad, "\n".join(bad)


def test_every_relative_link_resolves():
    bad = {_where(p): broken_links(p, p.read_text()) for p in PAGES}
    bad = {k: v for k, v in bad.items() if v}
    assert not bad, f"links to files that do not exist: {bad}"


def test_the_checks_catch_a_made_up_key_flag_and_link(tmp_path):
    block = "```bash\npython -m jaxloop.train --config grpo.py --no-such-flag \\\n"
    block += "  --config.algo.no_such_key=1 --config.seed=3  # a comment --ignored\n```\n"
    ((entry, args),) = commands(fenced_lines(block)[0])
    assert entry == "jaxloop.train"
    assert unknown_keys(" ".join(args)) == ["algo.no_such_key"]
    assert unknown_flags(entry, args, "usage: --config FILE --dry-run --help") == ["--no-such-flag"]
    assert commands("python3 scripts/plan_memory.py --seq 4 && python -m pytest -q") == [
        ("scripts/plan_memory.py", ["--seq", "4"])
    ]
    page = tmp_path / "page.md"
    (tmp_path / "there.md").write_text("")
    text = "[ok](there.md#a) [web](https://x.org) [gone](missing.md) [self](#top)"
    assert broken_links(page, text) == ["missing.md"]
