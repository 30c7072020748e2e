"""Checkpoints: model, optimizer, scheduler, step, config and random state in one `.npz` file.

Layout of the file (a plain numpy `.npz`, readable with `numpy.load(path)`):
- `meta`: a JSON string: format/version, the model's `config`, the optimizer's and
  scheduler's state (with arrays replaced by references), the random state of the global
  generators (`autograd.random.global_rng`, dropout and initialisation) and every extra
  `**state` value (step, trainer history, the data generator's state, ...);
- one array per model parameter (`model/<name>`), per optimizer state entry
  (`optimizer/state/<i>/<name>`) and per array inside `**state`.

Saving is atomic: the file is written to a temporary file in the same directory, flushed
and fsynced, then renamed over `path` (`os.replace`), so a save that fails or is killed
midway leaves the previous checkpoint intact.
"""
import json
import os
import tempfile

import numpy as np

from autograd import backend, random

FORMAT, VERSION = "npformer-checkpoint", 1
_RESERVED = ("format", "version", "config", "model", "optimizer", "scheduler", "rng")


class CheckpointError(ValueError):
    """A file that is not a readable npformer checkpoint (truncated, corrupted, foreign)."""


# -- packing nested state into JSON + arrays ------------------------------------------------
def _pack(obj, path, arrays):
    """JSON-ready copy of `obj`; every array goes into `arrays` under a key derived from `path`."""
    if backend.is_array(obj):
        key = path
        while key in arrays:
            key += "_"
        arrays[key] = backend.as_numpy(obj)
        return {"__array__": key}
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, np.random.Generator):
        return {"__generator__": obj.bit_generator.state}
    if isinstance(obj, dict):
        if all(isinstance(k, str) for k in obj):
            return {k: _pack(v, f"{path}/{k}", arrays) for k, v in obj.items()}
        return {"__items__": [[k, _pack(v, f"{path}/{k}", arrays)] for k, v in obj.items()]}
    if isinstance(obj, tuple):
        return {"__tuple__": [_pack(v, f"{path}/{i}", arrays) for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        return [_pack(v, f"{path}/{i}", arrays) for i, v in enumerate(obj)]
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise TypeError(f"checkpoint state at {path!r}: cannot save a {type(obj).__name__}; "
                    "use arrays, numbers, strings, lists, tuples, dicts or numpy Generators")


def _unpack(obj, arrays):
    if isinstance(obj, list):
        return [_unpack(v, arrays) for v in obj]
    if not isinstance(obj, dict):
        return obj
    if "__array__" in obj:
        return arrays[obj["__array__"]]
    if "__generator__" in obj:
        state = obj["__generator__"]
        rng = np.random.Generator(getattr(np.random, state["bit_generator"])())
        rng.bit_generator.state = state
        return rng
    if "__items__" in obj:
        return {k: _unpack(v, arrays) for k, v in obj["__items__"]}
    if "__tuple__" in obj:
        return tuple(_unpack(v, arrays) for v in obj["__tuple__"])
    return {k: _unpack(v, arrays) for k, v in obj.items()}


# -- random state ------------------------------------------------------------------------
def _model_device(model):
    for p in model.parameters():
        return p.device
    return "cpu"


def _rng_state(devices):
    """{"cpu": bit generator state} of the host's global generator (the initialisers; CuPy's
    generator exposes no portable state), and {"dropout": {"seed", "offset"}}: the dropout
    stream's two ints, so that a resumed run draws the masks of an uninterrupted one, on any device."""
    state = {device: random.global_rng(device).bit_generator.state for device in devices if device == "cpu"}
    state["dropout"] = random.dropout_stream().state_dict()
    return state


def _dropout_state(state):
    """The saved dropout stream state, checked: two ints, 0 <= seed < 2^64, offset >= 0."""
    ints = {k: state.get(k) if isinstance(state, dict) else None for k in ("seed", "offset")}
    if (not isinstance(state, dict) or set(state) != set(ints)
            or any(isinstance(v, bool) or not isinstance(v, int) for v in ints.values())
            or not 0 <= ints["seed"] < 2**64 or ints["offset"] < 0):
        raise CheckpointError(f"rng/dropout: expected {{'seed': int in [0, 2^64), 'offset': int >= 0}}, got {state!r}")
    return ints


def _set_rng_state(states):
    dropout = _dropout_state(states["dropout"]) if "dropout" in states else None
    for device, state in states.items():
        if device in backend.available_devices():
            random.global_rng(device).bit_generator.state = state
    if dropout is not None:
        random.dropout_stream().load_state_dict(dropout)


# -- saving ------------------------------------------------------------------------------
def _write_npz(fileobj, arrays):
    np.savez(fileobj, **arrays)


def save_checkpoint(path, model, optimizer=None, scheduler=None, **state):
    """Write model, optimizer, scheduler, config, global random state and `**state` to `path`.

    state: anything nested of arrays, numbers, strings, lists, tuples, dicts and numpy
    Generators (e.g. `step=1000, trainer=trainer.state_dict()`), given back by load_checkpoint.
    The write is atomic (temporary file + fsync + os.replace). Returns `path`.
    """
    reserved = sorted(set(state) & set(_RESERVED))
    if reserved:
        raise ValueError(f"state: the names {reserved} are reserved by the checkpoint format")
    arrays = {}
    meta = {
        "format": FORMAT, "version": VERSION,
        "config": _pack(getattr(model, "config", None), "config", arrays),
        "model": _pack(model.state_dict(), "model", arrays),
        "optimizer": _pack(optimizer.state_dict(), "optimizer", arrays) if optimizer is not None else None,
        "scheduler": _pack(scheduler.state_dict(), "scheduler", arrays) if scheduler is not None else None,
        "rng": _rng_state(sorted({"cpu", _model_device(model)})),
    }
    meta.update({k: _pack(v, f"state/{k}", arrays) for k, v in state.items()})
    if "meta" in arrays:
        raise ValueError("state: an array may not be called 'meta'")
    arrays["meta"] = np.array(json.dumps(meta))

    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{os.path.basename(path)}.", suffix=".tmp")
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600: give it a normal file's permissions
        with os.fdopen(fd, "wb") as f:
            _write_npz(f, arrays)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    try:  # make the rename itself durable (POSIX; not possible on every platform)
        dir_fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    except OSError:
        pass
    return path


# -- loading -----------------------------------------------------------------------------
def _read(path):
    try:
        with np.load(path, allow_pickle=False) as npz:
            arrays = {k: npz[k] for k in npz.files}  # reading every array checks its CRC
        meta = json.loads(str(arrays.pop("meta")))
    except (FileNotFoundError, IsADirectoryError):
        raise
    except Exception as e:
        raise CheckpointError(f"{path}: not a readable npformer checkpoint, the file is truncated or "
                              f"corrupted ({type(e).__name__}: {e})") from e
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointError(f"{path}: not an npformer checkpoint (no '{FORMAT}' format tag)")
    if meta.get("version", 0) > VERSION:
        raise CheckpointError(f"{path}: checkpoint format version {meta['version']} is newer than this "
                              f"npformer's ({VERSION})")
    return meta, arrays


def load_checkpoint(path, model=None, optimizer=None, scheduler=None, restore_rng=True):
    """Read a checkpoint; load it into whichever of model/optimizer/scheduler are given.

    State arrays follow the devices of the objects they are loaded into. With restore_rng,
    the global random generators (dropout, initialisation) continue from the saved state.
    Returns a dict: "config" (rebuild with `Seq2SeqTransformer(**config)`, or use
    `load_model`), "model"/"optimizer"/"scheduler" (their state dicts), "rng", and every
    `**state` value given to save_checkpoint (numpy Generators come back as Generators).
    Raises FileNotFoundError, or CheckpointError (a ValueError) naming the path.
    """
    path = os.fspath(path)
    meta, arrays = _read(path)
    ckpt = {k: _unpack(v, arrays) for k, v in meta.items() if k not in ("format", "version")}
    for target, key in ((model, "model"), (optimizer, "optimizer"), (scheduler, "scheduler")):
        if target is None:
            continue
        if ckpt[key] is None:
            raise CheckpointError(f"{path}: the checkpoint has no {key} state to load")
        target.load_state_dict(ckpt[key])
    if restore_rng:
        _set_rng_state(ckpt["rng"])
    return ckpt


def load_model(path, device=None):
    """Rebuild the `Seq2SeqTransformer` saved at `path` from its config and weights alone,
    on `device` (default cpu), in eval mode. Returns (model, checkpoint dict)."""
    from .models import Seq2SeqTransformer

    ckpt = load_checkpoint(path, restore_rng=False)
    if not ckpt.get("config"):
        raise CheckpointError(f"{path}: the checkpoint has no model config to rebuild the model from")
    model = Seq2SeqTransformer(**ckpt["config"])
    if device is not None:
        model.to(device)
    model.load_state_dict(ckpt["model"])
    model.eval()
    return model, ckpt
