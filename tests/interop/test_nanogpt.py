"""nanoGPT against npformer: a torch GPT with nanoGPT's structure and names (tests/nanogpt_twin.py)
loaded with interop.from_nanogpt agrees with CausalLM on logits, loss, every gradient, 20 AdamW
steps with nanoGPT's parameter groups (optim.weight_decay_groups) and greedy generation past
block_size (generate's crop), with biases and without, in float64 and float32; ckpt.pt files
(torch.compile's prefix, the non-flash attention's mask buffers) and to_nanogpt round trips."""
import dataclasses

import numpy as np
import pytest

import npformer
import npformer.functional as F
from npformer import interop, optim
from npformer.decoding import generate
from npformer.interop.nanogpt import _pairs
from npformer.models import CausalLM

TOL = {"float64": 1e-12, "float32": 2e-5}  # relative to the largest entry compared
ARGS = dict(block_size=12, vocab_size=29, n_layer=2, n_head=2, n_embd=16, dropout=0.0)


@pytest.fixture(scope="module")
def twin(torch):
    import nanogpt_twin
    return nanogpt_twin


def build(twin, torch, bias, dtype="float64", flash=True, seed=0):
    torch.manual_seed(seed)
    config = twin.GPTConfig(**ARGS, bias=bias)
    return twin.GPT(config, flash).to(getattr(torch, dtype)), dataclasses.asdict(config)


def close(ours, theirs, dtype, what):
    ours, theirs = np.asarray(ours, dtype=np.float64), theirs.detach().double().numpy()
    assert ours.shape == theirs.shape, what
    error = np.abs(ours - theirs).max() / max(np.abs(theirs).max(), 1e-300)
    assert error <= TOL[dtype], f"{what}: relative error {error:.2e} > {TOL[dtype]}"


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("bias", [True, False])
def test_logits_loss_gradients_and_adamw_steps_match_nanogpt(twin, torch, rng, bias, dtype):
    theirs, args = build(twin, torch, bias, dtype)
    ours = interop.from_nanogpt({"model_args": args, "model": theirs.state_dict()}).train()
    assert ours.config["bias"] is bias and ours.config["residual_init"] == "gpt2"
    assert str(ours.tok_embed.weight.dtype) == dtype
    assert any(k.endswith("bias") for k in ours.state_dict()) is bias
    names = dict(_pairs(2, bias))
    theirs_opt = theirs.configure_optimizers(0.1, 1e-3, (0.9, 0.95))
    ours_opt = optim.AdamW(optim.weight_decay_groups(ours, 0.1), lr=1e-3, betas=(0.9, 0.95))
    for step in range(20):
        ids = rng.integers(0, 29, size=(3, 12))
        targets = rng.integers(0, 29, size=(3, 12))
        targets[0, :2] = -1  # nanoGPT's ignore_index
        logits, loss = theirs(torch.tensor(ids), torch.tensor(targets))
        out = ours(ids)
        ours_loss = F.cross_entropy(out.reshape(-1, 29), targets.reshape(-1), ignore_index=-1)
        if step == 0:
            close(out.numpy(), logits, dtype, "logits")
        close(ours_loss.numpy(), loss, dtype, f"loss at step {step}")
        theirs_opt.zero_grad()
        ours_opt.zero_grad()
        loss.backward()
        ours_loss.backward()
        params = dict(ours.named_parameters())
        if step == 0:
            for name, p in theirs.named_parameters():  # the tied wte once (named_parameters deduplicates)
                close(params[names[name]].grad.numpy(), p.grad, dtype, f"gradient of {name}")
        theirs_opt.step()
        ours_opt.step()
    for name, p in theirs.named_parameters():
        after, want = params[names[name]].numpy(), p
        if dtype == "float32" and name.endswith("c_attn.bias"):
            # the key bias: its gradient is 0 (softmax ignores a constant shift of the scores), so in
            # float32 Adam's normalised steps (about lr each) follow the rounding noise of that 0
            keys = slice(16, 32)
            assert np.abs(after[keys] - want[keys].detach().double().numpy()).max() <= 20 * 1e-3 * 1.01
            after, want = np.delete(after, np.arange(16, 32)), torch.cat([want[:16], want[32:]])
        close(after, want, dtype, f"{name} after 20 AdamW steps")


@pytest.mark.parametrize("bias", [True, False])
def test_greedy_generation_past_block_size_matches_nanogpt(twin, torch, rng, bias):
    theirs, args = build(twin, torch, bias, seed=1)
    theirs.eval()
    ours = interop.from_nanogpt({"model_args": args, "model": theirs.state_dict()})
    prompt = rng.integers(0, 29, size=(2, 5))
    want = theirs.generate(torch.tensor(prompt), 20, top_k=1).numpy()  # 25 tokens > block_size 12
    for use_cache in (True, False):
        np.testing.assert_array_equal(generate(ours, prompt, 20, temperature=0.0, use_cache=use_cache), want)
    with pytest.raises(ValueError, match="needs 24 positions but the model's positional table has max_len=12"):
        generate(ours, prompt, 20, temperature=0.0, crop=False)


def test_ckpt_files_round_trip(twin, torch, tmp_path, rng):
    """train.py's ckpt.pt (with torch.compile's prefix and the extra entries it saves) loads;
    to_nanogpt's dict loads into nanoGPT's GPT strictly and back through a file."""
    theirs, args = build(twin, torch, bias=False, flash=False)  # its state_dict holds h.{i}.attn.bias masks
    theirs.eval()
    assert "transformer.h.0.attn.bias" in theirs.state_dict()
    compiled = {"_orig_mod." + k: v for k, v in theirs.state_dict().items()}
    path = tmp_path / "ckpt.pt"
    torch.save({"model": compiled, "model_args": args, "optimizer": {}, "iter_num": 3, "best_val_loss": 2.5,
                "config": {"dataset": "shakespeare_char", "bias": False}}, path)
    ours = interop.from_nanogpt(path)
    assert not ours.training and ours.config["bias"] is False and ours.config["tie_weights"]
    ids = rng.integers(0, 29, size=(2, 12))
    logits, _ = theirs(torch.tensor(ids), torch.tensor(ids))
    close(ours(ids).numpy(), logits, "float64", "logits of the ckpt.pt model")

    exported = interop.to_nanogpt(ours)
    assert exported["model_args"] == args
    fresh, _ = build(twin, torch, bias=False, seed=5)
    fresh.load_state_dict(exported["model"])  # strict: every key, lm_head tied to wte
    fresh.eval()
    close(ours(ids).numpy(), fresh(torch.tensor(ids), torch.tensor(ids))[0], "float64", "logits after to_nanogpt")
    torch.save(exported, tmp_path / "back.pt")
    again = interop.from_nanogpt(tmp_path / "back.pt")
    assert again.config == ours.config
    for key, array in ours.state_dict().items():
        np.testing.assert_array_equal(again.state_dict()[key], array, err_msg=key)


def test_a_state_dict_with_model_args_and_an_untied_head(twin, torch):
    theirs, args = build(twin, torch, bias=True)
    state = {k: v.clone() for k, v in theirs.state_dict().items()}
    state["lm_head.weight"] = state["lm_head.weight"] + 1.0  # no longer the embedding
    ours = interop.from_nanogpt(state, model_args=args)
    assert not ours.config["tie_weights"]
    np.testing.assert_array_equal(ours.lm_head.weight.numpy(), state["lm_head.weight"].numpy())
    with pytest.raises(ValueError, match="tie_weights=False"):
        interop.to_nanogpt(ours)


def test_bad_checkpoints_are_refused_by_name(twin, torch, tmp_path):
    theirs, args = build(twin, torch, bias=True)
    state = theirs.state_dict()
    with pytest.raises(ValueError, match="needs model_args"):
        interop.from_nanogpt(state)
    with pytest.raises(ValueError, match=r"unknown model_args \['n_inner'\]"):
        interop.from_nanogpt(state, model_args={**args, "n_inner": 3})
    with pytest.raises(ValueError, match="missing key 'transformer.h.0.ln_1.bias'"):
        interop.from_nanogpt({k: v for k, v in state.items() if k != "transformer.h.0.ln_1.bias"}, model_args=args)
    with pytest.raises(ValueError, match="unmapped key 'transformer.h.0.ln_1.bias'"):
        interop.from_nanogpt(state, model_args={**args, "bias": False})
    with pytest.raises(ValueError, match="mis-shaped key 'transformer.wpe.weight'"):
        interop.from_nanogpt(state, model_args={**args, "block_size": 13})

    class Payload:  # a pickle that would run code: torch.load(weights_only=True) refuses it
        def __reduce__(self):
            return (print, ("ran",))
    torch.save({"model": state, "model_args": args, "extra": Payload()}, tmp_path / "evil.pt")
    with pytest.raises(Exception, match="[Ww]eights only load failed|Unsupported"):
        interop.from_nanogpt(tmp_path / "evil.pt")


@pytest.mark.parametrize("option, message", [
    (dict(positional="sinusoidal"), "positional='sinusoidal'"), (dict(activation="gelu_tanh"), "activation"),
    (dict(dim_feedforward=48), "dim_feedforward=48"), (dict(pad_idx=0), "pad_idx=0"),
    (dict(activation_dropout=0.1), "activation_dropout=0.1")])
def test_to_nanogpt_refuses_what_nanogpt_cannot_express(option, message):
    settings = dict(d_model=16, nhead=2, num_layers=1, dim_feedforward=64, max_len=8, tie_weights=True,
                    activation_dropout=0.0)
    with pytest.raises(ValueError, match=f"to_nanogpt: CausalLM\\({message}"):
        interop.to_nanogpt(CausalLM(29, **{**settings, **option}))
