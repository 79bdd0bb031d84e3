"""GSM8K rows ({question, answer "... #### 72"}) -> jaxloop's {prompt, label} rows.

    python examples/gsm8k_to_prompt_label.py IN.jsonl OUT.jsonl

The label is the text after the answer's last `####`, thousands separators removed (what
`data.label_extract=gsm8k` does without this step, once the data keys of issue 36 are in).
Errors: one `error: ...` line naming file and row, exit code 2, nothing written.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def convert(src: Path) -> list[dict]:
    rows = []
    for n, line in enumerate(src.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{src}:{n}: invalid JSON ({err.msg})") from None
        question, answer = row.get("question"), row.get("answer")
        if not isinstance(question, str) or not isinstance(answer, str) or "####" not in answer:
            raise ValueError(f"{src}:{n}: needs a string 'question' and an 'answer' with '####'")
        label = answer.rsplit("####", 1)[1].strip().replace(",", "")
        rows.append({"prompt": question, "label": label})
    if not rows:
        raise ValueError(f"{src}: no rows")
    return rows


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print("error: usage: gsm8k_to_prompt_label.py IN.jsonl OUT.jsonl", file=sys.stderr)
        return 2
    src, out = Path(argv[0]), Path(argv[1])
    try:
        if not src.is_file():
            raise ValueError(f"{src}: no such file")
        rows = convert(src)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"wrote {out}: {len(rows)} rows")
    return 0


if __name__ == "__main__":
    sys.exit(main())
