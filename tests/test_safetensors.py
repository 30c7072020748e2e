"""safetensors files: every npformer model round-trips bit for bit and rebuilds from the file
alone; GPT-2/BERT models are stored under Hugging Face's names, so transformers reads our files
and a Hugging Face folder (config.json + model.safetensors, laid out like a GPT-2 download)
loads with npformer.models.load_pretrained; npformer -> safetensors -> HF -> npformer keeps
every number. Foreign, truncated and damaged files are refused with SafetensorsError naming the
file, before anything is allocated, leaving the model unchanged; writes are atomic and keep
the file's mode."""
import json
import os
import pathlib
import re
import stat
import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from npformer import interop, models, nn
from npformer.models import huggingface, load_pretrained, load_safetensors, save_pretrained, save_safetensors
from npformer.safetensors_file import SafetensorsError, read_header, read_safetensors, write_safetensors

from helpers import GPT2, gpt2_download

pytestmark = pytest.mark.usefixtures("safetensors")
SMALL = dict(d_model=8, nhead=2, num_layers=2, dim_feedforward=16, max_len=12)
BERT = dict(pooling="first", pooler=True, type_vocab_size=2, embed_norm=True, final_norm=False, layer_norm_eps=1e-12,
            attention_dropout=0.1, activation_dropout=0.0, pad_idx=0)
MODELS = {
    "seq2seq": lambda: models.Seq2SeqTransformer(11, 11, d_model=8, nhead=2, num_encoder_layers=1, num_decoder_layers=1,
                                                 dim_feedforward=16, tie_weights="all"),
    "causal_lm_rope": lambda: models.CausalLM(13, positional="rope", **SMALL),
    "causal_lm": lambda: models.CausalLM(13, **SMALL),
    "gpt2": lambda: models.CausalLM(13, **SMALL, **GPT2),
    "bert": lambda: models.BidirectionalEncoder(13, **SMALL, **BERT),
    "bert_classifier": lambda: models.EncoderClassifier(13, 3, **SMALL, **BERT, classifier_dropout=0.2),
    "classifier": lambda: models.EncoderClassifier(13, 3, **SMALL),
}
HF_NAMED = {"causal_lm", "gpt2", "bert", "bert_classifier"}


def assert_same_weights(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    for key in sa:
        assert sa[key].dtype == sb[key].dtype, key
        np.testing.assert_array_equal(sa[key], sb[key], err_msg=key)


def hf_folder(model, folder):
    """save_pretrained(model, folder) with model.safetensors rewritten as transformers writes it:
    the same tensors, metadata {"format": "pt"} only, so no npformer record of the config.json
    beside it: a folder whose config.json a test edits is untrusted input, not a torn save."""
    save_pretrained(model, folder)
    path = os.path.join(folder, "model.safetensors")
    write_safetensors(path, read_safetensors(path)[0], {"format": "pt"})
    return pathlib.Path(folder)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("name", list(MODELS))
def test_round_trip_rebuilds_the_model_bit_for_bit(name, dtype, tmp_path):
    ours = MODELS[name]().to(dtype=dtype)
    path = save_safetensors(ours, tmp_path / "model.safetensors")
    header, metadata = read_header(path)
    info = json.loads(metadata["npformer"])
    assert metadata["format"] == "pt" and info["class"] == type(ours).__name__ and info["config"] == ours.config
    assert info["names"] == ("huggingface" if name in HF_NAMED else "npformer")
    if name in HF_NAMED:
        assert set(header) == set(huggingface.hf_state_dict(ours))
    else:
        assert set(header) == set(ours.state_dict())
    back = load_safetensors(path)
    assert type(back) is type(ours) and back.config == ours.config
    assert_same_weights(ours, back)
    into = MODELS[name]().to(dtype=dtype)
    assert load_safetensors(path, into) is into
    assert_same_weights(ours, into)


def test_a_module_without_config_loads_into_a_given_module(tmp_path):
    layer = nn.TransformerEncoderLayer(8, 2, 16)
    path = save_safetensors(layer, tmp_path / "layer.safetensors")
    with pytest.raises(SafetensorsError, match="pass model="):
        load_safetensors(path)
    other = nn.TransformerEncoderLayer(8, 2, 16)
    assert_same_weights(layer, load_safetensors(path, other))


def test_npformer_to_safetensors_to_hf_to_npformer_keeps_every_number(tmp_path, torch, transformers):
    for name, cls in (("gpt2", transformers.GPT2LMHeadModel), ("bert", transformers.BertModel),
                      ("bert_classifier", transformers.BertForSequenceClassification)):
        for dtype in ("float32", "float64"):
            ours = MODELS[name]().to(dtype=dtype)
            folder = save_pretrained(ours, tmp_path / f"{name}-{dtype}")
            hf_model = cls.from_pretrained(folder, dtype=getattr(torch, dtype))
            back = interop.from_hf(hf_model)
            assert back.config == ours.config, name
            assert_same_weights(ours, back)
            assert_same_weights(ours, load_pretrained(folder))
            again = tmp_path / f"{name}-{dtype}-hf"
            hf_model.save_pretrained(again)  # transformers' own file: prefixed names, no npformer metadata
            assert_same_weights(ours, load_pretrained(again))
            assert_same_weights(ours, load_safetensors(again / "model.safetensors", MODELS[name]().to(dtype=dtype)))


def test_load_pretrained_reads_a_gpt2_download(tmp_path, rng):
    ours = models.CausalLM(13, d_model=8, nhead=2, num_layers=2, dim_feedforward=32, max_len=12, **GPT2)
    folder = gpt2_download(tmp_path / "gpt2", ours)
    loaded = load_pretrained(folder)
    assert isinstance(loaded, models.CausalLM) and not loaded.training
    assert loaded.config == ours.config
    assert_same_weights(ours, loaded)
    ids = rng.integers(0, 13, size=(2, 12))
    np.testing.assert_array_equal(loaded(ids).numpy(), ours.eval()(ids).numpy())
    assert load_pretrained(folder, dtype="float64").tok_embed.weight.dtype == np.float64


def test_load_pretrained_skips_bert_pretraining_heads_with_a_warning(tmp_path):
    ours = MODELS["bert"]()
    folder = tmp_path / "bert"
    folder.mkdir()
    config = dict(huggingface.hf_config(ours), architectures=["BertForPreTraining"])
    (folder / "config.json").write_text(json.dumps(config))
    tensors = {"bert." + k: v for k, v in huggingface.hf_state_dict(ours).items()}
    tensors = {k.replace("LayerNorm.weight", "LayerNorm.gamma").replace("LayerNorm.bias", "LayerNorm.beta"): v
               for k, v in tensors.items()}  # the names of BERT's original checkpoints
    tensors["cls.predictions.bias"] = np.zeros(13, dtype="float32")
    tensors["bert.embeddings.position_ids"] = np.arange(12)[None]
    write_safetensors(folder / "model.safetensors", tensors, {"format": "pt"})
    with pytest.warns(UserWarning, match=r"skipped 1 tensors .* 'cls\.predictions\.bias'"):
        loaded = load_pretrained(folder)
    assert isinstance(loaded, models.BidirectionalEncoder)
    assert_same_weights(ours, loaded)


def test_load_pretrained_errors_name_the_file(tmp_path):
    ours = models.CausalLM(13, **SMALL, **GPT2)
    folder = hf_folder(ours, tmp_path / "ok")
    with pytest.raises(NotADirectoryError, match="not a folder"):
        load_pretrained(tmp_path / "nowhere")
    config = json.loads((folder / "config.json").read_text())
    bad = tmp_path / "bad_config"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps(dict(config, activation_function="silu")))
    os.link(os.path.join(folder, "model.safetensors"), bad / "model.safetensors")
    with pytest.raises(SafetensorsError, match=r"config\.json: GPT-2 config: activation_function='silu'"):
        load_pretrained(bad)
    (bad / "config.json").write_text("{not json")
    with pytest.raises(SafetensorsError, match=r"config\.json: not a JSON model config"):
        load_pretrained(bad)
    (bad / "config.json").write_text(json.dumps(config)[:-1] + ', "n_layer": 3}')  # json.loads keeps the last
    with pytest.raises(SafetensorsError, match=r"config\.json: not a JSON model config \(ValueError: the key 'n_layer' "
                                               r"appears twice in one JSON object\)"):
        load_pretrained(bad)
    (bad / "config.json").write_text(json.dumps(dict(config, n_layer=3)))
    with pytest.raises(SafetensorsError, match=r"config\.json: the config implies a CausalLM of 2,016 entries but the "
                                               r"weights hold 1,416 \(nothing was built\)"):
        load_pretrained(bad)
    (bad / "config.json").write_text(json.dumps({k: v for k, v in config.items() if k != "n_embd"}))
    with pytest.raises(SafetensorsError, match=r"config\.json: missing 'n_embd'"):
        load_pretrained(bad)
    (bad / "config.json").write_text(json.dumps(config) + " " * models.pretrained.MAX_CONFIG_BYTES)
    with pytest.raises(SafetensorsError, match=r"config\.json: more than 16777216 bytes, too large for a model config"):
        load_pretrained(bad)
    if os.path.exists("/dev/zero"):  # endless: was read whole (memory ran out), as its size is 0
        (bad / "config.json").unlink()
        (bad / "config.json").symlink_to("/dev/zero")
        with pytest.raises(SafetensorsError, match=r"config\.json: more than 16777216 bytes"):
            load_pretrained(bad)


# -- untrusted files ------------------------------------------------------------------------
def safetensors_bytes(header, data=b""):
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + data


DUPLICATE = b'{"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}, ' \
            b'"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}'  # json.loads would keep the last
DAMAGED = {
    "empty": (b"", "too short"),
    "npz": (b"PK\x03\x04" + b"\x00" * 60, "header claims"),
    "text": (b"hello, this is a text file and certainly not tensors\n" * 3, "header claims"),
    "torch_pickle": (b"\x80\x02\x8a\x0alo\xfc\x9cF\xf9 j\xa8P\x19.\x80\x02}q\x00" * 4, "header claims"),
    "header_not_json": (struct.pack("<Q", 4) + b"{{{{", "not JSON"),
    "header_a_list": (safetensors_bytes([1, 2]), "not a JSON object"),
    "header_nested_too_deep": (struct.pack("<Q", 200000) + b"[" * 200000, "not JSON: RecursionError"),
    "header_not_utf8": (struct.pack("<Q", 2) + b"\xff\xfe", "not JSON: UnicodeDecodeError"),
    "unknown_dtype": (safetensors_bytes({"w": {"dtype": "F8", "shape": [1], "data_offsets": [0, 1]}}, b"\0"),
                      "unknown dtype 'F8'"),
    "bfloat16_short": (safetensors_bytes({"w": {"dtype": "BF16", "shape": [2], "data_offsets": [0, 2]}}, b"\0\0"),
                       "needs 4 bytes"),
    "negative_shape": (safetensors_bytes({"w": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}, b"\0" * 4),
                       "list of ints >= 0"),
    "size_mismatch": (safetensors_bytes({"w": {"dtype": "F32", "shape": [10 ** 9], "data_offsets": [0, 4]}},
                                        b"\0" * 4), "needs 4000000000 bytes"),
    "truncated_data": (safetensors_bytes({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, b"\0" * 8),
                       "describes 16 bytes of data, the file holds 8"),
    "overlap": (safetensors_bytes({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                                   "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, b"\0" * 12),
                "without gaps or overlaps"),
    "extra_field": (safetensors_bytes({"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4], "x": 1}},
                                      b"\0" * 4), "exactly dtype, shape and data_offsets"),
    "metadata_not_strings": (safetensors_bytes({"__metadata__": {"a": 1}}), "strings to strings"),
    "metadata_a_list": (safetensors_bytes({"__metadata__": []}), "strings to strings"),
    "metadata_false": (safetensors_bytes({"__metadata__": False}), "strings to strings"),
    "dtype_not_a_string": (safetensors_bytes({"w": {"dtype": ["F32"], "shape": [1], "data_offsets": [0, 4]}},
                                             b"\0" * 4), r"unknown dtype \['F32'\]"),
    "duplicate_names": (struct.pack("<Q", len(DUPLICATE)) + DUPLICATE + b"\0" * 4,
                        "the key 'w' appears twice in one JSON object"),
    "bool_shape": (safetensors_bytes({"w": {"dtype": "F32", "shape": [True], "data_offsets": [0, 4]}}, b"\0" * 4),
                   "list of ints"),
}


@pytest.mark.parametrize("name", list(DAMAGED))
def test_foreign_and_damaged_files_are_refused_and_change_nothing(name, tmp_path):
    content, message = DAMAGED[name]
    path = tmp_path / f"{name}.safetensors"
    path.write_bytes(content)
    model = MODELS["gpt2"]()
    before = model.state_dict()
    for load in (lambda: load_safetensors(path, model), lambda: load_safetensors(path), lambda: read_safetensors(path)):
        with pytest.raises(SafetensorsError, match=message) as info:
            load()
        assert str(path) in str(info.value)
    assert_same_weights_dict(before, model.state_dict())


def assert_same_weights_dict(a, b):
    assert list(a) == list(b)
    for key in a:
        np.testing.assert_array_equal(a[key], b[key], err_msg=key)


HEADER_BYTES = st.sampled_from(list(b'0123456789,:[]{}" -eE.') + [0, 0xFF, 0xC3])


@settings(max_examples=100, deadline=None)
@given(data=st.data())
def test_fuzzed_headers_load_what_they_say_or_raise_and_change_nothing(tmp_path_factory, data):
    """Bytes of a real file's length field and JSON header mutated: a load raises SafetensorsError
    naming the file and leaves the model as it was, or loads, and then (when the header still
    describes the same tensors) exactly the weights saved."""
    folder = tmp_path_factory.mktemp("fuzz")
    source = MODELS["gpt2"]()
    original = pathlib.Path(save_safetensors(source, folder / "model.safetensors"))
    content = bytearray(original.read_bytes())
    end = 8 + int.from_bytes(content[:8], "little")
    for _ in range(data.draw(st.integers(1, 3))):
        at = data.draw(st.integers(0, end - 1))
        operation = data.draw(st.sampled_from(["byte", "delete", "insert", "length"]))
        if operation == "byte":
            content[at] = data.draw(HEADER_BYTES)
        elif operation == "delete":
            del content[at:at + data.draw(st.integers(1, 8))]
        elif operation == "insert":
            content[at:at] = bytes(data.draw(st.lists(HEADER_BYTES, min_size=1, max_size=4)))
        else:
            content[:8] = (end - 8 + data.draw(st.integers(-4, 4))).to_bytes(8, "little")
    path = folder / "fuzzed.safetensors"
    path.write_bytes(bytes(content))
    target = MODELS["gpt2"]()
    before = target.state_dict()
    try:
        load_safetensors(path, target)
    except SafetensorsError as e:
        assert "fuzzed.safetensors" in str(e)
        assert_same_weights_dict(before, target.state_dict())
    else:
        if read_header(path)[0] == read_header(original)[0]:
            assert_same_weights(source, target)
    try:
        load_safetensors(path)
    except SafetensorsError as e:
        assert "fuzzed.safetensors" in str(e)


def test_a_huge_declared_header_is_refused_before_reading_it(tmp_path):
    path = tmp_path / "huge.safetensors"
    path.write_bytes(struct.pack("<Q", 2 ** 62) + b"{}")
    with pytest.raises(SafetensorsError, match=r"header claims 4611686018427387904 bytes but the file has 2"):
        read_header(path)


def test_files_that_do_not_fit_change_nothing(tmp_path):
    source = MODELS["gpt2"]()
    path = save_safetensors(source, tmp_path / "gpt2.safetensors")
    for target, message in ((models.CausalLM(13, **dict(SMALL, num_layers=1), **GPT2), "unmapped key"),
                            (models.CausalLM(13, **dict(SMALL, d_model=4), **GPT2), "mis-shaped key"),
                            (MODELS["bert"](), "holds a CausalLM, not a BidirectionalEncoder")):
        before = target.state_dict()
        with pytest.raises(SafetensorsError, match=message):
            load_safetensors(path, target)
        assert_same_weights_dict(before, target.state_dict())
    ours_named = save_safetensors(MODELS["classifier"](), tmp_path / "classifier.safetensors")
    smaller = models.EncoderClassifier(13, 2, **SMALL)
    before = smaller.state_dict()
    with pytest.raises(SafetensorsError, match=r"does not fit the model: (?s:.*)classifier\.weight"):
        load_safetensors(ours_named, smaller)
    assert_same_weights_dict(before, smaller.state_dict())


@pytest.mark.parametrize("name, extra, message", [
    ("gpt2", "h.0.ln_1.weight", r"the keys 'h\.0\.ln_1\.weight' and 'transformer\.h\.0\.ln_1\.weight' are two values "
                                r"of one weight \('h\.0\.ln_1\.weight'\)"),
    ("bert", "embeddings.LayerNorm.gamma", r"the keys 'embeddings\.LayerNorm\.gamma' and "
                                           r"'embeddings\.LayerNorm\.weight' are two values of one weight"),
], ids=["prefixed-and-not", "gamma-and-weight"])
def test_two_names_for_one_weight_are_refused(name, extra, message, tmp_path):
    """Hugging Face names are read prefixed or not, and BERT's gamma/beta as weight/bias: a file
    holding both spellings of one weight (different values) means two things."""
    source = MODELS[name]()
    tensors = huggingface.hf_state_dict(source)
    tensors[extra] = np.full(8, 7.0, dtype="float32")
    path = write_safetensors(tmp_path / "two.safetensors", tensors, {"format": "pt"})
    target = MODELS[name]()
    before = target.state_dict()
    with pytest.raises(SafetensorsError, match=r"two\.safetensors: " + message):
        load_safetensors(path, target)
    assert_same_weights_dict(before, target.state_dict())


def test_metadata_is_checked_and_never_names_code(tmp_path):
    model = MODELS["causal_lm_rope"]()
    arrays = model.state_dict()
    for info, message in (({"format": "npformer-safetensors", "version": 1, "class": "os.system", "config": {},
                            "names": "npformer"}, "unknown model class 'os.system'"),
                          ({"format": "other"}, "no 'npformer-safetensors' format tag"),
                          ({"format": "npformer-safetensors", "version": 99}, "version 99"),
                          ({"format": "npformer-safetensors", "version": True}, "version True"),
                          ({"format": "npformer-safetensors", "version": 1, "class": ["CausalLM"], "config": {},
                            "names": "npformer"}, r"unknown model class \['CausalLM'\]"),
                          ({"format": "npformer-safetensors", "version": 1, "class": "CausalLM",
                            "config": {"vocab_size": 13, "bogus": 1}, "names": "npformer"}, "cannot build CausalLM")):
        path = write_safetensors(tmp_path / "m.safetensors", arrays, {"npformer": json.dumps(info)})
        with pytest.raises(SafetensorsError, match=message):
            load_safetensors(path)
    twice = '{"format": "npformer-safetensors", "class": "CausalLM", "class": "BidirectionalEncoder"}'
    for text in ("{not json", twice):
        path = write_safetensors(tmp_path / "m.safetensors", arrays, {"npformer": text})
        with pytest.raises(SafetensorsError, match="damaged npformer metadata"):
            load_safetensors(path)
    path = write_safetensors(tmp_path / "plain.safetensors", arrays)
    with pytest.raises(SafetensorsError, match="load_pretrained"):
        load_safetensors(path)
    assert_same_weights(model, load_safetensors(path, MODELS["causal_lm_rope"]()))
    with pytest.raises(FileNotFoundError):
        load_safetensors(tmp_path / "missing.safetensors")
    with pytest.raises(IsADirectoryError):
        load_safetensors(tmp_path)


def test_writes_are_atomic_and_keep_the_mode(tmp_path, monkeypatch):
    model = MODELS["gpt2"]()
    path = tmp_path / "model.safetensors"
    save_safetensors(model, path)
    os.chmod(path, 0o640)
    first = path.read_bytes()
    save_safetensors(MODELS["gpt2"](), path)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o640 and path.read_bytes() != first
    kept = path.read_bytes()

    import safetensors.numpy

    def fail_midway(tensors, filename, metadata=None):
        with open(filename, "wb") as f:
            f.write(b"half a file")
        raise OSError("disk full")
    monkeypatch.setattr(safetensors.numpy, "save_file", fail_midway)
    with pytest.raises(OSError, match="disk full"):
        save_safetensors(model, path)
    assert path.read_bytes() == kept and os.listdir(tmp_path) == ["model.safetensors"]
    monkeypatch.undo()
    umask = os.umask(0o022)
    try:
        fresh = save_safetensors(model, tmp_path / "fresh.safetensors")
    finally:
        os.umask(umask)
    assert stat.S_IMODE(os.stat(fresh).st_mode) == 0o644


def test_write_refuses_what_safetensors_cannot_store(tmp_path):
    with pytest.raises(TypeError, match="dtype complex128"):
        write_safetensors(tmp_path / "x.safetensors", {"z": np.zeros(2, dtype=complex)})
    with pytest.raises(TypeError, match="metadata must map strings to strings"):
        write_safetensors(tmp_path / "x.safetensors", {"z": np.zeros(2)}, {"a": 1})
    assert not os.listdir(tmp_path)


def test_the_readme_gpt2_example_runs_on_a_gpt2_shaped_folder(tmp_path, monkeypatch, capsys):
    """The README's GPT-2 block (fenced `py`: it needs a download) on a folder laid out like the
    download, with GPT-2's vocabulary and tiny layers."""
    readme = (pathlib.Path(__file__).resolve().parent.parent / "README.md").read_text()
    block = re.search(r"```py\n(.*?)```", readme, re.S).group(1)
    assert 'load_pretrained("gpt2")' in block
    tiny = models.CausalLM(50257, d_model=8, nhead=2, num_layers=1, dim_feedforward=32, max_len=16, **GPT2)
    gpt2_download(tmp_path / "gpt2", tiny)
    monkeypatch.chdir(tmp_path)
    exec(compile(block, "README.md", "exec"), {})
    printed = json.loads(capsys.readouterr().out)
    assert printed[:5] == [15496, 11, 616, 3290, 318] and len(printed) == 13


def test_a_config_declaring_a_huge_model_fails_before_building(tmp_path, monkeypatch):
    """vocab 3,000,000 beside the arrays of a vocab-13 model: refused from the header and config
    alone (no embedding table is ever built), in an npformer file and in a Hugging Face folder."""
    model = MODELS["gpt2"]()
    config = dict(model.config, vocab_size=3_000_000)
    info = {"format": "npformer-safetensors", "version": 1, "class": "CausalLM", "config": config, "names": "npformer"}
    path = write_safetensors(tmp_path / "m.safetensors", model.state_dict(), {"npformer": json.dumps(info)})

    def never(*args, **kwargs):
        raise AssertionError("the model was built")

    monkeypatch.setattr(nn.Embedding, "__init__", never)
    with pytest.raises(SafetensorsError, match=r"implies a CausalLM of [\d,]+ entries but the weights hold [\d,]+"):
        load_safetensors(path)
    monkeypatch.undo()
    folder = hf_folder(model, tmp_path / "gpt2")
    hf = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(dict(hf, vocab_size=3_000_000)))
    monkeypatch.setattr(nn.Embedding, "__init__", never)
    with pytest.raises(SafetensorsError, match="nothing was built"):
        load_pretrained(folder)


def test_a_config_declaring_countless_layers_fails_before_listing_their_shapes(tmp_path, monkeypatch):
    """10**30 layers: state_shapes would list their shapes forever; the file's arrays bound the
    layers it can hold (each holds several). In an npformer file and in a Hugging Face folder."""
    model = MODELS["gpt2"]()
    info = {"format": "npformer-safetensors", "version": 1, "class": "CausalLM", "names": "npformer",
            "config": dict(model.config, num_layers=10**30)}
    path = write_safetensors(tmp_path / "m.safetensors", model.state_dict(), {"npformer": json.dumps(info)})
    folder = hf_folder(model, tmp_path / "gpt2")
    hf = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(dict(hf, n_layer=10**30)))
    monkeypatch.setattr(models.CausalLM, "state_shapes", classmethod(lambda *a, **k: pytest.fail("listed")))
    message = (r"cannot build CausalLM from the stored config \(num_layers=10{30} layers, but the file holds \d+ "
               r"non-empty arrays")
    message = message.replace("10{30}", str(10**30))
    with pytest.raises(SafetensorsError, match=r"m\.safetensors: " + message):
        load_safetensors(path)
    with pytest.raises(SafetensorsError, match=r"config\.json: " + message):
        load_pretrained(folder)


def test_empty_tensors_do_not_inflate_the_declared_layer_count(tmp_path, monkeypatch):
    """Issue 29.7: config.json with n_layer=60000, n_embd=2 beside 60,000 empty tensors (3.5 MB)
    took 25.6 s and 1.3 GiB before failing: the layer cap counted arrays, empty ones too. Now
    they do not count (refused before listing a layer's shapes), and the weights the config
    implies must fit the entries the header declares (refused before building anything)."""
    config = dict(model_type="gpt2", architectures=["GPT2LMHeadModel"], vocab_size=2, n_positions=2, n_embd=2,
                  n_head=1)
    folder = tmp_path / "gpt2"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(dict(config, n_layer=60000)))
    empty = {f"e{i}": {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]} for i in range(60000)}
    (folder / "model.safetensors").write_bytes(safetensors_bytes(empty))
    monkeypatch.setattr(models.CausalLM, "state_shapes", classmethod(lambda *a, **k: pytest.fail("listed")))
    with pytest.raises(SafetensorsError, match=r"gpt2/config\.json: cannot build CausalLM from the stored config "
                                               r"\(num_layers=60000 layers, but the file holds 0 non-empty arrays"):
        load_pretrained(folder)
    monkeypatch.undo()
    # one float each: as many arrays as layers, but 1,000 entries against the 74,012 the config implies
    (folder / "config.json").write_text(json.dumps(dict(config, n_layer=1000)))
    floats = {f"e{i}": {"dtype": "F32", "shape": [1], "data_offsets": [4 * i, 4 * i + 4]} for i in range(1000)}
    (folder / "model.safetensors").write_bytes(safetensors_bytes(floats, bytes(4000)))
    monkeypatch.setattr(nn.Embedding, "__init__", lambda *a, **k: pytest.fail("the model was built"))
    with pytest.raises(SafetensorsError, match=r"config\.json: the config implies a CausalLM of 74,012 entries but "
                                               r"the weights hold 1,000 \(nothing was built\)"):
        load_pretrained(folder)


def interrupt(monkeypatch, name, file):
    """Make `name` (a writer in npformer.models.pretrained) raise KeyboardInterrupt, as a killed
    process stops, when it writes `file`, before writing anything."""
    real = getattr(models.pretrained, name)

    def killed(path, *args, **kwargs):
        if os.path.basename(path) == file:
            raise KeyboardInterrupt
        return real(path, *args, **kwargs)
    monkeypatch.setattr(models.pretrained, name, killed)


def test_a_torn_save_pretrained_folder_is_refused_naming_the_stale_config(tmp_path, monkeypatch):
    """Issue 29.3: a second save's model.safetensors (relu, eps 1e-3), the writer killed before
    its config.json (the first save's gelu, eps 1e-5, stays): load_pretrained loaded it with
    logits 0.069 off. The weights record the sha256 of the config.json written after them, so
    the folder is refused, naming config.json; killed before the weights, the folder keeps the
    first save whole. The weights alone still load (their metadata holds their config), and
    saving again mends the folder."""
    first = models.CausalLM(13, **SMALL, **dict(GPT2, activation="gelu", layer_norm_eps=1e-5))
    second = models.CausalLM(13, **SMALL, **dict(GPT2, activation="relu", layer_norm_eps=1e-3))
    folder = tmp_path / "gpt2"
    save_pretrained(first, folder)
    saved = {name: (folder / name).read_bytes() for name in ("config.json", "model.safetensors")}
    with monkeypatch.context() as patch:
        interrupt(patch, "write_safetensors", "model.safetensors")
        with pytest.raises(KeyboardInterrupt):
            save_pretrained(second, folder)
    assert {name: (folder / name).read_bytes() for name in saved} == saved
    assert_same_weights(first, load_pretrained(folder))
    with monkeypatch.context() as patch:
        interrupt(patch, "atomic_write", "config.json")
        with pytest.raises(KeyboardInterrupt):
            save_pretrained(second, folder)
    assert (folder / "config.json").read_bytes() == saved["config.json"]
    with pytest.raises(SafetensorsError, match=r"gpt2/config\.json is stale: .*gpt2/model\.safetensors was saved "
                                               r"beside a config\.json of sha256 [0-9a-f]{16}\.\.\., this one's is "
                                               r"[0-9a-f]{16}\.\.\. \(save_pretrained writes config\.json last"):
        load_pretrained(folder)
    alone = load_safetensors(folder / "model.safetensors")
    assert alone.config == second.config
    assert_same_weights(second, alone)
    save_pretrained(second, folder)
    assert_same_weights(second, load_pretrained(folder))


def test_the_config_digest_is_checked_as_metadata(tmp_path):
    model = MODELS["gpt2"]()
    for digest in ("abc", 5, "A" * 64):
        info = {"format": "npformer-safetensors", "version": 1, "class": "CausalLM", "config": model.config,
                "names": "npformer", "config_sha256": digest}
        path = write_safetensors(tmp_path / "m.safetensors", model.state_dict(), {"npformer": json.dumps(info)})
        with pytest.raises(SafetensorsError, match=rf"damaged npformer metadata \(config_sha256 {digest!r}, expected "
                                                   r"64 lowercase hex digits\)"):
            load_safetensors(path)


def test_write_refuses_metadata_and_names_it_cannot_store(tmp_path):
    path = tmp_path / "w.safetensors"
    with pytest.raises(TypeError, match=r"write_safetensors: metadata must map strings to strings \(a dict\), "
                                        r"got list"):
        write_safetensors(path, {"a": np.zeros(1)}, metadata=[("a", "b")])
    with pytest.raises(ValueError, match="write_safetensors: '__metadata__' is the header's metadata entry"):
        write_safetensors(path, {"__metadata__": np.zeros(1)})
    assert not path.exists()


@pytest.mark.parametrize("changes, message", [
    (dict(activation_function=["gelu"]), r"activation_function=\['gelu'\] has no npformer counterpart"),
    (dict(tie_word_embeddings="false"), "tie_word_embeddings must be true or false, got 'false'"),
    (dict(model_type=["gpt2"]), r"model_type \['gpt2'\] is not supported"),
    (dict(architectures=5), r"architectures must be a list of class names, got 5"),
    (dict(architectures="GPT2LMHeadModel"), r"architectures must be a list of class names, got 'GPT2LMHeadModel'"),
    (dict(scale_attn_weights="false"), r"GPT-2 config: scale_attn_weights must be true or false, got 'false'"),
])
def test_wrong_typed_gpt2_config_fields_are_named(changes, message, tmp_path):
    folder = hf_folder(models.CausalLM(13, **SMALL, **GPT2), tmp_path / "gpt2")
    config = json.loads(pathlib.Path(folder, "config.json").read_text())
    pathlib.Path(folder, "config.json").write_text(json.dumps({**config, **changes}))
    with pytest.raises(SafetensorsError, match=r"config\.json: .*" + message):
        load_pretrained(folder)


@pytest.mark.parametrize("changes, message", [
    (dict(hidden_act={"a": 1}), r"hidden_act=\{'a': 1\} has no npformer counterpart"),
    (dict(type_vocab_size=0), "BERT config: type_vocab_size must be an integer >= 1, got 0"),
    (dict(id2label="abc"), "BERT config: id2label must map label ids to names, got str"),
    (dict(architectures={"0": "BertForSequenceClassification"}), r"architectures must be a list of class names"),
    (dict(is_decoder="false"), r"BERT config: is_decoder must be true or false, got 'false'"),
])
def test_wrong_typed_bert_config_fields_are_named(changes, message, tmp_path):
    folder = hf_folder(MODELS["bert_classifier"](), tmp_path / "bert")
    config = json.loads(pathlib.Path(folder, "config.json").read_text())
    pathlib.Path(folder, "config.json").write_text(json.dumps({**config, **changes}))
    with pytest.raises(SafetensorsError, match=r"config\.json: .*" + message):
        load_pretrained(folder)


def test_the_huggingface_page_examples_run(tmp_path, monkeypatch, capsys, transformers):
    """docs/huggingface.md's python blocks as written: the GPT-2 one on a GPT-2-shaped folder (it
    needs the download), the in-memory conversion, the Llama one and the safetensors files."""
    page = (pathlib.Path(__file__).resolve().parent.parent / "docs" / "huggingface.md").read_text()
    gpt2, *others = re.findall(r"```python\n(.*?)```", page, re.S)
    assert 'load_pretrained("gpt2")' in gpt2 and len(others) == 3
    tiny = models.CausalLM(50257, d_model=8, nhead=2, num_layers=1, dim_feedforward=32, max_len=16, **GPT2)
    gpt2_download(tmp_path / "gpt2", tiny)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()
    for block in (gpt2, *others):
        exec(compile(block, "docs/huggingface.md", "exec"), {})
    printed = json.loads(capsys.readouterr().out)
    assert printed[:5] == [15496, 11, 616, 3290, 318] and len(printed) == 13
    assert sorted(os.listdir(tmp_path / "runs" / "lm-hf")) == ["config.json", "model.safetensors"]


def test_bfloat16_tensors_read_exactly_as_float32(tmp_path):
    """BF16 entries (bits written by hand: 1.5, -2**-10, the largest bfloat16, a NaN) come back as
    float32 with the same values; the header names them bfloat16; other dtypes in the file are untouched."""
    bits = np.array([0x3FC0, 0xBA80, 0x7F7F, 0x7FC0], dtype="<u2")
    data = bits.tobytes() + np.arange(3, dtype="<f8").tobytes()
    path = tmp_path / "bf16.safetensors"
    path.write_bytes(safetensors_bytes({"w": {"dtype": "BF16", "shape": [2, 2], "data_offsets": [0, 8]},
                                        "v": {"dtype": "F64", "shape": [3], "data_offsets": [8, 32]}}, data))
    header, _ = read_header(path)
    assert header == {"w": ("bfloat16", (2, 2)), "v": ("float64", (3,))}
    arrays, _ = read_safetensors(path)
    assert arrays["w"].dtype == np.float32 and arrays["w"].shape == (2, 2)
    expected = np.array([1.5, -2.0 ** -10, np.float32(3.3895314e38), np.nan], dtype=np.float32).reshape(2, 2)
    np.testing.assert_array_equal(arrays["w"], expected)
    np.testing.assert_array_equal(arrays["v"], np.arange(3.0))
