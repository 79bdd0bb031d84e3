"""Model weights in an orbax run directory (the layout shared with the trainer).

    run_dir/
      checkpoints/            ocp.CheckpointManager; each step is a composite of items
        <step>/actor_params   ocp.args.StandardSave(nnx.to_pure_dict(nnx.state(model, nnx.Param)))
        <step>/critic_params  (same, for the critic)
        <step>/...            other items (optimizer state, train state) written by the trainer
      actor_config.json       LoopedConfig.to_hf_dict()
      critic_config.json      the same plus "jaxloop_role": "critic"
      tokenizer/              tokenizer files, if any

`restore_model` restores only the `{role}_params` item, so it works whatever else a step holds,
one parameter at a time (peak RAM: the model plus about one parameter), each straight onto its
sharding (`sharding=`, or `mesh=` and the parameter's logical axes). Orbax admits the reads of one
parameter's shards up to `budget_bytes` at a time; a parameter whose stored chunk is larger than
that budget (the real models' stacked MLP weights: 1.45 GB) raises it for that restore instead of
failing: a chunk is read whole anyway, so reading it in slices would not lower the peak.

Every path may be relative (resolved against the working directory before it reaches orbax,
which wants absolute paths).
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx

from jaxloop.families import hf_tensor_shapes
from jaxloop.io import orbax_leaks  # noqa: F401  (host-memory leak work-arounds, on import)
from jaxloop.io.hf import (
    ROLE_KEY,
    abstract_model,
    copy_tokenizer_files,
    hf_config_dict,
    model_hf_config,
    progress_bar,
    write_hf,
)
from jaxloop.io.hf_walk import hf_entries, hf_view
from jaxloop.io.run_dir import (  # the run dir layout's one owner
    CHECKPOINT_DIR,
    TOKENIZER_DIR,
    RunDirError,
    config_file,
    params_item,
)
from jaxloop.models import digests
from jaxloop.models.config import ConfigError, LoopedConfig
from jaxloop.models.looped import LoopedLM
from jaxloop.parallel.mesh import shardings_for

RESTORE_BUDGET_BYTES = 10**9  # default in-flight read budget within one parameter


# ---- save --------------------------------------------------------------------------------------
def write_text_atomic(path: str | Path, text: str) -> None:
    """Write a file whole or not at all: a temporary file beside it, fsynced, renamed over it (a
    kill never leaves it cut short)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_config(run_dir: str | Path, model: LoopedLM) -> None:
    """run_dir/{role}_config.json for `model` (atomically)."""
    text = json.dumps(model_hf_config(model), indent=2) + "\n"
    write_text_atomic(Path(run_dir).resolve() / config_file(model.role), text)


def save_model(
    run_dir: str | Path,
    model: LoopedLM,
    step: int = 0,
    tokenizer_dir: str | Path | None = None,
    *,
    donate: bool = False,
) -> Path:
    """Write `{role}_config.json` and the `{role}_params` item at `step` (a new step).

    tokenizer_dir: a directory whose tokenizer files (io.hf.TOKENIZER_FILES) are copied into
    run_dir/tokenizer/ (not created when it holds none).
    donate: move the parameters to host memory one at a time, deleting each device array, and
    write them without orbax's defensive host copy: peak memory is the model plus one parameter
    instead of about twice the model. The model is unusable afterwards (for conversions).
    """
    run_dir = Path(run_dir).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    role = model.role
    write_config(run_dir, model)
    if tokenizer_dir is not None:
        tok = run_dir / TOKENIZER_DIR
        tok.mkdir(exist_ok=True)
        if not copy_tokenizer_files(tokenizer_dir, tok) and not any(tok.iterdir()):
            tok.rmdir()
    item = params_item(role)
    pure = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    registry = None
    if donate:
        pure = jax.tree.map(_to_host_and_delete, pure)
        registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
        registry.add(item, ocp.args.StandardSave, _HostArrayStandardHandler())
    with ocp.CheckpointManager(run_dir / CHECKPOINT_DIR, handler_registry=registry) as mngr:
        mngr.save(step, args=ocp.args.Composite(**{item: ocp.args.StandardSave(pure)}))
        mngr.wait_until_finished()
    if jax.process_index() == 0:
        digests.write_digests(run_dir / CHECKPOINT_DIR / str(step))
    return run_dir


def _to_host_and_delete(x: jax.Array) -> np.ndarray:
    host = np.asarray(x)  # zero-copy for CPU arrays; one parameter's copy otherwise
    x.delete()
    return host


class _HostArrayStandardHandler(ocp.StandardCheckpointHandler):
    """StandardCheckpointHandler (same files, read back by StandardRestore) for numpy arrays
    nobody mutates meanwhile: no defensive deep copy, no compression (bf16/fp32 weights hardly
    compress, and compressing whole-array chunks buffers another copy of each array)."""

    def __init__(self):
        super().__init__()
        th = ocp.type_handlers
        types = th.create_type_handler_registry(
            (np.ndarray, th.NumpyHandler(deepcopy_host_arrays=False)),
            (jax.Array, th.get_type_handler(jax.Array)),
        )
        # The parent builds the same PyTreeCheckpointHandler with the default registry.
        self._impl = ocp.PyTreeCheckpointHandler(type_handler_registry=types, use_compression=False)


# ---- restore -----------------------------------------------------------------------------------
def _checkpoint_dir(run_dir: str | Path) -> Path:
    run_dir = Path(run_dir).resolve()
    if not run_dir.is_dir():
        raise RunDirError(f"run dir {run_dir} does not exist")
    ckpt = run_dir / CHECKPOINT_DIR
    if not ckpt.is_dir():
        raise RunDirError(f"{run_dir} has no {CHECKPOINT_DIR}/ directory")
    return ckpt


def _open(ckpt: Path, registry=None) -> ocp.CheckpointManager:
    options = ocp.CheckpointManagerOptions(create=False)
    with _quiet_other_items():  # a step without metadata (emptied) is refused in one line later
        return ocp.CheckpointManager(ckpt, options=options, handler_registry=registry)


def check_step(
    run_dir: str | Path,
    step: int,
    items: list[str] | None = None,
    fallback: str = "pass --step {step} to use it",
    warn: bool = True,
) -> bool:
    """Verify the digests of `items` (default: all) of `step` (models/digests.py): True when
    verified; False when the step has no digest file (unverified; with `warn`, a warning line:
    callers that may still fail pass warn=False and warn once they succeed). A
    mismatch or a missing file is a one-line RunDirError naming the step and the newest older
    step that verifies (`fallback`, formatted with its step, says how to use it)."""
    ckpt = Path(run_dir).resolve() / CHECKPOINT_DIR
    try:
        verified = digests.verify_step(ckpt / str(step), items)
    except digests.DigestError as err:
        offer = older_step_offer(run_dir, step, items, fallback)
        raise RunDirError(
            f"run dir {Path(run_dir)}: checkpoint {step} is corrupt: {err} ({offer})"
        ) from None
    if not verified and warn:
        digests.warn_unverified(step, run_dir)
    return verified


def older_step_offer(
    run_dir: str | Path,
    step: int,
    items: list[str] | None = None,
    fallback: str = "pass --step {step} to use it",
) -> _LazyText:
    """What to tell the user of a damaged `step`: the newest older step whose digests verify and
    how to use it (`fallback`, formatted with that step), or that none does. Lazy: the older
    steps are hashed only when the text is formatted (in an error message)."""

    def text() -> str:
        older, verified = _intact_before(Path(run_dir).resolve() / CHECKPOINT_DIR, step, items)
        if older is None:
            return "no older checkpoint verifies; start a new run_dir"
        if not verified:  # written before digests: nothing to check it against
            return f"checkpoint {older} has no digests (unverified): {fallback.format(step=older)}"
        return f"checkpoint {older} verifies: {fallback.format(step=older)}"

    return _LazyText(text)


class _LazyText:
    def __init__(self, make):
        self._make = make

    def __str__(self) -> str:
        return self._make()

    def __format__(self, spec: str) -> str:
        return format(str(self), spec)


def _intact_before(ckpt: Path, step: int, items: list[str] | None) -> tuple[int | None, bool]:
    """(the newest step before `step` whose digests verify, True); else (the newest older step
    without digests, False: unverified, not known to be damaged); else (None, False)."""
    older = sorted(int(p.name) for p in ckpt.iterdir() if p.name.isdigit() and p.is_dir())
    unverified = None
    for s in reversed([s for s in older if s < step]):
        try:
            if digests.verify_step(ckpt / str(s), items):
                return s, True
        except digests.DigestError:
            continue
        if unverified is None and all((ckpt / str(s) / i).is_dir() for i in items or []):
            unverified = s
    return unverified, False


def latest_step(run_dir: str | Path) -> int | None:
    """The newest finished step in the run dir, or None when it holds none."""
    with _open(_checkpoint_dir(run_dir)) as mngr:
        return mngr.latest_step()


def read_config(run_dir: str | Path, role: str = "actor") -> LoopedConfig:
    """The LoopedConfig stored for `role` (default numerics: float32, no remat)."""
    path = Path(run_dir).resolve() / config_file(role)
    if not path.is_file():
        raise RunDirError(f"{run_dir} has no {role} model ({path.name} missing)")
    try:
        hf = json.loads(path.read_bytes().decode("utf-8"))
    except (OSError, ValueError) as err:  # JSONDecodeError and UnicodeDecodeError are both
        raise RunDirError(f"{path} is not valid JSON ({type(err).__name__}: {err})") from None
    if not isinstance(hf, dict):
        raise RunDirError(f"{path} is not a JSON object")
    stored_role = hf.get(ROLE_KEY, "actor")
    if stored_role != role:
        raise RunDirError(f"{path} describes a {stored_role!r} model, not a {role}")
    try:
        return LoopedConfig.from_hf_dict(hf)
    except ConfigError as err:
        raise RunDirError(f"{path}: {err}") from None


class _DropUnrestorableItemWarnings(logging.Filter):
    # Orbax warns about every item it has no handler for (the trainer's optimizer state...):
    # expected here, since only `{role}_params` is read; and, opening a manager, about a step
    # without its metadata file: the step is refused in one line if it is the one read.
    QUIET = ("could not be restored", "Metadata file does not exist")

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(text in message for text in self.QUIET)


@contextlib.contextmanager
def _quiet_other_items():
    logger = logging.getLogger("absl")
    flt = _DropUnrestorableItemWarnings()
    logger.addFilter(flt)
    try:
        yield
    finally:
        logger.removeFilter(flt)


def restore_model(
    run_dir: str | Path,
    role: str = "actor",
    step: int | None = None,
    dtype: str | None = None,
    compute_dtype: str | None = None,
    sharding: jax.sharding.Sharding | None = None,
    progress: bool = False,
    *,
    mesh: jax.sharding.Mesh | None = None,
    budget_bytes: int = RESTORE_BUDGET_BYTES,
    **config_overrides,
) -> LoopedLM:
    """Restore the `{role}_params` item of `step` (default: latest) as a LoopedLM.

    dtype: parameter dtype (None keeps the stored one; otherwise orbax casts while reading).
    compute_dtype defaults to the parameter dtype. sharding: where every parameter goes
    (default: the first local device); or mesh: each parameter onto parallel.mesh.shardings_for
    (its logical axes), passed to orbax so that each device reads only its
    slices (not both). budget_bytes: orbax's in-flight read budget within one parameter, raised
    to fit the largest one (parameters are restored one at a time whatever the budget).
    config_overrides go to LoopedConfig.replace (remat, attention_impl...). progress: a bar over
    the bytes restored, on stderr.
    """
    if sharding is not None and mesh is not None:
        raise ValueError("restore_model: pass sharding or mesh, not both")
    item = params_item(role)
    ckpt = _checkpoint_dir(run_dir)
    cfg = read_config(run_dir, role)
    step, stored, verified = _stored_params(ckpt, item, step)
    param_dtype = dtype or str(jnp.dtype(stored["embed"].dtype))
    cfg = cfg.replace(
        param_dtype=param_dtype,
        compute_dtype=compute_dtype or param_dtype,
        **config_overrides,
    )
    graphdef, params, rest = nnx.split(abstract_model(cfg, role), nnx.Param, ...)
    shapes = nnx.to_pure_dict(params)
    _check_shapes(shapes, stored, item)
    if mesh is not None:
        shardings = nnx.to_pure_dict(shardings_for(params, mesh))
    else:
        one = sharding or jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        shardings = jax.tree.map(lambda _: one, shapes)
    target = jax.tree.map(
        lambda x, s, sh: jax.ShapeDtypeStruct(
            x.shape, s.dtype if dtype is None else x.dtype, sharding=sh
        ),
        shapes,
        stored,
        shardings,
    )
    leaves, treedef = jax.tree_util.tree_flatten_with_path(target)
    total = sum(x.size * x.dtype.itemsize for _, x in leaves)
    arrays = []
    with (
        _open(ckpt, _params_registry(item, _read_limit(stored, budget_bytes))) as mngr,
        _quiet_other_items(),
        progress_bar(total, "restoring", progress) as bar,
    ):
        for path, x in leaves:
            with _unreadable_as_run_dir_error(ckpt, step, item, verified):
                arrays.append(_restore_one(mngr, step, item, path, x))
            _check_finite(arrays[-1], ckpt, step, item, path)
            bar.update(x.size * x.dtype.itemsize)
    nnx.replace_by_pure_dict(params, jax.tree.unflatten(treedef, arrays))
    if not verified:
        digests.warn_unverified(step, run_dir)
    return nnx.merge(graphdef, params, rest)


def _stored_params(ckpt: Path, item: str, step: int | None) -> tuple[int, dict]:
    """The step (default: latest) and the stored metadata tree of its `item`, or RunDirError."""
    with _open(ckpt, _params_registry(item, RESTORE_BUDGET_BYTES)) as mngr, _quiet_other_items():
        steps = mngr.all_steps()
        if not steps:
            raise RunDirError(f"{ckpt} holds no checkpoint")
        if step is None:
            step = mngr.latest_step()
        elif step not in steps:
            raise RunDirError(f"{ckpt} has no step {step} (steps: {sorted(steps)})")
        if not (ckpt / str(step) / item).is_dir():
            items = sorted(p.name for p in (ckpt / str(step)).iterdir() if p.is_dir())
            if not any((ckpt / str(step)).iterdir()):
                offer = older_step_offer(ckpt.parent, step, [item])
                raise RunDirError(f"step {step} of {ckpt} is empty ({offer})")
            raise RunDirError(f"step {step} of {ckpt} has no {item} item (items: {items})")
        verified = check_step(ckpt.parent, step, [item], warn=False)
        with _unreadable_as_run_dir_error(ckpt, step, item, verified):
            metadata = mngr.item_metadata(step)
        if metadata.get(item) is None:
            items = sorted(metadata.keys())
            raise RunDirError(f"step {step} of {ckpt} has no {item} item (items: {items})")
        return step, metadata[item].tree, verified


@contextlib.contextmanager
def _unreadable_as_run_dir_error(ckpt: Path, step: int, item: str, verified: bool):
    """Orbax / tensorstore failures reading a step without digests (or an older one) become a
    one-line RunDirError naming the step: its files are damaged (cut short, half-deleted...).
    A step whose digests verified has the bytes it was saved with: a failure there is a bug and
    keeps its traceback."""
    try:
        yield
    except RunDirError:
        raise
    except Exception as err:  # noqa: BLE001 - orbax / tensorstore raise many kinds
        if verified:
            raise
        raise RunDirError(
            f"checkpoint {step} of {ckpt} is damaged: its {item} is unreadable "
            f"({type(err).__name__}; the step has no {digests.DIGEST_FILE} to tell which file "
            "changed)"
        ) from None


def _check_finite(array: jax.Array, ckpt: Path, step: int, item: str, path) -> None:
    """RunDirError when a restored parameter holds a NaN or an infinity, naming it and the first
    such index (an HF checkpoint's tensors are checked as they are read: io.hf._check_finite):
    a model.init_checkpoint or an evaluated step with garbage weights is refused at load. One
    reduction on the parameter's devices; the index is looked for only when there is one."""
    if not jnp.issubdtype(array.dtype, jnp.inexact):
        return
    finite = jnp.isfinite(array)
    if bool(finite.all()):
        return
    first = int(jnp.argmin(finite.reshape(-1)))  # the first False
    index = tuple(int(i) for i in np.unravel_index(first, array.shape)) if array.shape else ()
    name = jax.tree_util.keystr(tuple(path), simple=True, separator=".")
    raise RunDirError(
        f"checkpoint {step} of {ckpt}: {item} parameter {name} holds non-finite values (NaN or "
        f"inf; the first at index {index}): refusing to load it"
    )


def _read_limit(stored: dict, budget_bytes: int) -> int:
    """Orbax admits a parameter's shard reads up to this many bytes at a time, and one request
    (the stored chunks it touches: up to the whole parameter in its stored dtype) must fit in
    it: the budget, raised to the largest parameter plus a quarter (slack for chunk padding).
    With one parameter restored at a time, that is also all that is ever in flight."""
    largest = max(
        int(np.prod(s.shape)) * jnp.dtype(s.dtype).itemsize for s in jax.tree.leaves(stored)
    )
    return max(int(budget_bytes), largest + largest // 4 + 1)


def _params_registry(item: str, budget_bytes: int):
    """A registry reading `item` with orbax's in-flight byte budget set to `budget_bytes` (orbax
    takes it in GB: a float keeps it exact to the byte)."""
    registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
    handler = ocp.PyTreeCheckpointHandler(restore_concurrent_gb=budget_bytes / 10**9)
    registry.add(item, ocp.args.PyTreeRestore, handler)
    return registry


def _restore_one(mngr, step: int, item: str, path, x: jax.ShapeDtypeStruct) -> jax.Array:
    """One parameter of `item` (orbax's partial restore), cast to x.dtype and placed on
    x.sharding. Restoring the whole tree at once keeps many parameters' host reads and device
    copies in flight together (peak RSS 1.74 GB for a 1.0 GB bf16 model, 0.2 GB of it the
    interpreter); one at a time, about the largest one's (1.41 GB)."""

    def nest(leaf):
        for key in reversed(path):
            leaf = {key.key: leaf}
        return leaf

    args = ocp.args.PyTreeRestore(
        nest(x),
        restore_args=nest(ocp.ArrayRestoreArgs(sharding=x.sharding, dtype=x.dtype)),
        partial_restore=True,
    )
    restored = mngr.restore(step, args=ocp.args.Composite(**{item: args}))[item]
    (array,) = jax.tree.leaves(restored)
    return array


def _restore_host(mngr, step: int, item: str, path: tuple[str, ...], stored_leaf) -> np.ndarray:
    """One parameter as a numpy array in its stored dtype, never on a device (for export)."""

    def nest(leaf):
        for key in reversed(path):
            leaf = {key: leaf}
        return leaf

    args = ocp.args.PyTreeRestore(
        nest(stored_leaf),
        restore_args=nest(ocp.RestoreArgs(restore_type=np.ndarray)),
        partial_restore=True,
    )
    restored = mngr.restore(step, args=ocp.args.Composite(**{item: args}))[item]
    for key in path:
        restored = restored[key]
    return restored


# ---- export ------------------------------------------------------------------------------------
def export_hf(
    run_dir: str | Path,
    path: str | Path,
    role: str = "actor",
    step: int | None = None,
    dtype: str | None = None,
    max_shard_size: str | int = "5GB",
    overwrite: bool = False,
    progress: bool = False,
    *,
    budget_bytes: int = RESTORE_BUDGET_BYTES,
) -> tuple[Path, LoopedConfig]:
    """Write the `{role}_params` of `step` (default: latest) as an HF checkpoint: what
    `save_hf(restore_model(...), ...)` writes (tokenizer files of run_dir/tokenizer/ included),
    without a model: parameters are restored to host memory one at a time, in the HF table's
    order, each one's tensors streamed to the shards and the parameter dropped before the next is
    read. Peak RAM: about the largest parameter twice (orbax's read buffer and its decoded copy),
    whatever the model's size. dtype: None writes the stored dtype. Returns (path, config).
    """
    item = params_item(role)
    ckpt = _checkpoint_dir(run_dir)
    cfg = read_config(run_dir, role)
    step, stored, verified = _stored_params(ckpt, item, step)
    param_dtype = str(jnp.dtype(stored["embed"].dtype))
    cfg = cfg.replace(param_dtype=param_dtype, compute_dtype=param_dtype)
    _check_shapes(nnx.to_pure_dict(nnx.state(abstract_model(cfg, role), nnx.Param)), stored, item)
    flat_stored = {
        tuple(k.key for k in keys): leaf
        for keys, leaf in jax.tree_util.tree_flatten_with_path(stored)[0]
    }
    tokenizer = Path(run_dir).resolve() / TOKENIZER_DIR

    def tensors(mngr):
        held: tuple[tuple[str, ...] | None, np.ndarray | None] = (None, None)
        for t in hf_entries(cfg, role):
            if held[0] != t.path:
                large = held[1] is not None and held[1].nbytes >= 2**24
                held = (None, None)  # drop the previous parameter before reading the next
                if large:  # orbax leaves a restored array in a cycle of finished futures too
                    gc.collect()
                with _unreadable_as_run_dir_error(ckpt, step, item, verified):
                    param = _restore_host(mngr, step, item, t.path, flat_stored[t.path])
                held = (t.path, param)
                del param
            # no local keeps a view of the parameter: it must be freed when `held` moves on
            yield t.name, np.ascontiguousarray(hf_view(held[1], t))

    with (
        _open(ckpt, _params_registry(item, _read_limit(stored, budget_bytes))) as mngr,
        _quiet_other_items(),
    ):
        out = write_hf(
            path,
            hf_config_dict(cfg, role),
            hf_tensor_shapes(cfg, role),
            tensors(mngr),
            dtype=dtype or param_dtype,
            max_shard_size=max_shard_size,
            tokenizer_dir=tokenizer if tokenizer.is_dir() else None,
            overwrite=overwrite,
            progress=progress,
        )
    if not verified:
        digests.warn_unverified(step, run_dir)
    return out, cfg


def _check_shapes(want: dict, stored: dict, item: str) -> None:
    """Same parameter names and shapes as the config asks for, else a one-line RunDirError."""
    want = dict(jax.tree_util.tree_flatten_with_path(want)[0])
    have = dict(jax.tree_util.tree_flatten_with_path(stored)[0])
    name = lambda path: jax.tree_util.keystr(path, simple=True, separator=".")
    for path in have:
        if path not in want:
            raise RunDirError(f"{item} has unexpected parameter {name(path)}")
    for path, leaf in want.items():
        if path not in have:
            raise RunDirError(f"{item} has no parameter {name(path)}")
        if tuple(have[path].shape) != tuple(leaf.shape):
            raise RunDirError(
                f"{item} parameter {name(path)} has shape {tuple(have[path].shape)}, "
                f"expected {tuple(leaf.shape)} from the config"
            )
