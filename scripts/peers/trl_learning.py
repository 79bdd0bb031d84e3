"""Run with the TRL venv (scripts/learning_check.py does). TRL's GRPOTrainer learning the problem
a jaxloop GRPO run learns: the same function and initial weights (trl_grpo.build_model, checked
against jaxloop's logits), the same prompts in the same order, the same `format` reward, and a
greedy eval on jaxloop's held-out prompts every `eval_every` updates.

    python scripts/peers/trl_learning.py --prep PREP_DIR --settings settings.json --out curve.json

PREP_DIR comes from scripts/peers/jaxloop_prep.py (with --warm for a warm-started start);
settings.json is learning_check.trl_settings(cfg) of jaxloop's resolved config: GRPOConfig
arguments ("grpo") plus the run's shape ("updates", "eval_every", "max_new_tokens", "seed").
An update is one generation batch split into `steps_per_generation` optimizer steps (jaxloop's
updates_per_rollout: each step on its part of the batch), so TRL's global_step is update x
steps_per_update. Writes
{"curve": [[update, greedy eval reward], ...], "steps": [TRL's per-step logs]} to --out.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from trl_grpo import (  # noqa: E402
    build_model,
    build_tokenizer,
    char_decoder,
    check_reference,
    format_reward,
    prompt_dataset,
    reward_format_for,
)


def greedy_eval(model, tok, decode, examples: list[dict], max_new_tokens: int) -> float:
    """Mean `format` reward of greedy answers (up to max_new_tokens, stopping at EOS) to the
    held-out prompts, their ids as jaxloop encodes them, left-padded in one batch; the answers
    decoded as jaxloop decodes them (`decode`: trl_grpo.char_decoder)."""
    import torch

    width = max(len(e["ids"]) for e in examples)
    ids = torch.tensor([[tok.pad_token_id] * (width - len(e["ids"])) + e["ids"] for e in examples])
    mask = (
        torch.arange(width)[None, :]
        >= width - torch.tensor([len(e["ids"]) for e in examples])[:, None]
    ).long()
    was_training = model.training
    model.eval()
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            do_sample=False,
            max_new_tokens=max_new_tokens,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
        )
    model.train(was_training)
    rewards = []
    for row, example in zip(out[:, width:].tolist(), examples, strict=True):
        if tok.eos_token_id in row:
            row = row[: row.index(tok.eos_token_id)]
        rewards.append(format_reward(decode(row), example["label"]))
    return sum(rewards) / len(rewards)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prep", required=True)
    ap.add_argument("--settings", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    started = time.perf_counter()

    import torch

    torch.set_num_threads(args.threads)
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    settings = json.loads(Path(args.settings).read_text())
    prep = Path(args.prep)
    tok = build_tokenizer(prep)
    decode = char_decoder(json.loads((prep / "tokenizer.json").read_text()))
    prompts = json.loads((prep / "prompts.json").read_text())
    evals = json.loads((prep / "eval.json").read_text())
    for p in prompts[:16] + evals[:16]:
        if tok(p["prompt"])["input_ids"] != p["ids"]:
            raise RuntimeError(f"tokenizer: {p['prompt']!r} differs from jaxloop's {p['ids']}")
    torch.manual_seed(settings["seed"])
    model, _ = build_model(prep)
    logits_diff = check_reference(model, prep)
    grpo = settings["grpo"]
    updates, iterations = settings["updates"], settings["steps_per_update"]
    dataset = prompt_dataset(prompts, updates * settings["prompts_per_update"], prep)
    config = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="trl_learning_"),
        max_steps=updates * iterations,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        bf16=False,
        fp16=False,
        gradient_checkpointing=False,
        use_cpu=True,
        seed=settings["seed"],
        data_seed=settings["seed"],
        shuffle_dataset=False,  # jaxloop's prompt order
        dataloader_num_workers=0,
        disable_tqdm=True,
        log_completions=False,
        use_vllm=False,
        **grpo,
    )
    curve: list[list[float]] = []
    step_logs: list[dict] = []
    every, max_new = settings["eval_every"], settings["max_new_tokens"]

    class Evaluate(TrainerCallback):
        def on_train_begin(self, args_, state, control, model=None, **kw):
            curve.append([0, greedy_eval(model, tok, decode, evals, max_new)])

        def on_step_end(self, args_, state, control, model=None, **kw):
            update, rest = divmod(state.global_step, iterations)
            if not rest and update % every == 0 and update < updates:
                curve.append([update, greedy_eval(model, tok, decode, evals, max_new)])

        def on_train_end(self, args_, state, control, model=None, **kw):
            curve.append([updates, greedy_eval(model, tok, decode, evals, max_new)])

        def on_log(self, args_, state, control, logs=None, **kw):
            if logs and "reward" in logs:
                step_logs.append({"step": state.global_step, **logs})

    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward_format_for(prep),
        args=config,
        train_dataset=dataset,
        processing_class=tok,
        callbacks=[Evaluate()],
    )
    trainer.train()
    result = {
        "system": "trl",
        "logits_max_abs_diff_vs_jaxloop": logits_diff,
        "seconds": time.perf_counter() - started,
        "curve": curve,
        "steps": step_logs,
    }
    Path(args.out).write_text(json.dumps(result))
    print(json.dumps({k: v for k, v in result.items() if k != "steps"}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
