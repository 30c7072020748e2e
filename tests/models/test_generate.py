"""Text generation with the causal LM: CausalLM's KV cache (decode_step equals the full forward),
npformer.decoding.generate (greedy equals the uncached argmax loop token for token; a batch of
prompts of different lengths, left-padded, equals each prompt alone; eos; seeds), the top-k /
top-p / temperature definitions against a manual computation and Hugging Face's logits
warpers, sampling frequencies, greedy generation equal to Hugging Face's generate on a random
GPT-2, and argument errors."""
import math
import threading
import tracemalloc
import warnings

import numpy as np
import pytest

import npformer
from autograd import Tensor, backend
from npformer import interop
from npformer.decoding import generate, sample_logits, top_k_filter, top_p_filter
from npformer.models import CausalLM

from helpers import gpt2_config, randomised

POSITIONAL = ["learned", "sinusoidal", "rope", "none"]


def lm(positional="learned", vocab=50, device="cpu", **options):
    npformer.manual_seed(0)
    settings = dict(d_model=16, nhead=4, num_layers=2, dim_feedforward=32, max_len=40, positional=positional)
    return CausalLM(vocab, **{**settings, **options}).double().to(device)


def argmax_loop(model, prompt, steps):
    """The uncached reference: the whole prefix through forward() (eval mode), argmax of the last position."""
    model.eval()
    ids = np.asarray(prompt)[None]
    with npformer.no_grad():
        for _ in range(steps):
            ids = np.append(ids, [[int(model(ids).numpy()[0, -1].argmax())]], axis=1)
    return ids[0]


# -- the KV cache -------------------------------------------------------------------------------
@pytest.mark.parametrize("positional", POSITIONAL)
def test_decode_step_equals_the_full_forward(positional, device, rng):
    model = lm(positional, device=device).eval()
    ids = rng.integers(0, 50, size=(3, 9))
    with npformer.no_grad():
        full = model(ids).numpy()                                              # (B, T, V)
        cache = model.init_cache()
        steps = [model.decode_step(ids[:, :4], cache)]                         # a prompt of 4, then one by one
        steps += [model.decode_step(ids[:, t:t + 1], cache) for t in range(4, 9)]
    assert len(cache) == 9 and cache.batch_size == 3
    for i, logits in enumerate(steps):
        assert logits.device == device and logits.shape == (3, 50)
        np.testing.assert_allclose(logits.numpy(), full[:, 3 + i], atol=1e-12)


def test_decode_step_with_gradients_equals_the_full_forward(rng):
    """With autograd on, the cache concatenates (no buffers): the gradients of the stepped
    logits equal those of the same positions of the full forward."""
    model = lm(dropout=0.0)
    ids = rng.integers(0, 50, size=(2, 6))
    upstream = [rng.standard_normal((2, 50)) for _ in range(3)]
    cache = model.init_cache()
    steps = [model.decode_step(ids[:, :4], cache)] + [model.decode_step(ids[:, t:t + 1], cache) for t in (4, 5)]
    sum((s * Tensor(g)).sum() for s, g in zip(steps, upstream)).backward()
    stepped = {name: p.grad.numpy().copy() for name, p in model.named_parameters()}
    model.zero_grad()
    full = model(ids)
    sum((full[:, 3 + i] * Tensor(g)).sum() for i, g in enumerate(upstream)).backward()
    for name, p in model.named_parameters():
        np.testing.assert_allclose(stepped[name], p.grad, atol=1e-12, err_msg=name)
    assert cache.layers[0].buffers is None


@pytest.mark.parametrize("positional", POSITIONAL)
def test_left_padded_prompts_step_like_each_alone(positional, rng):
    model = lm(positional).eval()
    lengths, width = [7, 3, 5], 7
    rows = [rng.integers(0, 50, size=n) for n in lengths]
    padded = np.zeros((3, width), dtype=np.int64)
    mask = np.ones((3, width), dtype=bool)
    for b, row in enumerate(rows):
        padded[b, width - len(row):], mask[b, width - len(row):] = row, False
    following = rng.integers(0, 50, size=(3, 2))
    with npformer.no_grad():
        cache = model.init_cache()
        first = model.decode_step(padded, cache, key_padding_mask=mask).numpy()
        second = model.decode_step(following[:, :1], cache).numpy()
        third = model.decode_step(following[:, 1:], cache).numpy()
        for b, row in enumerate(rows):
            alone = model(np.concatenate([row, following[b]])[None]).numpy()[0]
            n = len(row)
            for got, want in ((first[b], alone[n - 1]), (second[b], alone[n]), (third[b], alone[n + 1])):
                np.testing.assert_allclose(got, want, atol=1e-12)


def test_forward_with_position_ids_matches_the_cache(rng):
    """forward(ids, key_padding_mask, position_ids) on the left-padded batch: what the uncached
    generate path runs."""
    model = lm().eval()
    ids = rng.integers(0, 50, size=(2, 6))
    mask = np.array([[True, True, False, False, False, False], [False] * 6])
    positions = np.maximum(np.cumsum(~mask, axis=1) - 1, 0)
    with npformer.no_grad():
        full = model(ids, key_padding_mask=mask, position_ids=positions).numpy()[:, -1]
        cached = model.decode_step(ids, model.init_cache(), key_padding_mask=mask).numpy()
    np.testing.assert_allclose(cached, full, atol=1e-12)


def test_position_ids_reach_the_learned_table_gradient(rng):
    model = lm(dropout=0.0)
    positions = np.array([[0, 0, 1, 2]])
    model(rng.integers(0, 50, size=(1, 4)), position_ids=positions).sum().backward()
    grad = model.pos_embed.weight.grad.numpy()
    assert np.abs(grad[:3]).min() > 0 and np.all(grad[3:] == 0)


def test_rope_honours_position_ids(rng):
    """Issue 29 item 2: CausalLM(positional="rope")(ids, position_ids=...) gave the logits of the
    default positions (difference 0), so packed rows whose positions restart were taken as
    contiguous. Now a restart changes the logits after it, while shifting every position by a
    constant does not (RoPE sees differences only)."""
    model = lm("rope").eval()
    ids = rng.integers(0, 50, size=(2, 5))
    packed = np.array([[0, 1, 2, 0, 1], [0, 1, 0, 1, 2]])
    with npformer.no_grad():
        default = model(ids).numpy()
        restarted = model(ids, position_ids=packed).numpy()
        shifted = model(ids, position_ids=np.arange(5) + 7).numpy()
    np.testing.assert_allclose(restarted[:, :2], default[:, :2], atol=1e-12)    # positions 0, 1 in both
    assert np.abs(restarted[:, 3:] - default[:, 3:]).max() > 1e-6              # was 0: ignored
    np.testing.assert_allclose(shifted, default, atol=1e-10)


@pytest.mark.parametrize("positional", ["learned", "sinusoidal", "rope"])
def test_decode_step_with_position_ids_continues_each_row_after_them(positional, rng):
    """decode_step(prompt, position_ids=...) equals forward with them; the next steps continue
    each row after its last given position (issue 29 item 2, in the cache)."""
    model = lm(positional).eval()
    ids = rng.integers(0, 50, size=(2, 5))
    packed = np.array([[0, 1, 2, 0, 1], [4, 5, 0, 1, 2]])
    new = rng.integers(0, 50, size=(2, 2))
    continued = np.concatenate([packed, packed[:, -1:] + [1, 2]], axis=1)       # (2, 7)
    with npformer.no_grad():
        full = model(np.concatenate([ids, new], axis=1), position_ids=continued).numpy()
        cache = model.init_cache()
        steps = [model.decode_step(ids, cache, position_ids=packed)]
        steps += [model.decode_step(new[:, t:t + 1], cache) for t in range(2)]
    for i, logits in enumerate(steps):
        np.testing.assert_allclose(logits.numpy(), full[:, 4 + i], atol=1e-12)
    with pytest.raises(ValueError, match=r"CausalLM.decode_step: position_ids must be integers of shape"):
        model.decode_step(ids, model.init_cache(), position_ids=packed[:, :3])


# -- generate -----------------------------------------------------------------------------------
@pytest.mark.parametrize("positional", POSITIONAL)
def test_greedy_equals_the_uncached_argmax_loop(positional, device, rng):
    model = lm(positional, device=device)
    model.train()  # generate runs without dropout (nn.inference_mode), the mode untouched
    prompt = rng.integers(0, 50, size=5)
    out = generate(model, prompt[None], max_new_tokens=12, temperature=0.0)
    assert out.dtype == np.int64 and out.shape == (1, 17) and model.training
    np.testing.assert_array_equal(out[0], argmax_loop(model, prompt, 12))
    np.testing.assert_array_equal(generate(model, prompt[None], 12, temperature=0.0, use_cache=False), out)


@pytest.mark.parametrize("positional", POSITIONAL)
@pytest.mark.parametrize("use_cache", [True, False])
def test_a_batch_of_different_lengths_equals_each_prompt_alone(positional, use_cache, rng):
    model = lm(positional)
    prompts = [rng.integers(0, 50, size=n) for n in (6, 1, 3, 6)]
    batch = generate(model, prompts, 10, temperature=0.0, use_cache=use_cache)
    assert isinstance(batch, list) and len(batch) == 4
    for prompt, got in zip(prompts, batch):
        alone = generate(model, [prompt], 10, temperature=0.0)[0]
        np.testing.assert_array_equal(got, alone)
        np.testing.assert_array_equal(got, argmax_loop(model, prompt, 10))
    # the same prompts as a left-padded array with a key padding mask
    padded = np.full((4, 6), 7, dtype=np.int64)
    mask = np.ones((4, 6), dtype=bool)
    for b, prompt in enumerate(prompts):
        padded[b, 6 - len(prompt):], mask[b, 6 - len(prompt):] = prompt, False
    out = generate(model, padded, 10, temperature=0.0, key_padding_mask=mask, use_cache=use_cache)
    assert out.shape == (4, 16)
    np.testing.assert_array_equal(out[:, :6], padded)
    for b, got in enumerate(batch):
        np.testing.assert_array_equal(out[b, 6:], got[len(prompts[b]):])


def test_eos_stops_rows_and_pads_after_it(rng):
    model = lm()
    prompts = [rng.integers(0, 50, size=n) for n in (4, 2)]
    free = [argmax_loop(model, p, 8)[len(p):] for p in prompts]
    eos = int(free[0][2])  # row 0 produces it at its third new token
    out = generate(model, prompts, 8, temperature=0.0, eos=eos)
    stops = [int(np.argmax(f == eos)) + 1 if (f == eos).any() else 8 for f in free]
    for b, (prompt, got) in enumerate(zip(prompts, out)):
        np.testing.assert_array_equal(got, np.concatenate([prompt, free[b][:stops[b]]]))
    padded = generate(model, np.stack([prompts[0], prompts[0]]), 8, temperature=0.0, eos=eos, pad=0)
    assert padded.shape == (2, 4 + stops[0])  # every row finished: stopped early
    assert padded[0, -1] == eos


def test_sampling_is_reproducible_with_a_seed(rng):
    model = lm()
    prompts = rng.integers(0, 50, size=(3, 4))
    a = generate(model, prompts, 12, temperature=1.3, top_k=20, top_p=0.9, seed=5)
    b = generate(model, prompts, 12, temperature=1.3, top_k=20, top_p=0.9, seed=5)
    c = generate(model, prompts, 12, temperature=1.3, top_k=20, top_p=0.9, seed=6)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)
    npformer.manual_seed(3)
    d = generate(model, prompts, 12)
    npformer.manual_seed(3)
    np.testing.assert_array_equal(generate(model, prompts, 12), d)  # seed=None: the global generator
    np.testing.assert_array_equal(generate(model, prompts, 12, top_k=1, seed=9),
                                  generate(model, prompts, 12, temperature=0.0))  # top_k=1 is greedy


# -- the filters and the sampler ---------------------------------------------------------------
def test_top_k_by_hand():
    logits = np.array([[1.0, 3.0, 2.0, 3.0, -1.0], [0.5, 0.1, 0.2, 0.3, 0.4]])
    inf = -math.inf
    np.testing.assert_array_equal(top_k_filter(logits, 2), [[inf, 3.0, inf, 3.0, inf], [0.5, inf, inf, inf, 0.4]])
    # ties with the k-th largest stay (Hugging Face's `scores < kth` rule)
    np.testing.assert_array_equal(top_k_filter(logits, 3)[0], [inf, 3.0, 2.0, 3.0, inf])
    np.testing.assert_array_equal(top_k_filter(logits, 99), logits)


def test_top_p_by_hand():
    probs = np.array([0.5, 0.05, 0.3, 0.15])  # sorted descending: 0.5, 0.3, 0.15, 0.05
    logits = np.log(probs)[None]
    inf = -math.inf
    # keep the fewest most likely tokens whose mass exceeds top_p
    np.testing.assert_array_equal(np.isfinite(top_p_filter(logits, 0.4))[0], [True, False, False, False])
    np.testing.assert_array_equal(np.isfinite(top_p_filter(logits, 0.7))[0], [True, False, True, False])
    np.testing.assert_array_equal(np.isfinite(top_p_filter(logits, 0.85))[0], [True, False, True, True])
    np.testing.assert_array_equal(np.isfinite(top_p_filter(logits, 0.96))[0], [True, True, True, True])
    np.testing.assert_array_equal(top_p_filter(logits, 0.01)[0], [math.log(0.5), inf, inf, inf])  # the top one stays
    np.testing.assert_array_equal(top_p_filter(logits, 1.0), logits)


@pytest.mark.parametrize("top_k, top_p, temperature", [(5, None, 1.0), (None, 0.8, 1.0), (7, 0.6, 0.7),
                                                      (1, None, 2.0), (None, 0.05, 1.0), (40, 0.95, 1.5)])
def test_filters_match_huggingface_warpers(top_k, top_p, temperature, transformers, torch):
    from transformers.generation import logits_process as hf
    rng = np.random.default_rng(top_k or 0)
    logits = rng.standard_normal((6, 40)) * 3
    processors = [] if temperature == 1.0 else [hf.TemperatureLogitsWarper(temperature)]
    if top_k:
        processors.append(hf.TopKLogitsWarper(top_k))
    if top_p is not None:
        processors.append(hf.TopPLogitsWarper(top_p))
    want = torch.tensor(logits)
    for p in processors:
        want = p(None, want)
    got = logits / temperature
    if top_k:
        got = top_k_filter(got, top_k)
    if top_p is not None:
        got = top_p_filter(got, top_p)
    np.testing.assert_array_equal(np.isfinite(got), torch.isfinite(want).numpy())
    np.testing.assert_allclose(got[np.isfinite(got)], want.numpy()[np.isfinite(got)], rtol=1e-15)


@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, None, None), (0.5, 3, None), (2.0, None, 0.7)])
def test_sampling_frequencies_follow_the_filtered_softmax(temperature, top_k, top_p, device):
    logits = np.array([2.0, 1.0, 0.5, 0.0, -1.0, 1.5])
    scores = logits / temperature
    if top_k:
        scores = top_k_filter(scores, top_k)
    if top_p:
        scores = top_p_filter(scores, top_p)
    expected = np.exp(scores - scores.max())
    expected /= expected.sum()
    n = 20000
    draws = sample_logits(Tensor(np.tile(logits, (n, 1)), device=device), np.random.default_rng(0),
                          temperature, top_k, top_p)
    counts = np.bincount(draws, minlength=6)
    assert np.all(counts[expected == 0] == 0)
    # each frequency within 5 standard deviations of its binomial expectation
    assert np.all(np.abs(counts - n * expected) <= 5 * np.sqrt(n * expected * (1 - expected)) + 1)


def test_filters_work_on_every_device(device, rng):
    logits = rng.standard_normal((3, 11))
    on_device = backend.to_device(logits, device)
    for got, want in ((top_k_filter(on_device, 4), top_k_filter(logits, 4)),
                      (top_p_filter(on_device, 0.6), top_p_filter(logits, 0.6))):
        assert backend.device_of(got) == device
        np.testing.assert_array_equal(backend.as_numpy(got), want)


# -- Hugging Face GPT-2 -------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_greedy_equals_huggingface_generate(dtype, torch, transformers, rng):
    hf_model = randomised(torch, transformers.GPT2LMHeadModel(gpt2_config(transformers, n_positions=40)), dtype)
    ours = interop.from_hf(hf_model)
    prompt = rng.integers(0, 61, size=(1, 6))
    want = hf_model.generate(torch.tensor(prompt), attention_mask=torch.ones(1, 6, dtype=torch.long),
                             max_new_tokens=20, do_sample=False, pad_token_id=0).numpy()
    np.testing.assert_array_equal(generate(ours, prompt, 20, temperature=0.0), want)


def test_left_padded_batch_equals_huggingface_generate(torch, transformers, rng):
    hf_model = randomised(torch, transformers.GPT2LMHeadModel(gpt2_config(transformers, n_positions=40)), "float64")
    ours = interop.from_hf(hf_model)
    lengths, width = [6, 2, 4], 6
    ids = rng.integers(1, 61, size=(3, width))
    attention = np.arange(width)[None, :] >= width - np.array(lengths)[:, None]   # left padding
    ids = np.where(attention, ids, 0)
    want = hf_model.generate(torch.tensor(ids), attention_mask=torch.tensor(attention.astype(np.int64)),
                             max_new_tokens=15, do_sample=False, pad_token_id=0).numpy()
    got = generate(ours, ids, 15, temperature=0.0, key_padding_mask=~attention)
    np.testing.assert_array_equal(got, want)


# -- errors -------------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, error, message", [
    (dict(max_new_tokens=0), ValueError, "generate: max_new_tokens must be an integer >= 1, got 0"),
    (dict(temperature=-0.5), ValueError, "generate: temperature must be a finite real number >= 0.0"),
    (dict(temperature=True), TypeError, "generate: temperature must be a finite real number"),
    (dict(top_k=2.5), TypeError, "generate: top_k must be an integer >= 0"),
    (dict(top_p=0.0), ValueError, r"generate: top_p must be a real number in \(0.0, 1.0\], got 0.0"),
    (dict(top_p=1.5), ValueError, r"generate: top_p must be a real number in \(0.0, 1.0\]"),
    (dict(eos="x"), TypeError, "generate: eos must be an integer"),
    (dict(seed=1.5), TypeError, "generate: seed must be an integer"),
    (dict(pad=-0.5), TypeError, "generate: pad must be an integer"),
    (dict(max_new_tokens=40, crop=False), ValueError,
     r"needs 43 positions but the model's positional table has max_len=40; crop=True continues"),
    (dict(crop=1), TypeError, "generate: crop must be True or False"),
])
def test_bad_arguments(kwargs, error, message):
    with pytest.raises(error, match=message):
        generate(lm(), np.ones((1, 4), dtype=np.int64), **{"max_new_tokens": 3, **kwargs})


def test_bad_prompts():
    model = lm()
    ids = np.ones((2, 3), dtype=np.int64)
    with pytest.raises(ValueError, match="must be left-padded"):
        generate(model, ids, 2, key_padding_mask=np.array([[False, False, True], [False] * 3]))
    with pytest.raises(ValueError, match=r"rows \[1\] of key_padding_mask are all padding"):
        generate(model, ids, 2, key_padding_mask=np.array([[False] * 3, [True] * 3]))
    with pytest.raises(ValueError, match="bool array of the shape of ids"):
        generate(model, ids, 2, key_padding_mask=np.zeros((2, 2), dtype=bool))
    with pytest.raises(ValueError, match="non-empty 1-D sequence of integer token ids"):
        generate(model, [[1, 2], []], 2)
    with pytest.raises(ValueError, match="non-empty 2-D array"):
        generate(model, np.ones((2, 3)), 2)
    with pytest.raises(IndexError, match=r"token ids must be in \[0, 49\]"):
        generate(model, np.array([[1, 50]]), 2)
    with pytest.raises(TypeError, match="expected a causal LM"):
        generate(npformer.nn.Linear(2, 2), ids, 2)
    with pytest.raises(TypeError, match="cache must come from init_cache"):
        model.decode_step(ids, object())


def test_the_readme_fine_tuning_example_runs_on_a_gpt2_shaped_folder(tmp_path, monkeypatch, safetensors):
    """The README's fine-tuning block (fenced `py`: it needs the download) on a folder laid out
    like it, with GPT-2's vocabulary and tiny layers: it trains and writes a folder that loads."""
    import pathlib
    import re

    from npformer.models import load_pretrained
    from helpers import GPT2, gpt2_download
    readme = (pathlib.Path(__file__).resolve().parents[2] / "README.md").read_text()
    block = [b for b in re.findall(r"```py\n(.*?)```", readme, re.S) if "save_pretrained(" in b][0]
    tiny = CausalLM(50257, d_model=8, nhead=2, num_layers=1, dim_feedforward=32, max_len=16, **GPT2)
    gpt2_download(tmp_path / "gpt2", tiny)
    np.save(tmp_path / "my_tokens.npy", np.random.default_rng(0).integers(0, 50257, size=400))
    monkeypatch.chdir(tmp_path)
    exec(compile(block, "README.md", "exec"), {})
    tuned = load_pretrained(tmp_path / "gpt2-finetuned")
    before = load_pretrained(tmp_path / "gpt2")
    assert tuned.config == before.config
    changed = [name for name, array in tuned.state_dict().items()
               if not np.array_equal(array, before.state_dict()[name])]
    assert "tok_embed.weight" in changed and len(changed) == len(tuned.state_dict())


# -- edge cases and bad input (the issue 17 audit) ----------------------------------------------
def sampled_reference(model, prompt, mask, steps, seed, temperature=1.0):
    """generate's sampling loop without the cache: forward on the whole prefix with the prompt's
    padding masked and positions counting real tokens (generated tokens are never padding)."""
    rng = np.random.default_rng(seed)
    ids, mask = np.asarray(prompt), np.asarray(mask)
    model.eval()
    with npformer.no_grad():
        for _ in range(steps):
            positions = np.maximum(np.cumsum(~mask, axis=1) - 1, 0)
            logits = model(ids, key_padding_mask=mask, position_ids=positions)[:, -1]
            ids = np.concatenate([ids, sample_logits(logits, rng, temperature)[:, None]], axis=1)
            mask = np.concatenate([mask, np.zeros((len(ids), 1), dtype=bool)], axis=1)
    return ids


@pytest.mark.parametrize("use_cache", [True, False])
def test_a_model_with_pad_idx_masks_the_prompts_padding_only(use_cache):
    """CausalLM(pad_idx=0): pad ids in the prompt are its (left) padding, as Hugging Face's generate
    infers attention_mask from pad_token_id; a generated token equal to pad_idx is a token. With a
    6-token vocabulary the sampled continuations produce id 0, which must not be masked out."""
    model = lm(vocab=6, pad_idx=0)
    prompt = np.array([[0, 0, 3, 1], [2, 5, 4, 1], [0, 4, 4, 2]])
    got = generate(model, prompt, 16, temperature=1.0, seed=3, use_cache=use_cache)
    assert (got[:, 4:] == 0).any(), "the test needs a generated pad_idx token"
    np.testing.assert_array_equal(got, sampled_reference(model, prompt, prompt == 0, 16, seed=3))
    greedy = generate(model, prompt, 8, temperature=0.0, use_cache=use_cache)
    for b, row in enumerate(prompt):
        np.testing.assert_array_equal(greedy[b, 4:], argmax_loop(model, row[row != 0], 8)[(row != 0).sum():])


def test_a_model_with_pad_idx_refuses_prompts_it_cannot_pad():
    model = lm(pad_idx=0)
    with pytest.raises(ValueError, match=r"rows \[0\] of .*are all padding"):
        generate(model, np.array([[0, 0, 0], [1, 2, 3]]), 2)
    with pytest.raises(ValueError, match="must be left-padded"):
        generate(model, np.array([[1, 0, 3], [1, 2, 3]]), 2)
    # an explicit mask decides: a pad id inside the prompt is then a token
    out = generate(model, np.array([[1, 0, 3]]), 3, temperature=0.0, key_padding_mask=np.zeros((1, 3), dtype=bool))
    np.testing.assert_array_equal(out[0], sampled_reference(model, [[1, 0, 3]], np.zeros((1, 3), dtype=bool), 3,
                                                            seed=0, temperature=0.0)[0])


def test_tiny_temperatures_are_greedy_without_overflow():
    model = lm()
    prompt = np.array([[1, 2, 3], [4, 5, 6]])
    greedy = generate(model, prompt, 6, temperature=0.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # numpy's overflow / invalid-value warnings: the NaN of the past
        for temperature in (1e-6, 1e-300, 1e-320, 5e-324):
            np.testing.assert_array_equal(generate(model, prompt, 6, temperature=temperature, seed=0), greedy)
        logits = np.array([[1.0, 3.0, 2.0]], dtype=np.float32)
        assert sample_logits(logits, np.random.default_rng(0), temperature=1e-45).tolist() == [1]


@pytest.mark.parametrize("logits", [[[np.nan, 1.0, 2.0]], [[-np.inf, -np.inf, -np.inf]], [[np.inf, 1.0, 0.0]]])
def test_sampling_refuses_logits_without_a_distribution(logits):
    """Never a silent token 0 from NaN probabilities (torch.multinomial raises too)."""
    with pytest.raises(ValueError, match=r"sample_logits: logits rows \[0\] give no probability distribution"):
        sample_logits(np.array(logits), np.random.default_rng(0), temperature=1.0)


@pytest.mark.parametrize("call, error, message", [
    (lambda x, g: sample_logits(x, g, temperature=-1.0), ValueError, "sample_logits: temperature must be a finite "
                                                                      "real number >= 0.0, got -1.0"),
    (lambda x, g: sample_logits(x, g, temperature=True), TypeError, "sample_logits: temperature must be"),
    (lambda x, g: sample_logits(x, g, top_k=-1), ValueError, "sample_logits: top_k must be an integer >= 0, got -1"),
    (lambda x, g: sample_logits(x, g, top_p=1.5), ValueError, r"sample_logits: top_p must be a real number in "
                                                               r"\(0.0, 1.0\], got 1.5"),
    (lambda x, g: sample_logits(x[0], g), ValueError, r"sample_logits: logits must be \(batch, vocabulary\) "
                                                       r"with a vocabulary of at least one entry, got shape \(3,\)"),
    (lambda x, g: sample_logits(x, None), TypeError, "sample_logits: rng must be a numpy.random.Generator, "
                                                      "got NoneType"),
    (lambda x, g: top_k_filter(x, 0), ValueError, "top_k_filter: top_k must be an integer >= 1, got 0"),
    (lambda x, g: top_k_filter(x, 1.5), TypeError, "top_k_filter: top_k must be an integer >= 1"),
    (lambda x, g: top_k_filter(x, True), TypeError, r"top_k_filter: top_k must be .*a bool"),
    (lambda x, g: top_p_filter(x, 0.0), ValueError, r"top_p_filter: top_p must be a real number in \(0.0, 1.0\]"),
    (lambda x, g: top_p_filter(x, -1), ValueError, r"top_p_filter: top_p must be a real number in \(0.0, 1.0\]"),
    (lambda x, g: top_p_filter(x, float("nan")), ValueError, "top_p_filter: top_p must be a real number"),
])
def test_the_sampling_functions_check_their_arguments(call, error, message):
    with pytest.raises(error, match=message):
        call(np.array([[1.0, 3.0, 2.0]]), np.random.default_rng(0))


def test_numpy_scalars_are_accepted_for_every_number():
    model, ids = lm(), np.array([[1, 2, 3], [4, 5, 6]])
    plain = generate(model, ids, 4, 0.7, 5, 0.9, eos=3, seed=1, pad=2)
    numpy = generate(model, ids, np.int32(4), np.float64(0.7), np.int64(5), np.float64(0.9), eos=np.int16(3),
                     seed=np.uint64(1), pad=np.uint8(2))
    np.testing.assert_array_equal(numpy, plain)
    np.testing.assert_array_equal(generate(model, ids, 4, np.float32(0.5), seed=1),
                                  generate(model, ids, 4, float(np.float32(0.5)), seed=1))
    logits = np.array([[1.0, 3.0, 2.0]])
    np.testing.assert_array_equal(top_k_filter(logits, np.int64(2)), top_k_filter(logits, 2))
    np.testing.assert_array_equal(top_p_filter(logits, np.float32(0.5)), top_p_filter(logits, 0.5))


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(eos=-1), ValueError, r"generate: eos must be an integer in \[0, 49\], got -1"),
    (dict(eos=50), ValueError, r"generate: eos must be an integer in \[0, 49\], got 50"),
    (dict(pad=-1), ValueError, r"generate: pad must be an integer in \[0, 49\], got -1"),
    (dict(pad=50), ValueError, r"generate: pad must be an integer in \[0, 49\], got 50"),
    (dict(seed=-1), ValueError, "generate: seed must be an integer >= 0, got -1"),
    (dict(use_cache="no"), TypeError, "generate: use_cache must be True or False, got 'no'"),
    (dict(key_padding_mask=[[True], [False, False]]), ValueError, "generate: key_padding_mask must be a rectangular"),
    (dict(ids=np.array([[1, -1]])), IndexError, r"generate: ids token ids must be in \[0, 49\] \(vocabulary size 50\), "
                                                r"got min -1 and max 1"),
    (dict(ids=np.array([[1, 2 ** 63]], dtype=np.uint64)), IndexError, r"generate: ids token ids must be in \[0, 49\] "
                                                                      r"\(vocabulary size 50\), got min 1 and max "
                                                                      r"9223372036854775808"),
    (dict(ids=[np.array([1, 2]), np.array([60])]), IndexError, r"generate: ids token ids must be in \[0, 49\]"),
])
def test_bad_special_ids_seeds_and_prompts(kwargs, error, message):
    """Ids outside the vocabulary (eos could never be produced; pad is fed back for finished rows)
    and negative seeds are refused at generate, naming the argument."""
    arguments = {"ids": np.ones((2, 4), dtype=np.int64), **kwargs}
    with pytest.raises(error, match=message):
        generate(lm(), arguments.pop("ids"), 3, **arguments)


def test_the_positional_table_is_filled_to_its_last_position():
    """The last new token is never fed back: a prompt of P tokens with n new needs P + n - 1 positions."""
    model = lm()  # max_len=40
    for width, new in ((39, 2), (40, 1)):
        prompt = np.arange(width)[None] % 50
        out = generate(model, prompt, new, temperature=0.0)
        assert out.shape == (1, 40 + 1)
        np.testing.assert_array_equal(out, generate(model, prompt, new, temperature=0.0, use_cache=False))
        np.testing.assert_array_equal(out[0], argmax_loop(model, prompt[0], new))
    with pytest.raises(ValueError, match="a prompt of 40 tokens plus max_new_tokens=2 needs 41 positions"):
        generate(model, np.ones((1, 40), dtype=np.int64), 2, crop=False)


def test_generation_runs_without_dropout_in_train_mode():
    """As documented: no dropout during generation (nn.inference_mode), model.training untouched."""
    model = lm(dropout=0.5).train()
    ids = np.array([[1, 2, 3]])
    first = generate(model, ids, 8, temperature=0.0)
    assert model.training
    np.testing.assert_array_equal(first, generate(model, ids, 8, temperature=0.0))
    np.testing.assert_array_equal(first, generate(model.eval(), ids, 8, temperature=0.0))


def test_generate_gives_the_same_tokens_while_another_thread_trains_the_model(rng):
    """Issue 29 item 4: generate flipped the shared model into eval mode and back while a training
    thread flipped it too (74 of 562 greedy generations differed). Lockstep, so every run
    interleaves the same way: before each decoding step the training thread finds the model
    in its train mode, runs a training forward and backward with dropout on and flips the mode
    (as a loop that evaluates does). The generations equal the one computed alone, every time."""
    model = lm("rope", dropout=0.5)
    ids = np.array([[1, 2, 3], [4, 5, 6]])
    alone = generate(model, ids, 6, temperature=0.0)
    batch = rng.integers(0, 50, size=(2, 5))
    go, done, stop = threading.Semaphore(0), threading.Semaphore(0), threading.Event()
    found = []  # model.training as the training thread finds it

    def train():
        while go.acquire() and not stop.is_set():
            found.append(model.training)
            model.eval()
            model.train()
            model(batch).sum().backward()
            done.release()
    decode_step = model.decode_step

    def decode_step_after_a_training_step(*args, **kwargs):
        go.release()
        done.acquire()
        return decode_step(*args, **kwargs)
    model.decode_step = decode_step_after_a_training_step
    trainer = threading.Thread(target=train)
    trainer.start()
    try:
        generations = [generate(model, ids, 6, temperature=0.0) for _ in range(4)]
    finally:
        stop.set()
        go.release()
        trainer.join()
    assert len(found) == 4 * 6 and all(found) and model.training
    for out in generations:
        np.testing.assert_array_equal(out, alone)


@pytest.mark.parametrize("use_cache", [True, False])
def test_a_huge_max_new_tokens_costs_only_what_is_produced(use_cache):
    """Issue 29 item 8: generate(..., max_new_tokens=10**9, eos=...) allocated its output (7.45 GiB)
    up front; it grows as tokens come, so a row that stops at eos costs what it produced."""
    model = lm("rope").eval()  # no positional table bounds max_new_tokens
    ids = np.array([[1, 2, 3]])
    eos = int(generate(model, ids, 3, temperature=0.0)[0, -1])  # produced by step 2 at the latest
    tracemalloc.start()
    try:
        out = generate(model, ids, 10**9, temperature=0.0, eos=eos, use_cache=use_cache)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert out.shape[1] <= 6 and out[0, -1] == eos
    assert peak < 2**22, f"peak {peak} bytes"  # 4 MiB


def _nan_logits_at(model, step, row):
    """model.project made to give NaN logits for batch row `row` at its call `step` (0-based)."""
    project, calls = model.project, []

    def project_with_nan(hidden):
        logits = project(hidden)
        if len(calls) == step:
            logits.data[row] = np.nan
        calls.append(None)
        return logits
    model.project = project_with_nan


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("use_cache", [True, False])
def test_nan_logits_raise_naming_the_step_and_row(temperature, use_cache):
    """Issue 29 item 10b: greedy decoding of NaN logits returned token 0 silently."""
    model = lm().eval()
    _nan_logits_at(model, step=2, row=1)
    with pytest.raises(ValueError, match=r"generate: step 2: .*rows \[1\]"):
        generate(model, np.array([[1, 2, 3], [4, 5, 6]]), 5, temperature=temperature, seed=0, use_cache=use_cache)


def test_greedy_sampling_refuses_nan_logits():
    with pytest.raises(ValueError, match=r"sample_logits: .*rows \[1\] hold NaN"):
        sample_logits(np.array([[0.0, 1.0], [np.nan, 0.0]]), np.random.default_rng(0), temperature=0.0)


# -- past the positional table: crop to the last max_len tokens (nanoGPT's generate) ---------------
def cropped_argmax_loop(model, prompt, steps, window):
    """The reference: at every step the last `window` tokens through forward() from position 0."""
    model.eval()
    ids = np.asarray(prompt)[None]
    with npformer.no_grad():
        for _ in range(steps):
            ids = np.append(ids, [[int(model(ids[:, -window:]).numpy()[0, -1].argmax())]], axis=1)
    return ids[0]


@pytest.mark.parametrize("positional", ["learned", "sinusoidal"])
@pytest.mark.parametrize("use_cache", [True, False])
def test_generation_past_the_table_crops_to_the_last_max_len_tokens(positional, use_cache):
    model = lm(positional, max_len=8)
    for width in (3, 11):  # a prompt inside the table, one already past it
        prompt = (np.arange(width) * 7 + 1) % 50
        out = generate(model, prompt[None], 12, temperature=0.0, use_cache=use_cache)
        np.testing.assert_array_equal(out[0], cropped_argmax_loop(model, prompt, 12, 8))


def test_cropped_generation_of_a_padded_batch_equals_each_prompt_alone():
    model = lm(max_len=6)
    prompts = [np.array([5, 9, 2, 7]), np.array([3]), np.array([1, 2, 3, 4, 5, 6, 7, 8])]
    together = generate(model, prompts, 9, temperature=0.0)
    for prompt, row in zip(prompts, together):
        alone = generate(model, prompt[None], 9, temperature=0.0)[0]
        np.testing.assert_array_equal(row, alone)
        np.testing.assert_array_equal(row, cropped_argmax_loop(model, prompt, 9, 6))


def test_rotary_generation_goes_past_max_len_without_cropping():
    """RoPE has no table: max_len does not bound generation, and nothing is cropped."""
    model = lm("rope", max_len=4)
    prompt = np.array([4, 8, 15, 16, 23])
    out = generate(model, prompt[None], 6, temperature=0.0)
    np.testing.assert_array_equal(out[0], argmax_loop(model, prompt, 6))
