"""jaxloop run dir (from from_hf or a training run) -> HF checkpoint (sharded safetensors).

    python -m conversion.to_hf --checkpoint CKPT --out DIR [--role actor|critic]
        [--dtype auto|bfloat16|float32] [--max-shard-size 5GB] [--step N]

--dtype auto (default) writes the stored parameter dtype; --step defaults to the latest step.
The run's tokenizer goes beside the weights, so the output loads as one HF dir: the files of
CKPT/tokenizer/ (conversion.from_hf's copy), else those of the HF tokenizer dir the run used
(its config.json's data.tokenizer, `auto` resolved as the trainer does); and a
generation_config.json whose eos_token_id lists every EOS id the run stopped at (an int when
there is one), pad_token_id and bos_token_id (merged over the tokenizer's own file).
Parameters are restored to host memory one at a time and each one's tensors are streamed to
their shard file before the next is read: peak RAM is about twice the largest parameter plus the
interpreter, whatever the model's size (no model is built: jaxloop.io.orbax.export_hf).
The step's actor_params (or critic_params) are verified against its digests first: a damaged
step is refused naming the file and the newest older step that verifies (`--step`); a step
without digests is read unverified, with a warning. Progress bars when stderr is a terminal.
Errors: one "error: ..." line on stderr, exit code 2, and no output directory.
"""

from __future__ import annotations

import json
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path

from conversion._cli import OneLineParser, UsageError, check_out_dir, run, show_progress


def parse_args(argv: Sequence[str] | None):
    p = OneLineParser(prog="python -m conversion.to_hf", description=__doc__.split("\n")[0])
    p.add_argument("--checkpoint", required=True, type=Path, help="jaxloop run dir")
    p.add_argument("--out", required=True, type=Path, help="HF dir to create (new or empty)")
    p.add_argument("--role", default="actor", choices=["actor", "critic"])
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"])
    p.add_argument("--max-shard-size", default="5GB", help="e.g. 5GB, 500MB, 2GiB or bytes")
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest)")
    return p.parse_args(argv)


def run_tokenizer_dir(run_dir: Path) -> Path | None:
    """The HF tokenizer dir of a run (jaxloop.train.setup.run_tokenizer: its tokenizer/, else the
    tokenizer its config.json names); None for the char tokenizer."""
    from jaxloop.train.setup import run_tokenizer

    spec = run_tokenizer(run_dir)
    if spec == "char":
        return None
    if not Path(spec).is_dir():
        raise UsageError(f"{run_dir}: the run's tokenizer dir {spec!r} is not found")
    return Path(spec)


def write_tokenizer(run_dir: Path, out: Path) -> str:
    """Copy the run's HF tokenizer into `out` (where export_hf has not already) and write its
    generation_config.json; returns what was written, in words."""
    from jaxloop.data.tokenizer import (
        GENERATION_CONFIG,
        CharTokenizer,
        HFTokenizer,
        TokenizerError,
    )
    from jaxloop.io.hf import copy_tokenizer_files

    source = run_tokenizer_dir(run_dir)
    if source is None:
        tokenizer, what = CharTokenizer(), "char (not an HF tokenizer: not written)"
        generation = {}
    else:
        copy_tokenizer_files(source, out)
        try:
            tokenizer, what = HFTokenizer(source), f"from {source}"
        except TokenizerError as err:  # copied as they are, but no EOS ids to write
            print(f"warning: {err}; no {GENERATION_CONFIG} written", file=sys.stderr)
            return f"files of {source} (not loadable)"
        file = out / GENERATION_CONFIG
        generation = json.loads(file.read_text()) if file.is_file() else {}
    eos = list(tokenizer.eos_ids)
    generation.update(
        eos_token_id=eos[0] if len(eos) == 1 else eos,
        pad_token_id=tokenizer.pad_id,
        bos_token_id=tokenizer.bos_id,
    )
    (out / GENERATION_CONFIG).write_text(json.dumps(generation, indent=2) + "\n")
    return f"{what}, EOS ids {eos}"


def _main(argv: Sequence[str] | None) -> int:
    args = parse_args(argv)
    # Relative paths are taken from the working directory (orbax itself wants absolute ones).
    checkpoint: Path = args.checkpoint.resolve()
    out: Path = args.out.resolve()
    check_out_dir(out)

    import numpy as np

    from jaxloop.families import hf_tensor_shapes
    from jaxloop.io.hf import parse_size
    from jaxloop.io.orbax import export_hf

    try:
        shard_bytes = parse_size(args.max_shard_size)
    except ValueError:
        shard_bytes = 0
    if shard_bytes <= 0:
        raise UsageError(f"--max-shard-size {args.max_shard_size!r} is not a positive size")
    out, cfg = export_hf(
        checkpoint,
        out,
        role=args.role,
        step=args.step,
        dtype=None if args.dtype == "auto" else args.dtype,
        max_shard_size=shard_bytes,
        overwrite=True,  # only ever an empty dir here (checked above)
        progress=show_progress(),
    )
    try:
        tokenizer = write_tokenizer(checkpoint, out)
    except BaseException:
        shutil.rmtree(out, ignore_errors=True)  # nothing half-written
        raise
    dtype = cfg.param_dtype if args.dtype == "auto" else args.dtype
    n = len(list(out.glob("*.safetensors")))
    params = sum(int(np.prod(s)) for s in hf_tensor_shapes(cfg, args.role).values())
    print(
        f"wrote {out}: {cfg.family} {args.role}, {params:,} parameters in {dtype}, {n} shard(s), "
        f"tokenizer {tokenizer}"
    )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    return run(_main, argv)


if __name__ == "__main__":
    sys.exit(main())
