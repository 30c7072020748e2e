"""Checkpoints are untrusted files. Each malicious or malformed file is crafted here: a generator
named by the file ("test" ran numpy's test suite, "seed" reseeded numpy), zip bombs, .npy headers
that lie, a config declaring a 2,000,000-token vocabulary next to small arrays, malformed
metadata (a table, then hypothesis mutating real metadata), loads that must fail whole, configs
that differ, and files of other kinds. Loading must never run code, never allocate what the
file merely declares, and either succeed whole or change nothing."""
import io
import json
import pathlib
import pickle
import re
import struct
import tracemalloc
import warnings
import zipfile
import zlib

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import npformer
from npformer.runtime import random
from npformer import optim
from npformer.checkpoint import CheckpointError, archive, packing
from npformer.models import MODEL_CLASSES, CausalLM, Seq2SeqTransformer

from checkpoint_files import (file_with_state, members, meta_of, minimal_meta, npy, stored, with_members, with_meta,
                              write_zip)

SMALL = dict(d_model=8, nhead=2, num_encoder_layers=1, num_decoder_layers=1, dim_feedforward=16, dropout=0.0,
             max_len=16)


def seq2seq(**overrides):
    return Seq2SeqTransformer(10, 12, **{**SMALL, **overrides})


def trained(model=None, groups=1, lr=1.0):
    """A model, an Adam optimizer (with `groups` parameter groups) and a Noam schedule after one
    step: state in every part."""
    model = model or seq2seq()
    params = list(model.parameters())
    opt = optim.Adam(params if groups == 1 else [{"params": params[:3]}, {"params": params[3:]}], lr=lr)
    sched = optim.NoamLR(opt, d_model=8, warmup_steps=3)
    for p in params:
        p.grad = np.full_like(p.data, lr)
    opt.step()
    sched.step()
    return model, opt, sched


@pytest.fixture
def saved(tmp_path):
    """A real checkpoint of a small Seq2SeqTransformer with optimizer, scheduler and extra state."""
    model, opt, sched = trained()
    return npformer.save_checkpoint(tmp_path / "ck.npz", model, opt, sched, step=1,
                                    data_rng=np.random.default_rng(3), history={"loss": [1.5]})


def peak_bytes(fn):
    """(result or exception, peak bytes traced while calling fn): numpy reports its buffers."""
    tracemalloc.start()
    try:
        try:
            result = fn()
        except Exception as e:  # noqa: BLE001 - returned for the caller's assertions
            result = e
        return result, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


# -- generators: an allow-list, never a name looked up in numpy -------------------------------------------
@pytest.mark.parametrize("name", ["test", "seed", "default_rng", "__import__", "Generator"])
def test_a_generator_named_by_the_file_is_never_looked_up(tmp_path, monkeypatch, name):
    calls = []
    for attribute in ("test", "seed"):  # numpy.random.test() runs pytest (and a conftest.py from the cwd)
        monkeypatch.setattr(np.random, attribute, lambda *a, **k: calls.append(a))
    path = file_with_state(tmp_path / "evil.npz", x=("generator", {"bit_generator": name}))
    assert path.stat().st_size < 1024
    with pytest.raises(CheckpointError, match=r"evil\.npz: metadata x: bit_generator must be one of \['MT19937'"):
        npformer.load_checkpoint(path)
    assert calls == []


@pytest.mark.parametrize("name", sorted(packing.BIT_GENERATORS))
def test_every_allowed_bit_generator_round_trips(tmp_path, name):
    generator = np.random.Generator(getattr(np.random, name)(5))
    generator.random(3)
    model, _, _ = trained()
    path = npformer.save_checkpoint(tmp_path / "ck.npz", model, data_rng=generator)
    restored = npformer.load_checkpoint(path, restore_rng=False)["data_rng"]
    assert type(restored.bit_generator).__name__ == name
    np.testing.assert_array_equal(restored.random(4), generator.random(4))


def generator_state(name, **changes):
    """A fresh `name` bit generator's state with entries changed ("state/pos": value)."""
    state = getattr(np.random, name)(0).state
    for key, value in changes.items():
        *outer, last = key.split("/")
        node = state
        for k in outer:
            node = node[k]
        node[last] = value
    return state


@pytest.mark.parametrize("state, message", [
    (generator_state("MT19937", **{"state/pos": 10**6}), r"state/pos: expected an int in \[0, 624\]"),
    (generator_state("Philox", buffer_pos=-1), r"buffer_pos: expected an int in \[0, 4\]"),
    (generator_state("Philox", **{"state/key": np.zeros(3, np.uint64)}),
     r"state/key: expected a uint64 array of shape \(2,\), got uint64 \(3,\)"),
    (generator_state("PCG64", **{"state/state": "1"}), r"state/state: expected an int"),
    (generator_state("PCG64", has_uint32=True), r"has_uint32: expected an int in \[0, 1\]"),
    (generator_state("PCG64", extra=1), r"expected a dict with the keys \['bit_generator', 'has_uint32'"),
    ({"bit_generator": "SFC64"}, r"expected a dict with the keys"),
    ("PCG64", r"a generator state must be a dict, got str"),
], ids=["mt19937-pos", "philox-buffer-pos", "philox-key", "pcg64-str", "bool", "extra-key", "missing-keys",
        "not-a-dict"])
def test_generator_states_are_checked_before_numpy_sees_them(tmp_path, state, message):
    path = file_with_state(tmp_path / "g.npz", g=("generator", state))
    with pytest.raises(CheckpointError, match=r"g\.npz: metadata g.*" + message):
        npformer.load_checkpoint(path)


def test_the_saved_global_generator_state_is_checked_like_any_other(tmp_path):
    with pytest.raises(CheckpointError, match=r"metadata rng/cpu/state/pos: expected an int in \[0, 624\]"):
        npformer.load_checkpoint(file_with_state(tmp_path / "a.npz", rng={"cpu": generator_state(
            "MT19937", **{"state/pos": 625})}))
    path = file_with_state(tmp_path / "b.npz", rng={"cpu": generator_state("MT19937")})
    before = random.global_rng("cpu").bit_generator.state
    with pytest.raises(CheckpointError, match=r"metadata rng/cpu: a MT19937 state for the global PCG64 generator"):
        npformer.load_checkpoint(path)
    assert random.global_rng("cpu").bit_generator.state == before
    assert npformer.load_checkpoint(path, restore_rng=False)["rng"]["cpu"]["bit_generator"] == "MT19937"


# -- zip bombs and lying headers: nothing is allocated on the file's word ---------------------------------
BOMB_BYTES = 2 << 30  # 2 GiB of zeros, about 2 MB deflated


@pytest.fixture(scope="module")
def bomb():
    """A deflated .npy member of 2 GiB of float64 zeros, streamed (never materialised): after a
    full flush, deflate codes every 1 MiB block of zeros as the same bytes, so one block repeats.
    Returns (payload, crc, declared size)."""
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(header, {"descr": "<f8", "fortran_order": False,
                                                  "shape": (BOMB_BYTES // 8,)})
    header = header.getvalue()
    zeros = bytes(1 << 20)
    deflate = zlib.compressobj(9, zlib.DEFLATED, -15)
    start = deflate.compress(header) + deflate.flush(zlib.Z_FULL_FLUSH)
    block = deflate.compress(zeros) + deflate.flush(zlib.Z_FULL_FLUSH)
    assert deflate.compress(zeros) + deflate.flush(zlib.Z_FULL_FLUSH) == block
    payload = start + block * (BOMB_BYTES >> 20) + deflate.flush(zlib.Z_FINISH)
    crc = zlib.crc32(header)
    for _ in range(BOMB_BYTES >> 20):
        crc = zlib.crc32(zeros, crc)
    return payload, crc, len(header) + BOMB_BYTES


def with_bomb(src, dst, bomb, meta=None):
    payload, crc, size = bomb
    contents = members(src)
    if meta is not None:
        contents["meta.npy"] = npy(np.array(json.dumps(meta)))
    return write_zip(dst, [stored(k, v) for k, v in contents.items()]
                     + [("zeros.npy", payload, zipfile.ZIP_DEFLATED, crc, size)])


def test_an_unreferenced_2_gib_member_is_never_read(tmp_path, saved, bomb):
    path = with_bomb(saved, tmp_path / "bomb.npz", bomb)
    assert path.stat().st_size < 3 << 20
    ckpt, peak = peak_bytes(lambda: npformer.load_checkpoint(path, restore_rng=False))
    assert isinstance(ckpt, dict) and ckpt["step"] == 1, ckpt
    assert peak < 16 << 20


def test_a_referenced_zip_bomb_is_refused_before_decompressing(tmp_path, saved, bomb):
    meta = meta_of(saved)
    meta["extra"] = {"__array__": "zeros"}
    path = with_bomb(saved, tmp_path / "bomb.npz", bomb, meta)
    error, peak = peak_bytes(lambda: npformer.load_checkpoint(path))
    assert isinstance(error, CheckpointError) and re.search(
        r"bomb\.npz: array 'zeros' declares 2147483776 bytes compressed into \d+ \(ratio above 100\): refusing a "
        r"likely zip bomb", str(error)), error
    assert peak < 16 << 20


def test_the_total_of_the_members_read_is_bounded_by_the_file_size(tmp_path):
    """Members of SIZE_SLACK bytes may each compress well (a member that small is always allowed),
    but together they may not declare more than MAX_COMPRESSION_RATIO times the file's size."""
    zeros = npy(np.zeros(archive.SIZE_SLACK // 8 - 16))
    assert len(zeros) == archive.SIZE_SLACK
    deflate = zlib.compressobj(9, zlib.DEFLATED, -15)
    payload = deflate.compress(zeros) + deflate.flush()
    count = 4
    meta = minimal_meta(x=[{"__array__": f"a{i}"} for i in range(count)])
    path = write_zip(tmp_path / "many.npz", [stored("meta.npy", npy(np.array(json.dumps(meta))))] + [
        (f"a{i}.npy", payload, zipfile.ZIP_DEFLATED, zlib.crc32(zeros), len(zeros)) for i in range(count)])
    assert count * len(zeros) > archive.MAX_COMPRESSION_RATIO * path.stat().st_size + archive.SIZE_SLACK
    with pytest.raises(CheckpointError, match=r"many\.npz: the arrays read so far declare more than 100 times the "
                                              r"file's size: refusing a likely zip bomb"):
        npformer.load_checkpoint(path)


def raw_npy(shape, descr="<f8", data=b""):
    """A .npy member whose header says `shape` and `descr`, followed by `data` (whatever it says)."""
    buffer = io.BytesIO()
    np.lib.format.write_array_header_1_0(buffer, {"descr": descr, "fortran_order": False, "shape": shape})
    return buffer.getvalue() + data


@pytest.mark.parametrize("member, message", [
    (raw_npy((1 << 40,), data=bytes(8)), r"declares shape \(1099511627776,\) of float64 \(8796093022208 bytes\) "
                                          r"but holds 8 bytes"),
    (raw_npy((1,), data=bytes(16)), r"declares shape \(1,\) of float64 \(8 bytes\) but holds 16 bytes"),
    (raw_npy((-2, -4), data=bytes(64)), r"negative dimension in shape \(-2, -4\)"),
    (raw_npy((2,), descr="|O", data=bytes(16)), r"has dtype object; a checkpoint holds bool and numeric arrays"),
    (raw_npy((2,), descr=[("a", "<f8")], data=bytes(16)), r"has dtype \[\('a', '<f8'\)\]"),
    (raw_npy((2,), descr="<U4", data=bytes(32)), r"has dtype <U4"),
    (b"\x93NUMPY\x03\x00" + bytes(40), r"bad \.npy header"),
    (b"\x93NUMPY\x01\x00\x10\x00" + b"{'descr': (((((" + bytes(1), r"bad \.npy header"),
    (b"not an npy member", r"bad \.npy header"),
], ids=["huge-shape", "short-shape", "negative", "object", "structured", "unicode", "version-3", "garbage-header",
        "not-npy"])
def test_npy_headers_are_checked_before_allocating(tmp_path, saved, member, message):
    meta = meta_of(saved)
    meta["model"]["generator.bias"] = {"__array__": "evil"}
    path = with_members(saved, tmp_path / "evil.npz", meta=meta, evil=member)
    error, peak = peak_bytes(lambda: npformer.load_checkpoint(path))
    assert isinstance(error, CheckpointError), error
    assert "evil.npz" in str(error) and "'evil'" in str(error) and re.search(message, str(error)), str(error)
    assert peak < 16 << 20


def test_a_member_declaring_more_than_it_holds_is_corrupted(tmp_path, saved):
    """The zip directory says 928 bytes; the stored data holds 136 (a truncated member)."""
    meta = meta_of(saved)
    meta["x"] = {"__array__": "short"}
    contents = members(saved)
    contents["meta.npy"] = npy(np.array(json.dumps(meta)))
    data = npy(np.zeros(100))
    path = write_zip(tmp_path / "short.npz", [stored(k, v) for k, v in contents.items()]
                     + [("short.npy", data[:136], zipfile.ZIP_STORED, zlib.crc32(data), len(data))])
    with pytest.raises(CheckpointError, match=r"short\.npz: not a readable npformer checkpoint, the file is "
                                              r"truncated or corrupted \(array 'short'"):
        npformer.load_checkpoint(path)


def test_big_endian_and_fortran_members_load_as_native_arrays(tmp_path):
    """numpy writes either byte order and either memory order: the values count, and the arrays
    come back in this machine's byte order (a big-endian float64 file is a float64 model)."""
    model = seq2seq().double()
    path = npformer.save_checkpoint(tmp_path / "ck.npz", model)
    state = model.state_dict()
    swapped = {f"model/{k}": npy(np.asfortranarray(v).astype(v.dtype.newbyteorder(">"))) for k, v in state.items()}
    path = with_members(path, tmp_path / "big.npz", **swapped)
    loaded, ckpt = npformer.load_model(path)
    for name, value in ckpt["model"].items():
        assert value.dtype == np.float64 and value.dtype.isnative, name
        np.testing.assert_array_equal(value, state[name], err_msg=name)
    assert loaded.generator.weight.dtype == np.float64
    np.testing.assert_array_equal(loaded.generator.weight.numpy(), state["generator.weight"])


def with_member_sizes(src, dst, name, payload, compress_size, file_size):
    """A copy of checkpoint `src` with a stored member `name` (referenced by the metadata as
    "extra") whose zip entries declare the sizes given, whatever `payload` holds."""
    meta = meta_of(src)
    meta["extra"] = {"__array__": name}
    contents = members(src)
    contents["meta.npy"] = npy(np.array(json.dumps(meta)))
    path = write_zip(dst, [stored(k, v) for k, v in contents.items()]
                     + [(f"{name}.npy", payload, zipfile.ZIP_STORED, zlib.crc32(payload), file_size)])
    data = bytearray(path.read_bytes())  # write_zip declares len(payload) compressed: patch both headers
    local = data.rfind(b"PK\x03\x04", 0, data.rfind(f"{name}.npy".encode(), 0, data.rfind(b"PK\x01\x02")))
    central = data.rfind(b"PK\x01\x02")
    struct.pack_into("<I", data, local + 18, compress_size)
    struct.pack_into("<I", data, central + 20, compress_size)
    path.write_bytes(bytes(data))
    return path


@pytest.mark.parametrize("compress_size, file_size, message", [
    (8 << 20, 8 << 20, r"array 'liar' declares 8388608 bytes at offset \d+, past the end of the file \(\d+ bytes\)"),
    (60_000, 6 << 20, r"array 'liar' is stored uncompressed but declares 6291456 bytes in 60000"),
], ids=["past-the-end", "stored-size"])
def test_a_member_declaring_more_than_the_file_holds_is_refused_before_allocating(tmp_path, saved, compress_size,
                                                                               file_size, message):
    """A file of ~100 KB may declare members of up to 100 times its size in all: the sizes of a
    stored member are checked against the file itself before its array is allocated."""
    payload = raw_npy(((file_size - 128) // 8,), data=bytes(60_000 - 128))
    path = with_member_sizes(saved, tmp_path / "liar.npz", "liar", payload, compress_size, file_size)
    assert path.stat().st_size < 1 << 20
    error, peak = peak_bytes(lambda: npformer.load_checkpoint(path, restore_rng=False))
    assert peak < 4 << 20, error
    expected = r"liar\.npz: not a readable npformer checkpoint, the file is truncated or corrupted \(" + message
    assert isinstance(error, CheckpointError) and re.search(expected, str(error)), error


def test_a_member_stored_twice_is_refused(tmp_path, saved):
    """zipfile and numpy keep the last of two members of one name: the file would mean two things."""
    contents = members(saved)
    meta = meta_of(saved)
    entries = [stored(k, v) for k, v in contents.items()] + [stored("meta.npy", npy(np.array(json.dumps(
        dict(meta, step=99)))))]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # zipfile warns of the duplicate name
        path = write_zip(tmp_path / "twice.npz", entries)
    with pytest.raises(CheckpointError, match=r"twice\.npz: .*the archive holds the members \['meta\.npy'\] more "
                                              r"than once"):
        npformer.load_checkpoint(path)


# -- load_model: the config's shapes against the file's, before building anything -------------------------
def test_a_config_declaring_a_huge_vocabulary_fails_before_building(tmp_path, saved, monkeypatch):
    meta = meta_of(saved)
    meta["config"]["src_vocab_size"] = meta["config"]["tgt_vocab_size"] = 2_000_000
    path = with_meta(saved, tmp_path / "huge.npz", meta)
    built = []
    monkeypatch.setattr(Seq2SeqTransformer, "_reset_parameters", lambda self: built.append(self))
    error, peak = peak_bytes(lambda: npformer.load_model(path))
    assert isinstance(error, CheckpointError) and built == [], error
    assert peak < 16 << 20  # a model of that config holds 3 x 2,000,000 x 8 floats (192 MB)
    assert re.search(r"huge\.npz: the arrays do not match the Seq2SeqTransformer that the file's config describes "
                     r"\(nothing was built\): mis-shaped keys \(4\): src_embed\.weight: file \(10, 8\), config "
                     r"\(2000000, 8\)", str(error)), str(error)


def test_a_causal_lm_config_declaring_a_huge_vocabulary_fails_before_building(tmp_path):
    model = CausalLM(20, d_model=8, nhead=2, num_layers=1, dim_feedforward=16, max_len=16)
    path = npformer.save_checkpoint(tmp_path / "lm.npz", model)
    meta = meta_of(path)
    meta["config"]["vocab_size"] = 2_000_000
    error, peak = peak_bytes(lambda: npformer.load_model(with_meta(path, tmp_path / "huge.npz", meta)))
    assert isinstance(error, CheckpointError) and "tok_embed.weight: file (20, 8), config (2000000, 8)" in str(error)
    assert peak < 16 << 20


def test_a_config_declaring_a_huge_positional_table_fails_before_building(tmp_path, saved):
    """Sinusoidal positions are a non-persistent buffer: no array in the file bounds max_len."""
    meta = meta_of(saved)
    meta["config"]["max_len"] = 10**9
    error, peak = peak_bytes(lambda: npformer.load_model(with_meta(saved, tmp_path / "long.npz", meta)))
    assert isinstance(error, CheckpointError), error
    assert "derived buffers {'positional.pe': (1000000000, 8)}" in str(error) and "nothing was built" in str(error)
    assert peak < 16 << 20


@pytest.mark.parametrize("key", ["num_encoder_layers", "num_decoder_layers"])
def test_a_config_declaring_countless_layers_fails_before_listing_their_shapes(tmp_path, saved, monkeypatch, key):
    """10**30 layers: state_shapes would list their shapes forever. The file's 40 arrays bound
    the layers it can hold (each holds several)."""
    meta = meta_of(saved)
    meta["config"][key] = 10**30
    path = with_meta(saved, tmp_path / "layers.npz", meta)
    monkeypatch.setattr(Seq2SeqTransformer, "state_shapes", classmethod(lambda *a, **k: pytest.fail("listed")))
    with pytest.raises(CheckpointError, match=rf"layers\.npz: config: {key}={10**30} layers, but the file holds \d+ "
                                              r"non-empty arrays \(each layer holds several\)"):
        npformer.load_model(path)


SHAPE_CONFIGS = {
    "Seq2SeqTransformer": [dict(src_vocab_size=7, tgt_vocab_size=9, **SMALL),
                           dict(src_vocab_size=7, tgt_vocab_size=9, **{**SMALL, "num_decoder_layers": 2},
                                positional="learned", tie_weights=True),
                           dict(src_vocab_size=9, tgt_vocab_size=9, **SMALL, positional="rope", tie_weights="all"),
                           dict(src_vocab_size=5, tgt_vocab_size=6, **{**SMALL, "num_encoder_layers": 3},
                                positional="none", norm_first=True, pad_idx=0)],
    "CausalLM": [dict(vocab_size=11, d_model=8, nhead=2, num_layers=2, dim_feedforward=16, max_len=12),
                 dict(vocab_size=11, d_model=12, nhead=3, num_layers=1, dim_feedforward=8, max_len=12,
                      tie_weights=True, positional="sinusoidal"),
                 dict(vocab_size=11, d_model=8, nhead=2, num_layers=1, dim_feedforward=16, positional="rope",
                      activation="gelu_tanh", attention_dropout=0.0)],
    "BidirectionalEncoder": [dict(vocab_size=11, d_model=8, nhead=2, num_layers=2, dim_feedforward=16, max_len=12),
                             dict(vocab_size=11, d_model=8, nhead=2, num_layers=1, dim_feedforward=16, max_len=12,
                                  pooling="first", pooler=True, type_vocab_size=2, embed_norm=True, final_norm=False,
                                  activation="gelu_tanh")],
    "EncoderClassifier": [dict(vocab_size=11, num_classes=3, d_model=8, nhead=2, num_layers=2, dim_feedforward=16,
                               max_len=12),
                          dict(vocab_size=11, num_classes=5, d_model=8, nhead=4, num_layers=1, dim_feedforward=4,
                               max_len=7, positional="sinusoidal", pooling="first", pad_idx=0),
                          dict(vocab_size=11, num_classes=2, d_model=8, nhead=2, num_layers=1, dim_feedforward=16,
                               max_len=12, pooler=True, type_vocab_size=3, embed_norm=True, final_norm=False,
                               classifier_dropout=0.1, attention_dropout=0.0, activation_dropout=0.0)],
}


def test_every_model_class_is_in_the_load_model_allow_list_and_has_shape_cases():
    classes = {name for name in npformer.models.__all__ if isinstance(getattr(npformer.models, name), type)}
    assert set(MODEL_CLASSES) == classes == set(SHAPE_CONFIGS)


@pytest.mark.parametrize("name, config", [(n, c) for n, configs in SHAPE_CONFIGS.items() for c in configs])
def test_state_shapes_are_the_shapes_of_the_built_model(name, config):
    cls = MODEL_CLASSES[name]
    model = cls(**config)
    assert cls.state_shapes(model.config) == {k: v.shape for k, v in model.state_dict().items()}
    everything = {k: t.shape for k, t in [*model.named_parameters(), *model.named_buffers()]}
    assert cls.state_shapes(model.config, persistent=False) == everything


# -- malformed metadata: always a CheckpointError naming the file and the place -----------------------------
def edit(meta, *path, value=None, delete=False):
    node = meta
    for key in path[:-1]:
        node = node[key]
    if delete:
        del node[path[-1]]
    else:
        node[path[-1]] = value
    return meta


def nested(depth):
    value = 0
    for _ in range(depth):
        value = [value]
    return value


MALFORMED = [
    ("list-meta", lambda m: [m], r"not an npformer checkpoint \(no 'npformer-checkpoint' format tag\)"),
    ("no-format", lambda m: edit(m, "format", delete=True), r"no 'npformer-checkpoint' format tag"),
    ("version-str", lambda m: edit(m, "version", value="1"), r"metadata version: expected an int >= 1, got 1"),
    ("version-bool", lambda m: edit(m, "version", value=True), r"metadata version: expected an int >= 1"),
    ("version-newer", lambda m: edit(m, "version", value=99), r"format version 99 is newer"),
    ("no-model", lambda m: edit(m, "model", delete=True), r"the metadata lacks the entries \['model'\]"),
    ("no-rng", lambda m: edit(m, "rng", delete=True), r"lacks the entries \['rng'\]"),
    ("model-list", lambda m: edit(m, "model", value=[1]), r"metadata model: expected None or a dict of arrays"),
    ("model-number", lambda m: edit(m, "model", "generator.bias", value=5),
     r"metadata model/generator\.bias: expected an array, got int"),
    ("array-ref-int", lambda m: edit(m, "model", "generator.bias", value={"__array__": 5}),
     r"metadata model/generator\.bias references the array 5, which the file does not hold"),
    ("array-ref-missing", lambda m: edit(m, "model", "generator.bias", value={"__array__": "nothere"}),
     r"references the array 'nothere', which the file does not hold"),
    ("array-ref-meta", lambda m: edit(m, "model", "generator.bias", value={"__array__": "meta"}),
     r"references the array 'meta'"),
    ("marker-and-key", lambda m: edit(m, "model", "generator.bias", value={"__array__": "x", "y": 1}),
     r"model/generator\.bias: a '__array__' entry must be alone, got the keys \['__array__', 'y'\]"),
    ("tuple-dict", lambda m: edit(m, "history", value={"__tuple__": {"a": 1}}),
     r"metadata history: '__tuple__' must hold a list, got dict"),
    ("items-bad-pair", lambda m: edit(m, "history", value={"__items__": [[1, 2, 3]]}),
     r"metadata history/0: expected a \[key, value\] pair"),
    ("items-list-key", lambda m: edit(m, "history", value={"__items__": [[[1], 2]]}),
     r"metadata history/0: a dict key must be a string, number, None or a tuple of those, got a list"),
    ("deep", lambda m: edit(m, "history", value=nested(100)), r"metadata history/0/0/.*nested deeper than 64 levels"),
    ("config-list", lambda m: edit(m, "config", value=[1, 2]), r"metadata config: expected None or a dict"),
    ("config-int-keys", lambda m: edit(m, "config", value={"__items__": [[1, 2]]}),
     r"metadata config: expected None or a dict with string keys"),
    ("model-class", lambda m: edit(m, "model_class", value=["os", "system"]), r"metadata model_class: expected None"),
    ("optimizer-str", lambda m: edit(m, "optimizer", value="adam"), r"metadata optimizer: expected None or a dict"),
    ("rng-list", lambda m: edit(m, "rng", value=[]), r"metadata rng: expected a dict, got list"),
    ("rng-device", lambda m: edit(m, "rng", "cuda", value={}), r"metadata rng/cuda: unknown generator"),
    ("rng-name", lambda m: edit(m, "rng", "cpu", "bit_generator", value="seed"), r"metadata rng/cpu: bit_generator"),
    ("dropout-offset", lambda m: edit(m, "rng", "dropout", "offset", value=2**200),  # the first dropout overflowed
     r"metadata rng/dropout: Philox state: offset must be an integer in \[0, 18446744073709551615\]"),
    ("dropout-offset-split", lambda m: edit(m, "rng", "dropout", "offset", value=3),  # a graph replay drew other bits
     r"metadata rng/dropout: Philox state: offset must be a multiple of 8 \(whole Philox counters\), got 3"),
]


@pytest.mark.parametrize("case, mutate, message", MALFORMED, ids=[c[0] for c in MALFORMED])
def test_malformed_metadata_is_a_checkpoint_error(tmp_path, saved, case, mutate, message):
    path = with_meta(saved, tmp_path / "bad.npz", mutate(meta_of(saved)))
    with pytest.raises(CheckpointError, match=r"bad\.npz: .*" + message):
        npformer.load_checkpoint(path)


@pytest.mark.parametrize("text, message", [
    ("{", r"the metadata is not valid JSON \(JSONDecodeError"),
    ("[" * 100_000 + "]" * 100_000, r"the metadata is not valid JSON \(RecursionError"),
    ("1" * 5000, r"the metadata is not valid JSON \(ValueError"),
    ('{"format": "npformer-checkpoint", "step": 1, "step": 2}',
     r"the metadata is not valid JSON \(ValueError: the key 'step' appears twice in one JSON object"),
], ids=["truncated", "deep", "long-int", "key-twice"])
def test_metadata_that_is_not_json(tmp_path, saved, text, message):
    path = with_members(saved, tmp_path / "bad.npz", meta=npy(np.array(text)))
    with pytest.raises(CheckpointError, match=r"bad\.npz: " + message):
        npformer.load_checkpoint(path)


@pytest.mark.parametrize("value, message", [
    (np.zeros(3), r"array 'meta' has dtype float64; a checkpoint holds one JSON string there"),
    (np.array(["{}", "{}"]), r"the 'meta' entry is a \(2,\) array, not one string"),
], ids=["floats", "two-strings"])
def test_a_meta_entry_that_is_not_one_string(tmp_path, saved, value, message):
    path = with_members(saved, tmp_path / "bad.npz", meta=npy(value))
    with pytest.raises(CheckpointError, match=r"bad\.npz: .*" + message):
        npformer.load_checkpoint(path)


def snapshot(model, opt, sched):
    """Everything a load may change: tensors, optimizer state and groups, scheduler, global generator."""
    return model.state_dict(), opt.state_dict(), sched.state_dict(), random.global_rng("cpu").bit_generator.state


def assert_unchanged(before, after):
    (model_a, opt_a, sched_a, rng_a), (model_b, opt_b, sched_b, rng_b) = before, after
    assert model_a.keys() == model_b.keys()
    for name in model_a:
        np.testing.assert_array_equal(model_a[name], model_b[name], err_msg=name)
    assert opt_a["param_groups"] == opt_b["param_groups"] and opt_a["state"].keys() == opt_b["state"].keys()
    for i, state in opt_a["state"].items():
        assert state.keys() == opt_b["state"][i].keys()
        for key, value in state.items():
            np.testing.assert_array_equal(value, opt_b["state"][i][key])
    assert sched_a == sched_b and rng_a == rng_b


JSON_LEAVES = (st.none() | st.booleans() | st.integers(-3, 2**70) | st.floats(allow_nan=True) | st.text(max_size=4)
               | st.sampled_from(["__array__", "model/generator.bias", "PCG64", "MT19937", "relu", "all"]))
JSON_VALUES = st.recursive(JSON_LEAVES, lambda children: st.lists(children, max_size=3) | st.dictionaries(
    st.text(max_size=4) | st.sampled_from(packing.MARKERS), children, max_size=3), max_leaves=6)


def places(node, prefix=()):
    """Every path into a JSON value."""
    yield prefix
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for key, child in items:
        yield from places(child, prefix + (key,))


def mutate(meta, data):
    """1 to 3 mutations drawn by hypothesis: replace, delete, add an entry, nest."""
    for _ in range(data.draw(st.integers(1, 3))):
        where = data.draw(st.sampled_from(list(places(meta))))
        operation = data.draw(st.sampled_from(["replace", "delete", "add", "nest"]))
        if not where:
            meta = data.draw(JSON_VALUES) if operation == "replace" else meta
            continue
        parent = meta
        for key in where[:-1]:
            parent = parent[key]
        if operation == "replace":
            parent[where[-1]] = data.draw(JSON_VALUES)
        elif operation == "delete":
            del parent[where[-1]]
        elif operation == "nest":
            parent[where[-1]] = nested(70) if data.draw(st.booleans()) else [parent[where[-1]]]
        elif isinstance(parent[where[-1]], dict):
            key = data.draw(st.text(max_size=4) | st.sampled_from(packing.MARKERS))
            parent[where[-1]][key] = data.draw(JSON_VALUES)
    return meta


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_fuzzed_metadata_loads_whole_or_raises_a_checkpoint_error_and_changes_nothing(tmp_path, saved, data):
    path = with_meta(saved, tmp_path / "fuzzed.npz", mutate(meta_of(saved), data))
    for load in (lambda: npformer.load_checkpoint(path, restore_rng=False), lambda: npformer.load_model(path)):
        try:
            load()
        except CheckpointError as e:
            assert "fuzzed.npz" in str(e)
    model, opt, sched = trained(lr=0.5)
    before = snapshot(model, opt, sched)
    try:
        npformer.load_checkpoint(path, model, opt, sched)
    except CheckpointError:
        assert_unchanged(before, snapshot(model, opt, sched))
    except RuntimeError as e:  # the model's keys or shapes do not fit, as torch's load_state_dict says
        assert str(e).startswith("Error(s) in loading state_dict for Seq2SeqTransformer")
        assert_unchanged(before, snapshot(model, opt, sched))


def structural_offsets(path):
    """Byte offsets of a zip file's structure: each member's local header, name and .npy header
    (the first 128 bytes of its data, which hold the JSON metadata's start too), and the
    central directory with its end record."""
    with zipfile.ZipFile(path) as z:
        spots = [i for info in z.infolist() for i in range(info.header_offset, info.header_offset + 30
                                                            + len(info.filename) + 128)]
        return spots + list(range(z.start_dir, path.stat().st_size))


def mutate_bytes(data, spots, draw):
    """1 to 3 mutations drawn at `spots`: a byte, a 32-bit field (0, -1, huge, the file size), a
    deletion, an insertion."""
    data = bytearray(data)
    for _ in range(draw(st.integers(1, 3))):
        at = min(draw(st.sampled_from(spots)), len(data) - 1)
        operation = draw(st.sampled_from(["byte", "field", "delete", "insert"]))
        if operation == "byte":
            data[at] = draw(st.integers(0, 255))
        elif operation == "field":
            value = draw(st.sampled_from([0, 1, 2**31, 2**32 - 1, len(data), len(data) - at]))
            data[at:at + 4] = value.to_bytes(4, "little")
        elif operation == "delete":
            del data[at:at + draw(st.integers(1, 40))]
        else:
            data[at:at] = draw(st.binary(min_size=1, max_size=8))
    return bytes(data)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_fuzzed_bytes_load_the_saved_state_or_raise_a_checkpoint_error_and_change_nothing(tmp_path, saved, data):
    """Bytes of a real checkpoint mutated where its structure is (zip headers, .npy headers, the
    metadata, the central directory): a load gives back exactly what was saved (the zip's CRCs
    cover every member), or raises CheckpointError naming the file and changes nothing."""
    path = tmp_path / "fuzzed.npz"
    original = pathlib.Path(saved)
    path.write_bytes(mutate_bytes(original.read_bytes(), structural_offsets(original), data.draw))
    expected = npformer.load_checkpoint(saved, restore_rng=False)
    model, opt, sched = trained(lr=0.5)
    before = snapshot(model, opt, sched)
    try:
        ckpt = npformer.load_checkpoint(path, model, opt, sched)
    except CheckpointError as e:
        assert "fuzzed.npz" in str(e)
        assert_unchanged(before, snapshot(model, opt, sched))
    else:
        assert ckpt["step"] == expected["step"] and ckpt["config"] == expected["config"]
        for name, value in expected["model"].items():
            np.testing.assert_array_equal(model.state_dict()[name], value, err_msg=name)
    try:
        npformer.load_model(path)
    except CheckpointError as e:
        assert "fuzzed.npz" in str(e)


# -- all or nothing ----------------------------------------------------------------------------------------
def meta_edit(*path, value=None, delete=False):
    return lambda m: edit(m, *path, value=value, delete=delete)


def item_edit(index, key, value):
    """Set (None: delete) the optimizer state entry `key` of parameter `index` (an __items__ list)."""
    def change(meta):
        state = next(entry for i, entry in meta["optimizer"]["state"]["__items__"] if i == index)
        if value is None:
            del state[key]
        else:
            state[key] = value
        return meta
    return change


@pytest.mark.parametrize("groups, change, error, message", [
    (2, None, CheckpointError, r"optimizer state: state_dict: expected 2 parameter groups, got 1"),
    (1, meta_edit("optimizer", "param_groups", 0, "lr", value="fast"), CheckpointError,
     r"group 0: hyperparameter 'lr' must be a number"),
    (1, meta_edit("optimizer", "param_groups", 0, "betas", value=[0.9, 0.99, 0.5]), CheckpointError,
     r"group 0: betas must be like this optimizer's default \(0\.9, 0\.999\)"),
    (1, meta_edit("optimizer", "param_groups", 0, "eps", value=-1.0), CheckpointError,
     r"Adam: eps must be a finite real number >= 0, got -1\.0"),
    (1, meta_edit("optimizer", "param_groups", 0, "params", value=[0, 0]), CheckpointError,
     r"group 0 has 2 parameters"),
    (1, item_edit(3, "exp_avg", None), CheckpointError,
     r"the state of parameter 3 must have the entries \['exp_avg', 'exp_avg_sq', 'step'\]"),
    (1, item_edit(3, "step", -1), CheckpointError, r"step of parameter 3 must be an int >= 0, got -1"),
    (1, item_edit(5, "exp_avg", {"__array__": "model/generator.bias"}), CheckpointError,
     r"exp_avg of parameter 5 must be an array of the parameter's shape"),
    (1, meta_edit("scheduler", "base_lrs", value=[1.0, 1.0]), CheckpointError,
     r"scheduler state: state_dict: 2 base_lrs for 1 parameter groups"),
    (1, meta_edit("scheduler", "last_epoch", value="3"), CheckpointError, r"last_epoch must be an int >= -1"),
    (1, meta_edit("rng", "cpu", "state", value={"state": 1}), CheckpointError,
     r"metadata rng/cpu/state: expected a dict with the keys \['inc', 'state'\]"),
    (1, meta_edit("model", "generator.bias", delete=True), RuntimeError, r"missing keys \(1\): generator\.bias"),
    (1, meta_edit("config", "nhead", value=4), CheckpointError, r"config differs from the model's: nhead: file 4"),
], ids=["groups", "lr-str", "betas", "eps", "params", "missing-entry", "step", "state-shape", "scheduler-lrs",
        "last-epoch", "rng", "model-key", "config"])
def test_a_failed_load_changes_nothing(tmp_path, saved, groups, change, error, message):
    path = with_meta(saved, tmp_path / "bad.npz", change(meta_of(saved))) if change else saved
    model, opt, sched = trained(groups=groups, lr=0.5)
    before = snapshot(model, opt, sched)
    with pytest.raises(error, match=message):
        npformer.load_checkpoint(path, model, opt, sched)
    assert_unchanged(before, snapshot(model, opt, sched))


def test_module_load_state_dict_checks_every_key_before_replacing_any():
    model = seq2seq()
    before = model.state_dict()
    state = seq2seq().state_dict()
    last = list(state)[-1]
    state[last] = state[last].astype(np.complex64)  # the right shape, a dtype that does not cast to float
    with pytest.raises(RuntimeError, match=rf"keys of another kind of dtype \(1\): {last}: checkpoint complex64"):
        model.load_state_dict(state)
    state[last] = np.array(["a"] * len(state[last]))
    with pytest.raises(RuntimeError, match=r"keys of another kind of dtype \(1\)"):
        model.load_state_dict(state)
    for name, value in model.state_dict().items():
        np.testing.assert_array_equal(value, before[name], err_msg=name)


def test_optimizer_and_scheduler_load_state_dict_change_nothing_on_error():
    _, opt, sched = trained()
    other = trained(lr=0.5)
    before = snapshot(*other)
    state = opt.state_dict()
    state["state"][7] = {"step": 1, "exp_avg": np.zeros(3), "exp_avg_sq": np.zeros(3)}
    with pytest.raises(ValueError, match=r"exp_avg of parameter 7 must be an array of the parameter's shape"):
        other[1].load_state_dict(state)
    with pytest.raises(ValueError, match=r"2 base_lrs for 1 parameter groups"):
        other[2].load_state_dict({**sched.state_dict(), "base_lrs": [1.0, 2.0]})
    assert_unchanged(before, snapshot(*other))


# -- the config in the file must be the model's --------------------------------------------------------------
@pytest.mark.parametrize("key, value", [("nhead", 4), ("activation", "gelu"), ("norm_first", True),
                                        ("positional", "rope"), ("layer_norm_eps", 1e-6), ("pad_idx", 0)])
def test_a_config_that_differs_is_refused_unless_asked(tmp_path, saved, key, value):
    other = seq2seq(**{key: value})
    before = other.state_dict()
    message = rf"ck\.npz: the checkpoint's config differs from the model's: {key}: file .*, model {value!r}\."
    with pytest.raises(CheckpointError, match=message + r".*strict_config=False"):
        npformer.load_checkpoint(saved, other)
    for name, array in other.state_dict().items():
        np.testing.assert_array_equal(array, before[name])
    ckpt = npformer.load_checkpoint(saved, other, strict_config=False)
    np.testing.assert_array_equal(other.src_embed.weight.numpy(), ckpt["model"]["src_embed.weight"])


def test_a_config_entry_missing_from_an_older_file_means_the_default(tmp_path, saved):
    meta = meta_of(saved)
    del meta["config"]["layer_norm_eps"]  # as if written before the option existed
    path = with_meta(saved, tmp_path / "old.npz", meta)
    npformer.load_checkpoint(path, seq2seq())
    with pytest.raises(CheckpointError, match=r"layer_norm_eps: file 1e-05, model 0\.001"):
        npformer.load_checkpoint(path, seq2seq(layer_norm_eps=1e-3))


# -- files that are not npformer checkpoints say what they are ---------------------------------------------
def plain_npz(path):
    np.savez(path, weights=np.zeros(2), bias=np.ones(1))
    return path


def torch_zip(path):
    """What torch.save writes (a zip with a pickle), crafted without torch."""
    return write_zip(path, [stored("archive/data.pkl", pickle.dumps({"weight": 1})),
                            stored("archive/version", b"3\n"), stored("archive/data/0", bytes(16))])


def a_pickle(path):
    path.write_bytes(pickle.dumps({"a": 1}, protocol=2))
    return path


def text(path):
    path.write_text("step,loss\n1,2.5\n")
    return path


def empty(path):
    path.write_bytes(b"")
    return path


def one_array(path):
    path.write_bytes(npy(np.zeros(3)))
    return path


def other_zip(path):
    return write_zip(path, [stored("readme.txt", b"hi")])


def binary(path):
    path.write_bytes(bytes(range(256)) * 4)
    return path


@pytest.mark.parametrize("make, message", [
    (plain_npz, r"x\.npz: not an npformer checkpoint but a plain numpy \.npz archive \(arrays: weights, bias\) "
                r"without npformer's 'meta' entry"),
    (torch_zip, r"x\.npz: not an npformer checkpoint but a PyTorch checkpoint \(torch\.save's zip format\).*"
                r"npformer never unpickles files\. Load it with torch and convert with npformer\.interop\.from_torch"),
    (a_pickle, r"x\.npz: not an npformer checkpoint but a Python pickle .*load it with torch and convert with "
               r"npformer\.interop\.from_torch"),
    (text, r"x\.npz: not an npformer checkpoint but a text file \(it begins 'step,loss'"),
    (empty, r"x\.npz: not a readable npformer checkpoint: the file is empty \(0 bytes"),
    (one_array, r"x\.npz: not an npformer checkpoint but a single numpy array \(a \.npy file"),
    (other_zip, r"x\.npz: not an npformer checkpoint but a zip archive without numpy arrays \(members: readme\.txt\)"),
    (binary, r"x\.npz: not a readable npformer checkpoint, the file is truncated or corrupted \(not a zip archive\)"),
], ids=["npz", "torch-zip", "pickle", "text", "empty", "npy", "zip", "binary"])
def test_foreign_files_say_what_they_are(tmp_path, make, message):
    path = make(tmp_path / "x.npz")
    for load in (npformer.load_checkpoint, npformer.load_model):
        with pytest.raises(CheckpointError, match=message) as raised:
            load(path)
        assert "allow_pickle" not in str(raised.value) and "KeyError" not in str(raised.value)


def test_a_real_torch_checkpoint_says_to_use_interop(tmp_path, torch):
    torch.save(torch.nn.Linear(2, 3).state_dict(), tmp_path / "model.pt")
    message = r"model\.pt: not an npformer checkpoint but a PyTorch checkpoint .*npformer\.interop\.from_torch"
    with pytest.raises(CheckpointError, match=message):
        npformer.load_model(tmp_path / "model.pt")


def test_a_directory_says_it_is_one(tmp_path):
    with pytest.raises(IsADirectoryError, match=r"a directory, not a checkpoint file"):
        npformer.load_checkpoint(tmp_path)
