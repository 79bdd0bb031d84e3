"""A Policy as the HF-named tensors remote engines load (names from the family table)."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from jaxloop.io.hf_walk import iter_hf
from jaxloop.rollout.api import Policy


def hf_tensors(
    policy: Policy, dtypes: Mapping[str, str] | None = None
) -> list[tuple[str, np.ndarray]]:
    """(HF name, host array) of every actor tensor of `policy`, in table order; a tensor whose
    name is in `dtypes` (an engine's expected dtype names) is cast to that dtype. A stacked
    parameter comes to the host one layer at a time (see io.hf.iter_hf)."""
    return list(iter_hf(policy.params, policy.config, "actor", dtypes))
