"""Run with the TRL venv (scripts/bench_peers.py does). TRL's GRPOTrainer (transformers
`generate`, no vLLM) training exactly the function a jaxloop run trains, from the same initial
weights, on the same prompts.

    python scripts/peers/trl_grpo.py --prep PREP_DIR --out steps.json [--steps 14] [--threads 2]

PREP_DIR comes from scripts/peers/jaxloop_prep.py (jaxloop's python): the actor jaxloop
initialises for the same command line (HF fp32 checkpoint), its prompts in order, its char
tokenizer ids and reference logits.

Matched with jaxloop's benchmark run:
  - the model: a transformers LlamaForCausalLM with num_layers x num_loops decoder layers whose
    layer l + i * num_layers *shares its parameters* with layer l (one copy of the looped
    weights, one AdamW state, gradients summed over loops), each with its own KV-cache slot;
    when the looped model applies model.norm after every loop (jaxloop's built-in model), a
    forward hook applies the same shared norm after the last layer of every loop but the last.
    Before training the script checks that its logits equal jaxloop's reference logits.
  - the tokenizer: character-level PreTrainedTokenizerFast with jaxloop's ids (pad 0, bos 1,
    eos 2, the alphabet from 3, unused ids up to vocab_size), BOS prepended: the same prompt ids.
  - the work: 8 prompts x 8 samples per step, temperature 1.0, no top-p/top-k, up to 32 new
    tokens stopping at EOS, one micro-batch of 64 and one optimizer step per rollout
    (num_iterations=1: no old-log-prob forward), beta 0 (no reference model), AdamW lr 1e-3
    constant, betas (0.9, 0.99), eps 1e-8, weight decay 0, grad clip 1.0, PPO clip 0.2,
    loss_type "grpo" (per-sequence token mean = jaxloop's seq_mean_token_mean), group-std
    advantages, jaxloop's `format` reward, fp32, no gradient checkpointing.

Timings per optimizer step (one generation per step, one optimizer step per rollout batch):
  rollout  GRPOTrainer._generate_and_score_completions (generate, decode, rewards, advantages)
  generate the model's `generate` call inside it
  update   the rest of the step: forward + backward of the loss, grad clip, AdamW step
  step     on_step_begin -> on_step_end (everything of one optimizer step)
and the completion lengths (tokens; per row min / median / max and the share stopped at the cap,
as jaxloop's producer reports them), the prompts' real tokens and the padded tokens the learner
computes. Written as JSON to --out. --max-new-tokens, --prompts-per-step and --lr follow the
benchmark's workload (bench_peers.py passes them: --workload long, --curve).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path


def build_tokenizer(prep: Path):
    from tokenizers import Tokenizer, decoders, models, processors
    from transformers import PreTrainedTokenizerFast

    t = json.loads((prep / "tokenizer.json").read_text())
    vocab = {s: i for i, s in enumerate(t["specials"])}
    for i, c in enumerate(t["alphabet"]):
        vocab[c] = len(t["specials"]) + i
    for i in range(len(vocab), t["vocab_size"]):
        vocab[f"<unused{i}>"] = i
    bos, eos, pad = (t["specials"][t[k]] for k in ("bos_id", "eos_id", "pad_id"))
    # BPE without merges and without a pre-tokenizer: one token per character (space included)
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None))
    core.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", special_tokens=[(bos, t["bos_id"])]
    )
    core.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core, bos_token=bos, eos_token=eos, pad_token=pad, padding_side="left"
    )
    tok.add_special_tokens(
        {
            "additional_special_tokens": [
                f"<unused{i}>"
                for i in range(len(t["specials"]) + len(t["alphabet"]), t["vocab_size"])
            ]
        }
    )
    return tok


def _set_param(module, dotted: str, param) -> None:
    *path, leaf = dotted.split(".")
    for p in path:
        module = getattr(module, p)
    setattr(module, leaf, param)


def build_model(prep: Path):
    import torch
    from safetensors.torch import load_file
    from transformers import LlamaConfig, LlamaForCausalLM

    hf = json.loads((prep / "model" / "config.json").read_text())
    layers, loops = hf["num_hidden_layers"], hf.get("num_loops", 1)
    norm_between = loops > 1 and not hf.get("skip_loop_final_norm", False)
    config = LlamaConfig(
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"],
        num_hidden_layers=layers * loops,
        num_attention_heads=hf["num_attention_heads"],
        num_key_value_heads=hf["num_key_value_heads"],
        head_dim=hf["head_dim"],
        rms_norm_eps=hf["rms_norm_eps"],
        rope_theta=hf["rope_theta"],
        max_position_embeddings=hf["max_position_embeddings"],
        tie_word_embeddings=False,
        attention_bias=False,
        mlp_bias=False,
        bos_token_id=hf["bos_token_id"],
        eos_token_id=hf["eos_token_id"],
        pad_token_id=hf["pad_token_id"],
        dtype="float32",
    )
    model = LlamaForCausalLM(config).to(torch.float32)
    tensors = {}
    for shard in sorted((prep / "model").glob("*.safetensors")):
        tensors.update(load_file(str(shard)))
    state = {}
    for name, value in tensors.items():
        if name.startswith("model.layers."):
            layer, rest = name[len("model.layers.") :].split(".", 1)
            if int(layer) >= layers:
                raise RuntimeError(f"unexpected tensor {name}")
        state[name] = value.to(torch.float32)
    missing, unexpected = model.load_state_dict(state, strict=False)
    deeper = [m for m in missing if int(m.split(".")[2]) >= layers] if missing else []
    if unexpected or set(missing) - set(deeper) - {m for m in missing if "rotary" in m}:
        raise RuntimeError(f"missing {missing}, unexpected {unexpected}")
    # share the loop-0 layers' parameters with the deeper loops' layers (the looped model)
    decoder = model.model.layers
    for loop in range(1, loops):
        for layer in range(layers):
            for pname, param in decoder[layer].named_parameters():
                _set_param(decoder[layer + loop * layers], pname, param)
    if norm_between:  # model.norm after every loop but the last (the final one is LlamaModel's)

        def norm_hook(module, args, output):
            if isinstance(output, tuple):
                return (model.model.norm(output[0]), *output[1:])
            return model.model.norm(output)

        for loop in range(loops - 1):
            decoder[(loop + 1) * layers - 1].register_forward_hook(norm_hook)
    info = {
        "physical_layers": layers,
        "loops": loops,
        "unrolled_layers": layers * loops,
        "norm_between_loops": norm_between,
        "unique_parameters": sum(p.numel() for p in model.parameters()),
        "attn_implementation": model.config._attn_implementation,
    }
    return model, info


def check_reference(model, prep: Path) -> float:
    import numpy as np
    import torch

    ref = np.load(prep / "reference.npz")
    with torch.no_grad():
        ids = torch.from_numpy(ref["ids"].astype(np.int64))
        logits = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits.numpy()
    diff = float(np.abs(logits - ref["logits"]).max())
    if diff > 1e-3:
        raise RuntimeError(f"logits differ from jaxloop's by {diff}")
    return diff


def format_reward(response: str, label: str) -> float:
    """jaxloop's `format` reward (jaxloop/data/rewards.py), the same arithmetic."""
    response, label = response.strip(), label.strip()
    if response == label:
        return 1.0
    prefix = 0
    for a, b in zip(response, label, strict=False):
        if a != b:
            break
        prefix += 1
    return 0.5 * prefix / max(len(label), 1)


def prompt_dataset(prompts: list[dict], need: int, prep: Path):
    """The first `need` of jaxloop's prompts, in order, as the datasets.Dataset GRPOTrainer reads
    ({prompt, label}; the label reaches the reward as a column)."""
    import datasets

    if len(prompts) < need:
        raise RuntimeError(f"{len(prompts)} prompts in {prep}, {need} needed")
    return datasets.Dataset.from_list(
        [{"prompt": p["prompt"], "label": p["label"]} for p in prompts[:need]]
    )


UNUSED_CHAR = "\N{REPLACEMENT CHARACTER}"  # jaxloop's CharTokenizer for an id past its alphabet


def char_decoder(tokenizer_json: dict):
    """`decode(ids) -> str` as jaxloop's CharTokenizer decodes (jaxloop/data/tokenizer.py): pad,
    bos and eos dropped, an alphabet id its character, any other id U+FFFD. Not the HF
    tokenizer's decode: it marks the ids past the alphabet special and `skip_special_tokens`
    drops them, so "3<unused>2" would read "32" (a right answer) where jaxloop reads "3?2"."""
    t = tokenizer_json
    skip = {t["pad_id"], t["bos_id"], t["eos_id"]}
    first = len(t["specials"])
    alphabet = t["alphabet"]

    def decode(ids) -> str:
        out = []
        for i in ids:
            i = int(i)
            if i in skip:
                continue
            out.append(alphabet[i - first] if first <= i < first + len(alphabet) else UNUSED_CHAR)
        return "".join(out)

    return decode


def reward_format_for(prep: Path):
    """jaxloop's `format` reward as a TRL reward function: of the completion's ids decoded as
    jaxloop decodes them (char_decoder), not of TRL's decoded text."""
    decode = char_decoder(json.loads((prep / "tokenizer.json").read_text()))

    def reward_format(prompts, completions, label, completion_ids, **kwargs):
        return [
            format_reward(decode(ids), lab) for ids, lab in zip(completion_ids, label, strict=True)
        ]

    return reward_format


LENGTHS = ("len_min", "len_median", "len_max", "at_cap", "prompt_tokens", "learner_tokens")


def length_stats(out: dict, eos_id: int) -> dict:
    """Per-row completion lengths (EOS included, as completion_mask counts them): min, median,
    max; the share of rows that never sampled EOS (stopped at the cap); the prompts' real
    tokens; the tokens the learner's forward computes (rows x padded prompt + completion)."""
    import torch

    lengths = out["completion_mask"].sum(1).float()
    capped = ~(out["completion_ids"] == eos_id).any(1)
    rows = out["completion_ids"].shape[0]
    return {
        "len_min": float(lengths.min()),
        "len_median": float(torch.quantile(lengths, 0.5)),  # numpy's median (mean of the two)
        "len_max": float(lengths.max()),
        "at_cap": float(capped.float().mean()),
        "prompt_tokens": int(out["prompt_mask"].sum()),
        "learner_tokens": rows * (out["prompt_ids"].shape[1] + out["completion_ids"].shape[1]),
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prep", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=14)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompts-per-step", type=int, default=8)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--force-length",
        action="store_true",
        help="min_new_tokens = max_new_tokens (EOS suppressed while sampling)",
    )
    args = ap.parse_args()
    started = time.perf_counter()

    import torch

    torch.set_num_threads(args.threads)
    import datasets
    import transformers
    import trl
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    prep = Path(args.prep)
    tok = build_tokenizer(prep)
    prompts = json.loads((prep / "prompts.json").read_text())
    for p in prompts[:16]:
        ids = tok(p["prompt"])["input_ids"]
        if ids != p["ids"]:
            raise RuntimeError(f"tokenizer: {p['prompt']!r} -> {ids}, jaxloop {p['ids']}")
    torch.manual_seed(args.seed)
    model, model_info = build_model(prep)
    logits_diff = check_reference(model, prep)
    dataset = prompt_dataset(prompts, args.steps * args.prompts_per_step, prep)
    batch = args.prompts_per_step * args.group
    gen_kwargs = {"min_new_tokens": args.max_new_tokens} if args.force_length else None
    out_dir = tempfile.mkdtemp(prefix="trl_grpo_")
    config = GRPOConfig(
        output_dir=out_dir,
        per_device_train_batch_size=batch,  # completions per optimizer step: 8 prompts x 8
        gradient_accumulation_steps=1,  # one micro-batch of 64, as jaxloop's micro_batch_size=64
        num_generations=args.group,
        max_completion_length=args.max_new_tokens,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        generation_kwargs=gen_kwargs,
        beta=0.0,  # no reference model
        num_iterations=1,
        epsilon=0.2,
        loss_type="grpo",  # per-sequence token mean, then mean: jaxloop's seq_mean_token_mean
        scale_rewards="group",
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        optim="adamw_torch",
        adam_beta1=0.9,
        adam_beta2=0.99,  # jaxloop's optim.b2 default
        adam_epsilon=1e-8,
        weight_decay=0.0,
        max_grad_norm=1.0,
        max_steps=args.steps,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        bf16=False,
        fp16=False,
        gradient_checkpointing=False,  # TRL's default is True; jaxloop runs remat=none
        use_cpu=True,
        seed=args.seed,
        data_seed=args.seed,
        shuffle_dataset=False,  # jaxloop's prompt order
        dataloader_num_workers=0,
        disable_tqdm=True,
        log_completions=False,
        use_vllm=False,
    )

    steps: list[dict] = []
    current: dict = {}

    class Timer(TrainerCallback):
        def on_step_begin(self, args_, state, control, **kw):
            current.clear()
            current["t_begin"] = time.perf_counter()

        def on_step_end(self, args_, state, control, **kw):
            now = time.perf_counter()
            rec = {
                "step": state.global_step - 1,
                "step_s": now - current["t_begin"],
                "rollout_s": current.get("rollout_s", float("nan")),
                "generate_s": current.get("generate_s", float("nan")),
                "t_end": now,
            }
            rec["update_s"] = rec["step_s"] - rec["rollout_s"]
            for k in ("completion_tokens", "completion_len_max", "completion_len_mean", *LENGTHS):
                if k in current:
                    rec[k] = current[k]
            steps.append(rec)

        def on_log(self, args_, state, control, logs=None, **kw):
            if logs and steps and "completions/mean_length" in logs:
                steps[-1]["trl_logs"] = {
                    k: logs[k]
                    for k in (
                        "completions/mean_length",
                        "completions/max_length",
                        "completions/clipped_ratio",
                        "reward",
                        "entropy",
                        "grad_norm",
                        "step_time",
                        "loss",
                    )
                    if k in logs
                }

    class TimedGRPOTrainer(GRPOTrainer):
        def _generate_and_score_completions(self, inputs):
            t = time.perf_counter()
            out = super()._generate_and_score_completions(inputs)
            current["rollout_s"] = time.perf_counter() - t
            mask = out["completion_mask"]
            current["completion_tokens"] = int(mask.sum())
            current["completion_len_max"] = int(mask.sum(1).max())
            current["completion_len_mean"] = float(mask.sum(1).float().mean())
            current.update(length_stats(out, tok.eos_token_id))
            return out

    trainer = TimedGRPOTrainer(
        model=model,
        reward_funcs=reward_format_for(prep),
        args=config,
        train_dataset=dataset,
        processing_class=tok,
        callbacks=[Timer()],
    )
    generate = trainer.model.generate

    def timed_generate(*a, **kw):
        t = time.perf_counter()
        result = generate(*a, **kw)
        current["generate_s"] = current.get("generate_s", 0.0) + time.perf_counter() - t
        return result

    trainer.model.generate = timed_generate
    setup_s = time.perf_counter() - started
    t_train = time.perf_counter()
    trainer.train()
    train_s = time.perf_counter() - t_train
    result = {
        "system": "trl",
        "versions": {
            "trl": trl.__version__,
            "transformers": transformers.__version__,
            "torch": torch.__version__,
            "datasets": datasets.__version__,
        },
        "torch_threads": torch.get_num_threads(),
        "torch_interop_threads": torch.get_num_interop_threads(),
        "omp_num_threads_env": os.environ.get("OMP_NUM_THREADS"),
        "model": model_info,
        "logits_max_abs_diff_vs_jaxloop": logits_diff,
        "generation_config": {
            k: getattr(trainer.generation_config, k)
            for k in (
                "max_new_tokens",
                "min_new_tokens",
                "do_sample",
                "temperature",
                "top_k",
                "top_p",
                "eos_token_id",
                "cache_implementation",
            )
        },
        "setup_s": setup_s,
        "train_s": train_s,
        "steps": steps,
    }
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k != "steps"}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
