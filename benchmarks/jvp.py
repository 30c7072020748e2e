"""Forward mode (JVP), ours against torch.func.jvp, side by side in one run, float32.

    python benchmarks/jvp.py [--config gpt_char] [--batch B] [--seq T] [--steps N] [--threads 2]
                             [--attention-length 4096] [--block-size 512] [--no-model] [--no-memory]

(1) The JVP of the char-level GPT's logits (train_step.py's `gpt_char` CausalLM, dropout off) with
    respect to every parameter along one random direction: ours by autograd.forward_ad (each
    parameter a dual tensor; one pass carrying the tangents, no backward), torch by torch.func.jvp
    over torch.func.functional_call of the torch.nn twin on the same weights, its attention on the
    math backend (torch's flash kernel has no forward AD). Prints the median ms of --steps runs of
    each (alternating, after one untimed run), the ratio ours/torch, and how far the two tangents
    are apart (float32 rounding).
(2) The memory bound of the memory-efficient attention JVP: F.scaled_dot_product_attention
    (B = 1, H = 8, head_dim 64, causal) along random tangents at T = --attention-length, each path
    in a fresh process, measured as train_step.py measures memory: peak resident memory, in all
    and above the imported libraries. Prints both paths and the ratio memory-efficient / naive
    (the target: at most 1/4; the naive path holds several (T, T) matrices, the blockwise one
    (block, block) blocks).
Threads: npformer.set_num_threads(--threads) and torch.set_num_threads(--threads) (default 2).
"""
import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from train_step import CONFIGS, causal_config, make_batch, rss_mb  # noqa: E402  (benchmarks/ is on the path)

ATTENTION_SHAPE = (1, 8, 64)  # B, H, head_dim


class Ours:
    """The CausalLM in eval mode and one random direction per parameter."""

    def __init__(self, cfg):
        import npformer
        from npformer import models
        npformer.manual_seed(0)
        self.model = models.CausalLM(**causal_config(cfg)).eval()
        self.ids = make_batch(cfg)[1]
        rng = np.random.default_rng(1)
        modules = dict(self.model.named_modules())
        self.names = [name for name, _ in self.model.named_parameters()]
        # (module, attribute) of each parameter, where jvp() puts its dual tensor for one pass
        self.slots = [(modules[name.rpartition(".")[0]], name.rpartition(".")[2]) for name in self.names]
        self.directions = [rng.standard_normal(p.shape).astype(np.float32) for p in self.model.parameters()]

    @contextlib.contextmanager
    def parameters_set(self, values):
        """The model with its parameters replaced by `values` (named_parameters' order) inside the block."""
        params = [module._parameters[name] for module, name in self.slots]
        try:
            for (module, name), value in zip(self.slots, values):
                module._parameters[name] = value
            yield self.model
        finally:
            for (module, name), p in zip(self.slots, params):
                module._parameters[name] = p

    def jvp(self):
        """(logits, J u): every parameter replaced by a dual tensor for one forward pass."""
        from autograd import forward_ad as fwAD
        params = [module._parameters[name] for module, name in self.slots]
        with fwAD.dual_level(), self.parameters_set(map(fwAD.make_dual, params, self.directions)) as model:
            primal, tangent = fwAD.unpack_dual(model(self.ids))
        return primal.numpy(), tangent.numpy()


class Torch:
    """The torch.nn twin on ours' weights, and the same directions."""

    def __init__(self, cfg, ours):
        import torch
        from npformer.interop import torch_model_classes
        self.torch = torch
        # train mode with dropout 0: eval mode takes torch's fused encoder layer, which has no forward AD
        self.model = torch_model_classes()["CausalLM"](**causal_config(cfg)).train()
        self.model.load_state_dict({k: torch.from_numpy(np.array(v)) for k, v in ours.model.state_dict().items()})
        named = dict(self.model.named_parameters())
        self.params = {name: named[name].detach() for name in ours.names}
        self.directions = {name: torch.from_numpy(u) for name, u in zip(ours.names, ours.directions)}
        self.ids = torch.from_numpy(ours.ids)

    def jvp(self):
        torch = self.torch
        names = list(self.params)

        def logits(*values):
            return torch.func.functional_call(self.model, dict(zip(names, values)), (self.ids,))
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
            primal, tangent = torch.func.jvp(logits, tuple(self.params.values()),
                                             tuple(self.directions[n] for n in names))
        return primal.numpy(), tangent.numpy()


def model_jvp(args, cfg):
    """(1): median ms of each side, the ratio, and the tangents' difference."""
    import torch
    ours = Ours(cfg)
    theirs = Torch(cfg, ours)
    results = {"ours": ours.jvp(), "torch": theirs.jvp()}                     # untimed first runs
    times = {"ours": [], "torch": []}
    for _ in range(args.steps):
        for name, side in (("ours", ours), ("torch", theirs)):
            t0 = time.perf_counter()
            side.jvp()
            times[name].append(time.perf_counter() - t0)
    median = {name: 1e3 * statistics.median(t) for name, t in times.items()}
    (logits, tangent), (their_logits, their_tangent) = results["ours"], results["torch"]
    print(f"(1) JVP of the logits {logits.shape} w.r.t. every parameter, config {args.config} "
          f"{dict(cfg, dropout=0.0)}, threads: npformer {args.threads}, torch {torch.get_num_threads()}")
    for name in median:
        print(f"{name:>7}: {median[name]:9.1f} ms")
    print(f"ratio ours/torch: {median['ours'] / median['torch']:.2f}x")
    def apart(ours, theirs):
        return np.abs(ours - theirs).max() / np.abs(theirs).max()
    print(f"max |ours - torch| / max |torch|: logits {apart(logits, their_logits):.1e}, "
          f"tangent {apart(tangent, their_tangent):.1e}")


def attention_jvp(path, t, block_size):
    """(2), in a child process: one forward-mode call of our attention on `path`; its peak memory."""
    import npformer.functional as F
    from autograd import Tensor
    from autograd import forward_ad as fwAD
    imports = rss_mb("VmRSS")
    b, h, hd = ATTENTION_SHAPE
    rng = np.random.default_rng(0)
    arrays = [rng.standard_normal((b, h, t, hd)).astype(np.float32) for _ in range(6)]   # q, k, v, their tangents
    options = {"backend": "naive"} if path == "naive" else {"backend": "memory_efficient", "block_size": block_size}
    with fwAD.dual_level():
        duals = [fwAD.make_dual(Tensor(a), u) for a, u in zip(arrays[:3], arrays[3:])]
        out = F.scaled_dot_product_attention(*duals, is_causal=True, **options)
        tangent = fwAD.unpack_dual(out).tangent
    assert tangent.shape == (b, h, t, hd)
    print(json.dumps({"peak_mb": rss_mb(), "imports_mb": imports}))


def attention_memory(args):
    """(2): both paths, each in a fresh process, and the ratio."""
    mem = {}
    for path in ("naive", "memory_efficient"):
        cmd = [sys.executable, os.path.abspath(__file__), "--only", path, "--attention-length",
               str(args.attention_length), "--block-size", str(args.block_size), "--threads", str(args.threads)]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
        mem[path] = json.loads(out.strip().splitlines()[-1])
    peak = {path: m["peak_mb"] for path, m in mem.items()}
    above = {path: m["peak_mb"] - m["imports_mb"] for path, m in mem.items()}

    def paths(mb):
        return ", ".join(f"{path} {mb[path]:.0f} MB" for path in mb) + \
            f", ratio {mb['memory_efficient'] / mb['naive']:.3f}"
    b, h, hd = ATTENTION_SHAPE
    print(f"(2) attention JVP at T = {args.attention_length} (B {b}, H {h}, head_dim {hd}, causal, float32, "
          f"block {args.block_size}), peak host memory (separate processes): {paths(peak)}; "
          f"above the imported libraries: {paths(above)}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", choices=[name for name, cfg in CONFIGS.items() if cfg.get("causal")],
                        default="gpt_char")
    parser.add_argument("--batch", type=int, help="batch size (default: the config's)")
    parser.add_argument("--seq", type=int, help="sequence length (default: the config's)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--threads", type=int, default=2, help="npformer's and torch's threads")
    parser.add_argument("--attention-length", type=int, default=4096)
    parser.add_argument("--block-size", type=int, default=512, help="the memory-efficient path's block size")
    parser.add_argument("--no-model", action="store_true", help="skip (1), the model's JVP")
    parser.add_argument("--no-memory", action="store_true", help="skip (2), the attention memory runs")
    parser.add_argument("--only", choices=["naive", "memory_efficient"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    import npformer
    npformer.set_num_threads(args.threads)
    if args.only:  # a child process measuring one attention path's peak memory (torch not loaded)
        attention_jvp(args.only, args.attention_length, args.block_size)
        return
    import torch
    torch.set_num_threads(args.threads)
    cfg = dict(CONFIGS[args.config], dropout=0.0)
    cfg.update({key: value for key, value in (("batch", args.batch), ("seq", args.seq)) if value})
    if not args.no_model:
        model_jvp(args, cfg)
    if not args.no_memory:
        attention_memory(args)


if __name__ == "__main__":
    main()
