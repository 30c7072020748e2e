"""Models in safetensors files: npformer's own, and Hugging Face GPT-2, BERT, Llama, Qwen2 and
Mistral folders.

- `save_safetensors(model, path)` / `load_safetensors(path, model=None)`: any npformer model.
  A model with a Hugging Face counterpart (CausalLM -> GPT-2, or Llama / Qwen2 / Mistral for a
  Llama-style one; BidirectionalEncoder -> BertModel, EncoderClassifier ->
  BertForSequenceClassification; see npformer.models.huggingface) is
  stored under Hugging Face's names and layouts, anything else under its state_dict names.
  The metadata holds {"format": "pt"} (what transformers expects) and "npformer": a JSON
  string with the model's class, config and which names the file uses, so load_safetensors
  rebuilds the model from the file alone.
- `load_pretrained(folder)`: a Hugging Face folder (config.json + model.safetensors, e.g. a
  GPT-2, Llama, Qwen2 or Mistral download) as an npformer model in eval mode; `save_pretrained(model, folder)` writes
  one that transformers' from_pretrained and load_pretrained both read. The weights' metadata
  records the sha256 of the config.json saved beside them ("config_sha256"), so a torn folder
  (a save interrupted between the two files) is refused instead of loading wrong numbers.

Files are untrusted: the header is checked before anything is allocated
(npformer.safetensors_file), a config implying more weights than the header declares is
refused before anything is built, the class comes from a fixed table (never a name looked up in a
module), and a load either succeeds whole or leaves the model unchanged. Errors about a file's
contents are SafetensorsError (a ValueError) naming the file.
"""
from __future__ import annotations

import hashlib
import inspect
import json
import math
import os
import re
import warnings

from autograd.checks import is_integer

from ..files import atomic_write, loads_json
from ..nn import Module
from ..nn.config import stored_config
from ..safetensors_file import SafetensorsError, read_header, read_safetensors, write_safetensors
from .bert import BidirectionalEncoder, EncoderClassifier
from .gpt import CausalLM
from .huggingface import config_from_hf, hf_config, hf_state_dict, state_dict_from_hf
from .seq2seq import Seq2SeqTransformer

FORMAT, VERSION = "npformer-safetensors", 1
# every model rebuilt from a file (safetensors here, checkpoints by npformer.load_model), by the
# class name the file stores: a fixed allow-list, a name read from a file never reaches getattr
MODEL_CLASSES = {cls.__name__: cls for cls in (Seq2SeqTransformer, CausalLM, BidirectionalEncoder, EncoderClassifier)}
HF_NAMES, OUR_NAMES = "huggingface", "npformer"
CONFIG_FILE, WEIGHTS_FILE = "config.json", "model.safetensors"
# the npformer metadata entry of save_pretrained's weights: the sha256 of the config.json saved beside them
CONFIG_DIGEST = "config_sha256"
MAX_CONFIG_BYTES = 16 * 1024 * 1024


def _has_hf_counterpart(model):
    try:
        hf_config(model)
    except ValueError:
        return False
    return True


def save_safetensors(model: Module, path: str | os.PathLike, hf_names: bool | None = None) -> str:
    """Write `model`'s weights to a safetensors file at `path` (atomically; an existing file
    keeps its mode), with its class and config in the metadata. hf_names: store Hugging Face
    names and layouts (default: when the model has a Hugging Face counterpart), else the
    model's state_dict names. Returns path."""
    if hf_names is None:
        hf_names = _has_hf_counterpart(model)
    return _save(model, path, hf_names, {})


def _save(model, path, hf_names, recorded):
    """save_safetensors' work; `recorded`: more entries of the npformer metadata (save_pretrained's
    config_sha256)."""
    arrays = hf_state_dict(model) if hf_names else model.state_dict()
    name = type(model).__name__
    info = {"format": FORMAT, "version": VERSION, "class": name if name in MODEL_CLASSES else None,
            "config": stored_config(model), "names": HF_NAMES if hf_names else OUR_NAMES, **recorded}
    return write_safetensors(path, arrays, {"format": "pt", "npformer": json.dumps(info)})


def _npformer_info(path, metadata):
    """The checked "npformer" metadata entry, or None for a file written elsewhere."""
    if "npformer" not in metadata:
        return None
    try:
        info = loads_json(metadata["npformer"])
    except (ValueError, RecursionError) as e:
        raise SafetensorsError(f"{path}: damaged npformer metadata ({type(e).__name__}: {e})") from e
    if not isinstance(info, dict) or info.get("format") != FORMAT:
        raise SafetensorsError(f"{path}: the npformer metadata has no '{FORMAT}' format tag")
    version = info.get("version")
    if not is_integer(version) or not 1 <= version <= VERSION:
        raise SafetensorsError(f"{path}: npformer safetensors version {version!r} is not one this "
                               f"npformer reads (1 to {VERSION})")
    if info.get("class") is not None and (not isinstance(info["class"], str) or info["class"] not in MODEL_CLASSES):
        raise SafetensorsError(f"{path}: unknown model class {info['class']!r} (known: {sorted(MODEL_CLASSES)})")
    if info.get("names") not in (HF_NAMES, OUR_NAMES) or not isinstance(info.get("config"), (dict, type(None))):
        raise SafetensorsError(f"{path}: damaged npformer metadata (names {info.get('names')!r}, "
                               f"config {type(info.get('config')).__name__})")
    digest = info.get(CONFIG_DIGEST)
    if digest is not None and not (isinstance(digest, str) and re.fullmatch("[0-9a-f]{64}", digest)):
        raise SafetensorsError(f"{path}: damaged npformer metadata ({CONFIG_DIGEST} {digest!r}, expected 64 "
                               f"lowercase hex digits)")
    return info


def _float_dtype(header):
    """float64 when every floating tensor of the file is float64, else float32."""
    floats = {dtype for dtype, _ in header.values() if dtype.startswith("float")}
    return "float64" if floats == {"float64"} else "float32"


LAYER_COUNTS = ("num_layers", "num_encoder_layers", "num_decoder_layers")


def check_layer_counts(config: dict, arrays: int) -> None:
    """ValueError when a layer count of an (untrusted) `config` exceeds `arrays`, the number of
    non-empty arrays in its file: every layer holds several, so the config cannot fit the file,
    and listing the shapes of its layers (state_shapes) would take time and memory without
    bound. Empty arrays do not count: a file can hold countless of them in a few bytes each."""
    for name in LAYER_COUNTS:
        value = config.get(name)
        if is_integer(value) and value > arrays:
            raise ValueError(f"{name}={value} layers, but the file holds {arrays} non-empty arrays (each layer "
                             f"holds several)")


# entries that buffers derived from the config (positional tables) may hold beyond the model's weights
MAX_DERIVED = 1 << 24


def _build(path, cls, config, header):
    """cls(**config), unless the (untrusted) config implies more weight entries than the file's
    header declares (and read_header checked the data against the file's size), or derived
    buffers larger than the model: the work before the refusal is bounded by what the file
    really holds, so a config declaring a huge model beside small or empty arrays fails
    before anything is allocated or built. The file may hold more than the weights (Hugging
    Face's causal-mask buffers, a tied lm_head.weight, BERT's pretraining heads)."""
    stored = sum(math.prod(shape) for _, shape in header.values())
    try:
        bound = inspect.signature(cls).bind(**config)
        bound.apply_defaults()
        check_layer_counts(bound.arguments, sum(1 for _, shape in header.values() if math.prod(shape)))
        weights = sum(math.prod(shape) for shape in cls.state_shapes(bound.arguments).values())
        everything = sum(math.prod(shape) for shape in cls.state_shapes(bound.arguments, persistent=False).values())
    except (TypeError, ValueError) as e:
        raise SafetensorsError(f"{path}: cannot build {cls.__name__} from the stored config ({e})") from e
    if weights > stored:
        raise SafetensorsError(f"{path}: the config implies a {cls.__name__} of {weights:,} entries but the weights "
                               f"hold {stored:,} (nothing was built)")
    if everything - weights > max(weights, MAX_DERIVED):
        raise SafetensorsError(f"{path}: the config implies buffers of {everything - weights:,} entries beside the "
                               f"{weights:,} of the {cls.__name__}'s weights (nothing was built)")
    try:
        return cls(**config)
    except (TypeError, ValueError) as e:
        raise SafetensorsError(f"{path}: cannot build {cls.__name__} from the stored config ({e})") from e


def _load_into(path, model, state):
    """model.load_state_dict(state), which checks every key and shape before copying anything."""
    try:
        model.load_state_dict(state)
    except RuntimeError as e:
        raise SafetensorsError(f"{path}: does not fit the model: {e}") from e


def load_safetensors(path: str | os.PathLike, model: Module | None = None, device: str | None = None) -> Module:
    """Load a safetensors file into `model`, or rebuild the model from the file's npformer
    metadata when `model` is None (in the file's floating dtype, on `device`, default cpu).
    A file without npformer metadata (e.g. a Hugging Face model.safetensors) loads into a given
    model with a Hugging Face counterpart (see load_pretrained for whole folders). Succeeds whole
    or leaves `model` unchanged. Returns the model. Raises FileNotFoundError or SafetensorsError."""
    path = os.fspath(path)
    header, metadata = read_header(path)
    info = _npformer_info(path, metadata)
    if model is None:
        if info is None or info.get("class") is None or info.get("config") is None:
            raise SafetensorsError(f"{path}: the file does not say which npformer model it holds (no npformer "
                                   f"class and config in its metadata): pass model=, or, for a Hugging Face "
                                   f"folder, use npformer.models.load_pretrained(folder)")
        model = _build(path, MODEL_CLASSES[info["class"]], info["config"], header).to(device, _float_dtype(header))
    elif info is not None and info.get("class") not in (None, type(model).__name__):
        raise SafetensorsError(f"{path}: holds a {info['class']}, not a {type(model).__name__}")
    if info is not None:
        hf_names = info["names"] == HF_NAMES
    else:
        hf_names = set(header) != set(model.state_dict()) and _has_hf_counterpart(model)
    arrays, _ = read_safetensors(path)
    state = arrays
    if hf_names:
        try:
            state, _ = state_dict_from_hf(model, arrays)
        except ValueError as e:
            raise SafetensorsError(f"{path}: {e}") from e
    _load_into(path, model, state)
    return model


def _read_config(path):
    """(config dict, the file's bytes) of a config.json."""
    with open(path, "rb") as f:
        raw = f.read(MAX_CONFIG_BYTES + 1)  # a bounded read: the file may be a device (/dev/zero) or still growing
    if len(raw) > MAX_CONFIG_BYTES:
        raise SafetensorsError(f"{path}: more than {MAX_CONFIG_BYTES} bytes, too large for a model config")
    try:
        config = loads_json(raw.decode("utf-8"))
    except (ValueError, RecursionError) as e:  # bad UTF-8, bad JSON, a key twice, JSON nested too deep
        raise SafetensorsError(f"{path}: not a JSON model config ({type(e).__name__}: {e})") from e
    if not isinstance(config, dict):
        raise SafetensorsError(f"{path}: not a model config (a JSON object)")
    return config, raw


def _check_same_save(config_path, weights_path, raw, info):
    """SafetensorsError naming config.json as stale when the weights record the sha256 of another
    config.json than `raw` (its bytes). save_pretrained writes the weights first and config.json
    last, so a save interrupted between the two leaves the previous config.json beside the new
    weights. Weights without the record (Hugging Face's, older npformer's) are not checked."""
    recorded = None if info is None else info.get(CONFIG_DIGEST)
    actual = hashlib.sha256(raw).hexdigest()
    if recorded is not None and recorded != actual:
        raise SafetensorsError(f"{config_path} is stale: {weights_path} was saved beside a config.json of sha256 "
                               f"{recorded[:16]}..., this one's is {actual[:16]}... (save_pretrained writes "
                               f"{CONFIG_FILE} last: an interrupted save leaves the previous one). Save the folder "
                               f"again, or load the weights alone: load_safetensors rebuilds the model from their "
                               f"own config")


def load_pretrained(folder: str | os.PathLike, device: str | None = None, dtype: str | None = None) -> Module:
    """The npformer model of a Hugging Face folder holding config.json and model.safetensors
    (GPT-2: CausalLM; LlamaForCausalLM, Qwen2ForCausalLM, MistralForCausalLM: a Llama-style
    CausalLM; BertForSequenceClassification: EncoderClassifier; other BERT models:
    BidirectionalEncoder, with the pooler when the file has one), in eval mode, on `device`
    (default cpu), in `dtype` (default: float64 if the file is, else float32).
    BERT pretraining heads (cls.*) are skipped with a warning. A folder written by
    save_pretrained whose config.json is not the one saved with its weights (a torn save) is
    refused, and so is a config option npformer does not compute (e.g. a rope_type other than
    'default' and 'linear'), by name. Raises FileNotFoundError, SafetensorsError naming the file
    (a ValueError, also for an unsupported config), or NotADirectoryError when `folder` is not a
    folder."""
    folder = os.fspath(folder)
    if not os.path.isdir(folder):
        raise NotADirectoryError(f"load_pretrained: {folder} is not a folder (expected one holding "
                                 f"{CONFIG_FILE} and {WEIGHTS_FILE})")
    config_path, weights_path = os.path.join(folder, CONFIG_FILE), os.path.join(folder, WEIGHTS_FILE)
    if not os.path.exists(weights_path) and os.path.exists(weights_path + ".index.json"):
        raise SafetensorsError(f"{folder}: sharded checkpoints ({WEIGHTS_FILE}.index.json) are not supported; "
                               f"merge the shards into one {WEIGHTS_FILE}")
    hf, raw = _read_config(config_path)
    header, metadata = read_header(weights_path)
    _check_same_save(config_path, weights_path, raw, _npformer_info(weights_path, metadata))
    pooler = any(name.endswith("pooler.dense.weight") for name in header)
    try:
        class_name, config = config_from_hf(hf, pooler=pooler)
    except (KeyError, ValueError) as e:
        detail = f"missing {e}" if isinstance(e, KeyError) else str(e)
        raise SafetensorsError(f"{config_path}: {detail}") from e
    model = _build(config_path, MODEL_CLASSES[class_name], config, header)
    model.to(device, dtype or _float_dtype(header))
    arrays, _ = read_safetensors(weights_path)
    try:
        state, skipped = state_dict_from_hf(model, arrays)
    except ValueError as e:
        raise SafetensorsError(f"{weights_path}: {e}") from e
    if skipped:
        warnings.warn(f"{weights_path}: skipped {len(skipped)} tensors of heads npformer's {class_name} does not "
                      f"have (e.g. {skipped[0]!r})", stacklevel=2)
    _load_into(weights_path, model, state)
    return model.eval()


def save_pretrained(model: Module, folder: str | os.PathLike) -> str:
    """Write `folder`/config.json (the Hugging Face config) and `folder`/model.safetensors
    (Hugging Face names, npformer metadata) for a model with a Hugging Face counterpart (GPT-2,
    BERT, Llama, Qwen2, Mistral; tied embeddings stored once, as transformers writes them), so
    that transformers' from_pretrained(folder) and load_pretrained(folder) both read it. Returns folder.
    ValueError (before writing anything) for a model without such a counterpart.

    Each file is written atomically, the weights first, recording the sha256 of the config.json
    bytes written next: a save interrupted between the two leaves the new weights beside the
    previous config.json, which load_pretrained refuses (naming config.json as stale)."""
    folder = os.fspath(folder)
    config = hf_config(model)  # refuses a model without a Hugging Face counterpart before writing
    raw = (json.dumps(config, indent=2, sort_keys=True) + "\n").encode("utf-8")
    os.makedirs(folder, exist_ok=True)
    _save(model, os.path.join(folder, WEIGHTS_FILE), True, {CONFIG_DIGEST: hashlib.sha256(raw).hexdigest()})

    def write(tmp):
        with open(tmp, "wb") as f:
            f.write(raw)
    atomic_write(os.path.join(folder, CONFIG_FILE), write)
    return folder
