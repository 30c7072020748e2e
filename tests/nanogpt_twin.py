"""A torch GPT with nanoGPT's structure, state_dict names, init, optimizer groups and generate
(Karpathy's nanoGPT model.py, written here from its description): the reference that
tests/interop/test_nanogpt.py holds npformer's CausalLM and interop.from_nanogpt/to_nanogpt to.

    GPTConfig(block_size, vocab_size, n_layer, n_head, n_embd, dropout, bias)
    transformer.wte, transformer.wpe, transformer.h.{i}.{ln_1, attn.c_attn, attn.c_proj, ln_2,
    mlp.c_fc, mlp.c_proj}, transformer.ln_f, lm_head (the same Parameter as wte)

Pre-LN blocks x + attn(ln_1(x)), x + mlp(ln_2(x)); LayerNorm eps 1e-5 with an optional bias;
exact GELU; init N(0, 0.02^2) for Linear and Embedding weights, zero biases, and every
c_proj.weight at std 0.02 / sqrt(2 n_layer). flash=True uses torch's scaled_dot_product_attention
(nanoGPT on torch >= 2); flash=False the explicit masked softmax with the causal mask as a
buffer named attn.bias (nanoGPT's fallback, whose state_dict carries it).
torch is imported here: import this module from tests that have the `torch` fixture.
"""
import dataclasses
import math

import torch
from torch import nn
from torch.nn import functional as tF


@dataclasses.dataclass
class GPTConfig:
    block_size: int = 1024
    vocab_size: int = 50304
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0
    bias: bool = True


class LayerNorm(nn.Module):
    """LayerNorm whose bias is optional (torch's had no bias=False when nanoGPT was written)."""

    def __init__(self, width, bias):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.bias = nn.Parameter(torch.zeros(width)) if bias else None

    def forward(self, x):
        return tF.layer_norm(x, self.weight.shape, self.weight, self.bias, 1e-5)


class CausalSelfAttention(nn.Module):
    def __init__(self, config, flash=True):
        super().__init__()
        assert config.n_embd % config.n_head == 0
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)  # q, k, v rows
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.attn_dropout, self.resid_dropout = nn.Dropout(config.dropout), nn.Dropout(config.dropout)
        self.n_head, self.n_embd, self.dropout, self.flash = config.n_head, config.n_embd, config.dropout, flash
        if not flash:
            lower = torch.tril(torch.ones(config.block_size, config.block_size))
            self.register_buffer("bias", lower.view(1, 1, config.block_size, config.block_size))

    def forward(self, x):
        B, T, C = x.shape
        heads = [t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)          # (B, nh, T, hs)
                 for t in self.c_attn(x).split(self.n_embd, dim=2)]
        q, k, v = heads
        if self.flash:
            y = tF.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0,
                                                is_causal=True)
        else:
            scores = (q @ k.transpose(-2, -1)) / math.sqrt(k.shape[-1])
            scores = scores.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
            y = self.attn_dropout(tF.softmax(scores, dim=-1)) @ v
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, config, flash=True):
        super().__init__()
        self.ln_1 = LayerNorm(config.n_embd, config.bias)
        self.attn = CausalSelfAttention(config, flash)
        self.ln_2 = LayerNorm(config.n_embd, config.bias)
        self.mlp = MLP(config)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config, flash=True):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            wpe=nn.Embedding(config.block_size, config.n_embd),
            drop=nn.Dropout(config.dropout),
            h=nn.ModuleList([Block(config, flash) for _ in range(config.n_layer)]),
            ln_f=LayerNorm(config.n_embd, config.bias)))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # tied: one Parameter under two names
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):  # the residual projections, scaled down by depth
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module):
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx, targets=None):
        """(logits (B, T, V), loss) with targets; (logits of the last position (B, 1, V), None) without."""
        T = idx.shape[1]
        assert T <= self.config.block_size, f"{T} tokens, block size {self.config.block_size}"
        pos = torch.arange(T, dtype=torch.long, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)
        if targets is None:
            return self.lm_head(x[:, [-1], :]), None
        logits = self.lm_head(x)
        loss = tF.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1), ignore_index=-1)
        return logits, loss

    def configure_optimizers(self, weight_decay, learning_rate, betas):
        """AdamW with weight decay on the parameters of dim >= 2 only (the tied embedding once)."""
        params = {name: p for name, p in self.named_parameters() if p.requires_grad}
        groups = [{"params": [p for p in params.values() if p.dim() >= 2], "weight_decay": weight_decay},
                  {"params": [p for p in params.values() if p.dim() < 2], "weight_decay": 0.0}]
        return torch.optim.AdamW(groups, lr=learning_rate, betas=betas)

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None):
        """Append max_new_tokens sampled tokens, each from the last block_size tokens
        (top_k=1: greedy)."""
        for _ in range(max_new_tokens):
            context = idx if idx.shape[1] <= self.config.block_size else idx[:, -self.config.block_size:]
            logits, _ = self(context)
            logits = logits[:, -1, :] / temperature
            if top_k is not None:
                kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, [-1]]
                logits[logits < kth] = -float("inf")
            probs = tF.softmax(logits, dim=-1)
            idx = torch.cat((idx, torch.multinomial(probs, num_samples=1)), dim=1)
        return idx
