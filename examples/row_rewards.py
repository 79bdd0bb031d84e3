"""A reward function that reads a column of its row (docs/data.md, "Reward functions").

    --config.data.reward=examples.row_rewards:gsm8k_steps

Raw GSM8K rows `{question, answer}`: with `data.label_extract=gsm8k` the label is the number after
the answer's `####`, and the row still holds the worked answer with its `<<48/2=24>>` steps.
"""

from __future__ import annotations

import re

from jaxloop.data.rewards import math_verify_reward

_STEP = re.compile(r"<<([^=>]+)=([^>]+)>>")


def gsm8k_steps(response: str, label: str, *, row: dict) -> float:
    """1 for the right final answer (math_verify); else 0.5 for a response that carries out one
    of the worked answer's steps (`48/2=24`, spaces ignored); else 0."""
    if math_verify_reward(response, label) == 1.0:
        return 1.0
    said = response.replace(" ", "")
    steps = _STEP.findall(str(row.get("answer", "")))
    return 0.5 if any(f"{lhs}={rhs}".replace(" ", "") in said for lhs, rhs in steps) else 0.0
