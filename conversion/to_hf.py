"""jaxloop run dir (from from_hf or a training run) -> HF checkpoint (sharded safetensors).

    python -m conversion.to_hf --checkpoint CKPT --out DIR [--role actor|critic]
        [--dtype auto|bfloat16|float32] [--max-shard-size 5GB] [--step N]

--dtype auto (default) writes the stored parameter dtype; --step defaults to the latest step.
Tokenizer files in CKPT/tokenizer/ are copied. Parameters are restored to host memory one at a
time and each one's tensors are streamed to their shard file before the next is read: peak RAM is
about twice the largest parameter plus the interpreter, whatever the model's size (no model is
built: jaxloop.io.orbax.export_hf).
The step's actor_params (or critic_params) are verified against its digests first: a damaged
step is refused naming the file and the newest older step that verifies (`--step`); a step
without digests is read unverified, with a warning. Progress bars when stderr is a terminal.
Errors: one "error: ..." line on stderr, exit code 2, and no output directory.
"""

from __future__ import annotations

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
    dtype = cfg.param_dtype if args.dtype == "auto" else args.dtype
    n = len(list(out.glob("*.safetensors")))
    params = sum(int(np.prod(s)) for s in hf_tensor_shapes(cfg, args.role).values())
    print(f"wrote {out}: {cfg.family} {args.role}, {params:,} parameters in {dtype}, {n} shard(s)")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    return run(_main, argv)


if __name__ == "__main__":
    sys.exit(main())
