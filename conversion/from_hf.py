"""HF checkpoint -> jaxloop run dir (orbax step 0, ready to train from).

    python -m conversion.from_hf --hf-dir DIR --out CKPT [--dtype auto|bfloat16|float32]

--dtype auto (default) keeps the checkpoint's dtype (never upcasts). Relative paths are taken
from the working directory. The source tensors are read in slices (no memory map) into one buffer
per parameter: peak RSS is about the model plus a parameter (measured on Nanbeige4.2-3B's shapes,
8.34 GB of bf16: 8.70 GB; scripts/check_full_size.py). Writes into a temporary directory beside
CKPT and renames it at the end: an error leaves nothing behind (one "error: ..." line on stderr,
exit code 2). The step's digests (jaxloop/models/digests.py) are written with it; weights holding
NaN or inf are refused. A progress bar is shown while reading when stderr is a terminal.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from conversion._cli import OneLineParser, check_out_dir, run, show_progress


def parse_args(argv: Sequence[str] | None):
    p = OneLineParser(prog="python -m conversion.from_hf", description=__doc__.split("\n")[0])
    p.add_argument(
        "--hf-dir", required=True, type=Path, help="HF model dir (config.json, *.safetensors)"
    )
    p.add_argument("--out", required=True, type=Path, help="run dir to create (new or empty)")
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"])
    return p.parse_args(argv)


def _main(argv: Sequence[str] | None) -> int:
    args = parse_args(argv)
    # Relative paths are taken from the working directory (orbax itself wants absolute ones).
    hf_dir: Path = args.hf_dir.resolve()
    out: Path = args.out.resolve()
    check_out_dir(out)

    from jaxloop.io.hf import count_params, load_hf
    from jaxloop.io.orbax import save_model

    created = [p for p in [out.parent, *out.parent.parents] if not p.exists()]
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        dtype = None if args.dtype == "auto" else args.dtype
        model = load_hf(hf_dir, dtype=dtype, progress=show_progress())
        save_model(tmp, model, step=0, tokenizer_dir=hf_dir, donate=True)
        if out.exists():
            out.rmdir()
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        for d in created:  # innermost first
            if d.is_dir() and not any(d.iterdir()):
                d.rmdir()
        raise
    cfg = model.config
    print(
        f"wrote {out}: {cfg.family} {model.role}, {count_params(model):,} parameters in "
        f"{cfg.param_dtype}, step 0"
    )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    return run(_main, argv)


if __name__ == "__main__":
    sys.exit(main())
