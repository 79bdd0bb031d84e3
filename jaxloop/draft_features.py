"""Draft-model feature collection: the LM-head input hidden states (last loop) at response
positions, saved per update as a safetensors batch plus a JSON manifest, within budgets.

Files: <run_dir>/draft_features/update_<u>.safetensors (hidden [n, E], target_token [n],
sample [n], position [n]) and update_<u>.json (one record per row: sample, group, position,
target token, policy version; plus config and tokenizer digests). Each file is written to a
temporary name and renamed, the manifest last, so a reader never sees half an update.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np

from jaxloop.io.hf import write_safetensors

FEATURES_DIR = "draft_features"


def config_digest(hf_config: dict) -> str:
    return hashlib.sha256(json.dumps(hf_config, sort_keys=True).encode()).hexdigest()


class DraftFeatureWriter:
    def __init__(
        self,
        run_dir,
        max_tokens_per_update: int,
        max_bytes: int,
        config_digest: str,
        tokenizer_digest: str,
    ):
        self.dir = Path(run_dir) / FEATURES_DIR
        self.dir.mkdir(parents=True, exist_ok=True)
        self.max_tokens = max_tokens_per_update
        self.max_bytes = max_bytes
        self.config_digest = config_digest
        self.tokenizer_digest = tokenizer_digest

    def bytes_written(self) -> int:
        return sum(f.stat().st_size for f in self.dir.glob("update_*.safetensors"))

    def write(self, update: int, policy_version: int, samples, arrays, hidden) -> int:
        """Save this update's features; returns the number of token rows written (0 when the
        byte budget is spent)."""
        mask = arrays.response_mask > 0
        rows, cols = np.nonzero(mask)
        rows, cols = rows[: self.max_tokens], cols[: self.max_tokens]
        hidden = np.asarray(hidden)
        per_row = hidden.shape[-1] * hidden.dtype.itemsize + 12
        room = (self.max_bytes - self.bytes_written()) // per_row
        if room <= 0:
            return 0
        rows, cols = rows[:room], cols[:room]
        targets = arrays.tokens[rows, cols + 1].astype(np.int32)
        tensors = {
            "hidden": np.ascontiguousarray(hidden[rows, cols]),
            "target_token": targets,
            "sample": rows.astype(np.int32),
            "position": (cols + 1).astype(np.int32),
        }
        stem = f"update_{update:06d}"
        tmp = self.dir / f".{stem}.safetensors.tmp"
        write_safetensors(tmp, tensors, metadata={"format": "jaxloop-draft-features"})
        os.replace(tmp, self.dir / f"{stem}.safetensors")
        manifest = {
            "update": update,
            "policy_version": policy_version,
            "config_digest": self.config_digest,
            "tokenizer_digest": self.tokenizer_digest,
            "hidden_size": int(hidden.shape[-1]),
            "dtype": str(hidden.dtype),
            "records": [
                {
                    "sample": int(samples[r].sample_index),
                    "group": int(samples[r].group_id),
                    "position": int(c + 1),
                    "target_token": int(t),
                    "policy_version": int(samples[r].policy_version),
                }
                for r, c, t in zip(rows, cols, targets, strict=True)
            ],
        }
        tmp = self.dir / f".{stem}.json.tmp"
        tmp.write_text(json.dumps(manifest) + "\n")
        os.replace(tmp, self.dir / f"{stem}.json")
        return len(rows)
