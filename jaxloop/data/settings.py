"""The data section of the run's config (jaxloop.config composes the sections; each field's
default, help, domain and resume policy are declared here, once)."""

from __future__ import annotations

import dataclasses
from typing import Literal

from jaxloop.data.tasks import DEFAULT_TASK, Task
from jaxloop.settings import FREE, Domain, count, knob


@dataclasses.dataclass(frozen=True)
class DataSection:
    """prompts, tokenizer and reward"""

    source: str = knob(
        "builtin",
        "builtin (the built-in task) or a JSONL / Parquet file of {prompt, label}",
        Domain(nonempty=True),
    )
    eval_source: str = knob(
        "",
        (
            "a JSONL / Parquet file of held-out {prompt, label} to evaluate on; empty: the "
            "built-in task's held-out split (a file data.source then has no evaluation)"
        ),
        resume=FREE,
    )
    prompt_key: str = knob(
        "prompt",
        "the row's prompt field: a dotted path into nested rows (e.g. extra_info.question)",
        Domain(nonempty=True),
    )
    label_key: str = knob(
        "label",
        "the row's label field: a dotted path into nested rows (e.g. reward_model.ground_truth)",
        Domain(nonempty=True),
    )
    prompt_template: str = knob(
        "{prompt}",
        (
            "text of each string prompt: {prompt} and {FIELD} (a field of the row) are replaced, "
            "every other brace (as in \\boxed{}) stays as written"
        ),
        Domain(nonempty=True),
    )
    label_extract: Literal["none", "gsm8k"] = knob(
        "none",
        "none (the label as written) | gsm8k (the text after the last ####, without thousands "
        "separators)",
    )
    task: Task = knob(
        DEFAULT_TASK,
        (
            "built-in task: copy_first | copy_last | max_digit | min_digit | sum_mod10 | "
            "reverse | sort | add (multi-token answers)"
        ),
    )
    num_digits: int = knob(4, "built-in task: digits per prompt", count(1))
    tokenizer: str = knob(
        "auto",
        (
            "auto (the tokenizer of model.hf_dir, or of model.init_checkpoint's tokenizer/, "
            "when it has one; else char) | char (one token per character) | a local HF "
            "tokenizer dir"
        ),
        Domain(nonempty=True),
    )
    reward: str = knob(
        "exact_match",
        (
            "exact_match | prefix_match | format (partial credit for a right prefix of the "
            "answer) | math_verify | module:function"
        ),
        Domain(nonempty=True),
    )
    max_prompt_tokens: int = knob(
        32, "longest allowed prompt in tokens (checked before training)", count(1), resume=FREE
    )
