"""Supervised fine-tuning: teacher-forced cross-entropy on {prompt, label} examples.

A sequence is the prompt's tokens (as the rollout engines see them: `encode_prompt`), the label's
tokens and EOS; the loss is the mean negative log-likelihood over the label and EOS targets only
(the prompt's targets are masked). The rows are laid out like a rollout's (`RolloutBatch`: the
token at j + 1 is predicted at j), so the model forward is the learner's.

`SFTStepper` is the jitted optimizer step (micro-batched gradient accumulation, the same
non-finite guard as the learner: a step whose loss or gradient norm is not finite is not applied),
used by `python -m jaxloop.sft` and by a training run's `warm_start.sft_steps`.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import optax
from flax import nnx, struct

from jaxloop.parallel import mesh as shd
from jaxloop.rl.batch import RolloutBatch
from jaxloop.rl.microbatch import accumulate, apply_if, split_micro


@struct.dataclass
class SFTBatch:
    """SFT rows (a pytree): tokens [B, S] int32, attention_mask [B, S] bool and loss_mask
    [B, S - 1] float32 (1 at the answer's and EOS's targets)."""

    tokens: jax.Array
    attention_mask: jax.Array
    loss_mask: jax.Array


def sft_sequences(tokenizer, examples) -> tuple[list[list[int]], list[list[int]]]:
    """(prompt ids, answer ids + EOS) of each example."""
    prompts = [list(tokenizer.encode_prompt(ex.prompt)) for ex in examples]
    answers = [list(tokenizer.encode(ex.label)) + [tokenizer.eos_id] for ex in examples]
    return prompts, answers


def sft_batch(
    prompts: Sequence[Sequence[int]], answers: Sequence[Sequence[int]], seq_len: int
) -> SFTBatch:
    """Rows of exactly `seq_len` tokens (host arrays). One shape for every batch, so the step
    compiles once."""
    n = len(prompts)
    batch = RolloutBatch.from_sequences(
        prompts, answers, [[0.0] * len(a) for a in answers], [0.0] * n, list(range(n))
    ).with_length(seq_len)
    return SFTBatch(batch.tokens, batch.attention_mask, batch.response_mask)


def sft_token_stats(graphdef, params, x: SFTBatch):
    """Per-target negative log-likelihood and whether the argmax is the target ([B, T] each)."""
    model = nnx.merge(graphdef, params)
    tokens, attn = x.tokens, x.attention_mask
    logits = model.forward(tokens[:, :-1], attention_mask=attn[:, :-1]).logits
    logits = logits.astype(jnp.float32)
    targets = tokens[:, 1:]
    logp = jax.nn.log_softmax(logits, axis=-1)
    nll = -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    correct = (jnp.argmax(logits, axis=-1) == targets).astype(jnp.float32)
    return nll, correct


def sft_loss(graphdef, params, x: SFTBatch, num_tokens) -> tuple[jax.Array, dict]:
    """sum(nll * loss_mask) / num_tokens (the whole batch's answer tokens: micro-batch losses
    add up to the token mean) and the metric sums."""
    nll, correct = sft_token_stats(graphdef, params, x)
    mask = x.loss_mask
    loss = jnp.sum(nll * mask) / jnp.maximum(num_tokens, 1.0)
    return loss, {"correct": jnp.sum(correct * mask)}


class SFTStepper:
    """`step(params, opt_state, batch) -> (params, opt_state, metrics)`: one optimizer step on
    a batch from `sft_batch`. Params and optimizer state are donated. On a mesh the step is
    jitted with the state's shardings and the batch split over data x fsdp."""

    def __init__(
        self,
        graphdef,
        tx: optax.GradientTransformation,
        micro_batch_size: int,
        *,
        mesh=None,
        params_sharding=None,
        opt_sharding=None,
    ):
        self.graphdef, self.tx, self.micro = graphdef, tx, micro_batch_size
        self.mesh = mesh
        if mesh is None:
            self._step = jax.jit(self._step_impl, donate_argnums=(0, 1))
            self.batch_sharding = None
        else:
            self.batch_sharding = shd.batch_sharding(mesh, ndim=1)
            self._step = jax.jit(
                self._step_impl,
                in_shardings=(params_sharding, opt_sharding, self.batch_sharding),
                out_shardings=(params_sharding, opt_sharding, shd.replicated(mesh)),
                donate_argnums=(0, 1),
            )

    def init(self, params, opt_sharding=None):
        return jax.jit(self.tx.init, out_shardings=opt_sharding)(params)

    def step(self, params, opt_state, batch: SFTBatch) -> tuple:
        if self.mesh is None:
            return self._step(params, opt_state, batch)
        with jax.set_mesh(self.mesh):
            placed = jax.tree.map(lambda x: shd.put_global(x, self.batch_sharding), batch)
            return self._step(params, opt_state, placed)

    def _step_impl(self, params, opt_state, batch: SFTBatch):
        num_tokens = jnp.sum(batch.loss_mask)
        micro = split_micro(batch, self.micro)

        def micro_loss(p, x):
            return sft_loss(self.graphdef, p, x, num_tokens)

        grads, loss, sums = accumulate(micro_loss, params, micro)
        grad_norm = optax.tree.norm(grads)
        ok = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        params, opt_state, ok = apply_if(ok, self.tx, grads, params, opt_state)
        metrics = {
            "sft_loss": loss,
            "sft_token_accuracy": sums["correct"] / jnp.maximum(num_tokens, 1.0),
            "sft_grad_norm": grad_norm,
            "sft_tokens": num_tokens,
            "skipped": (~ok).astype(jnp.float32),
        }
        return params, opt_state, metrics


def answer_budget(source, tokenizer) -> int:
    """Tokens of the longest label a source can give (EOS not counted): a file source's longest
    label; a built-in task's longest answer (digits: one token each in the char tokenizer)."""
    examples = getattr(source, "examples", None)
    if examples:
        return max(len(tokenizer.encode(ex.label)) for ex in examples)
    task = getattr(source, "task", None)
    if task is not None:
        return int(task.max_answer_tokens)
    raise ValueError(f"cannot tell the longest label of {type(source).__name__}")


def sft_seq_len(max_prompt_tokens: int, max_answer_tokens: int) -> int:
    """Row length that holds the longest prompt, answer and EOS."""
    return int(max_prompt_tokens) + int(max_answer_tokens) + 1
