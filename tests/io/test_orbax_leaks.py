"""The host-memory leak work-arounds of jaxloop.io.orbax_leaks (docs/reliability.md, the soak)."""

import gc
import tracemalloc

import jax.numpy as jnp
import orbax.checkpoint as ocp
import tensorstore as ts
from orbax.checkpoint._src.serialization import tensorstore_utils

from jaxloop.io import orbax_leaks


def test_local_file_spec_resolves_as_tensorstore_does(tmp_path):
    spec = {"driver": "file", "path": f"{tmp_path}/a/"}
    assert orbax_leaks._LocalFileSpec(spec).to_json() == ts.KvStore.Spec(spec).to_json()
    other = {"driver": "memory"}  # anything else is tensorstore's own Spec
    assert isinstance(orbax_leaks._LocalFileSpec(other), ts.KvStore.Spec)
    assert tensorstore_utils.ts.KvStore.Spec is orbax_leaks._LocalFileSpec  # applied on import
    assert tensorstore_utils.ts.Context is ts.Context  # the rest is tensorstore itself


def _blocks_kept_by_tensorstore_utils(saves: int, path) -> int:
    """Python memory blocks allocated under orbax's tensorstore_utils during `saves` checkpoint
    saves (after a warm-up) and still alive afterwards."""
    mngr = ocp.CheckpointManager(
        path,
        options=ocp.CheckpointManagerOptions(
            max_to_keep=2, create=True, enable_async_checkpointing=False
        ),
    )
    tree = {f"w{i}": jnp.full((4, 4), float(i)) for i in range(10)}

    def save(step):
        mngr.save(step, args=ocp.args.Composite(a=ocp.args.StandardSave(tree)), force=True)
        mngr.wait_until_finished()

    for step in range(1, 6):
        save(step)
    tracemalloc.start(25)
    try:
        gc.collect()
        before = tracemalloc.take_snapshot()
        for step in range(6, 6 + saves):
            save(step)
        gc.collect()
        after = tracemalloc.take_snapshot()
    finally:
        tracemalloc.stop()
        mngr.close()
    only = [tracemalloc.Filter(True, tensorstore_utils.__file__, all_frames=True)]
    diff = after.filter_traces(only).compare_to(before.filter_traces(only), "filename")
    return sum(max(d.count_diff, 0) for d in diff)


def test_checkpoint_saves_keep_no_memory_under_tensorstore_utils(tmp_path, monkeypatch):
    # without the work-around every array write leaves the converted spec behind (measured: 1195
    # blocks after 20 saves of 10 arrays, 2247 after 40; with it 194 and 245, mostly one-off)
    monkeypatch.setattr(tensorstore_utils, "ts", ts)
    leaked = _blocks_kept_by_tensorstore_utils(20, tmp_path / "without")
    monkeypatch.undo()
    kept = _blocks_kept_by_tensorstore_utils(20, tmp_path / "with")
    assert leaked > 20 * 10, leaked  # the leak is real in this tensorstore (else drop the patch)
    assert kept * 3 < leaked, (kept, leaked)
