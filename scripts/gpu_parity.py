"""One float32 training step of Seq2SeqTransformer on our device against torch on its device:
logits, loss and the gradient of every parameter, with the same weights (interop.to_torch).

    python scripts/gpu_parity.py                       # ours on cuda vs torch on CUDA
    python scripts/gpu_parity.py --device test --torch-device cpu   # the same check without a GPU

Prints the max abs error of each compared quantity and exits non-zero on a mismatch.
"""
import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import npformer.functional as F  # noqa: E402
from autograd import backend  # noqa: E402
from npformer import interop, manual_seed  # noqa: E402
from npformer.models import Seq2SeqTransformer  # noqa: E402

PAD = 0


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", help="our device: cuda, test or cpu")
    parser.add_argument("--torch-device", default="cuda")
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--atol", type=float, default=1e-4)
    parser.add_argument("--rtol", type=float, default=1e-3)
    args = parser.parse_args(argv)
    import torch

    manual_seed(0)
    vocab, batch, length = 1000, 4, 16
    model = Seq2SeqTransformer(vocab, vocab, d_model=args.d_model, nhead=8, num_encoder_layers=args.layers,
                               num_decoder_layers=args.layers, dim_feedforward=4 * args.d_model, dropout=0.0,
                               pad_idx=PAD)
    theirs = interop.to_torch(model).to(args.torch_device)
    model.to(args.device)
    rng = np.random.default_rng(0)
    src, tgt, labels = (rng.integers(1, vocab, (batch, length)) for _ in range(3))
    src[0, 12:] = tgt[1, 10:] = labels[1, 10:] = PAD  # padded rows too

    logits = model(backend.to_device(src, args.device), backend.to_device(tgt, args.device))
    loss = F.cross_entropy(logits.reshape(-1, vocab), backend.to_device(labels.reshape(-1), args.device),
                           ignore_index=PAD, label_smoothing=0.1)
    loss.backward()
    as_torch = lambda a: torch.as_tensor(a, device=args.torch_device)  # noqa: E731
    ref = theirs(as_torch(src), as_torch(tgt))
    ref_loss = torch.nn.functional.cross_entropy(ref.reshape(-1, vocab), as_torch(labels.reshape(-1)),
                                                 ignore_index=PAD, label_smoothing=0.1)
    ref_loss.backward()

    pairs = [("logits", logits.numpy(), ref.detach().cpu().numpy()), ("loss", loss.numpy(), ref_loss.detach().cpu().numpy())]
    named = dict(theirs.named_parameters())
    pairs += [(f"grad {name}", p.grad.numpy(), named[name].grad.cpu().numpy())
              for name, p in model.named_parameters()]
    failed = []
    for name, ours, ref_value in pairs:
        if not np.allclose(ours, ref_value, atol=args.atol, rtol=args.rtol):
            failed.append(name)
    worst = max(float(np.abs(o - r).max()) for _, o, r in pairs)
    print(f"ours on {args.device} vs torch on {args.torch_device}: {len(pairs)} quantities compared "
          f"(logits, loss, {len(pairs) - 2} gradients), max abs error {worst:.3g}, "
          f"tolerance atol {args.atol} rtol {args.rtol}: {'FAIL ' + ', '.join(failed) if failed else 'PASS'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
