"""The autograd Functions of scaled dot-product attention, each calling the kernel tables
(tables.py) with xp = the array module of its inputs:

- AttentionFunction, the naive path: keeps the (Tq, Tk) probabilities; its backward as an op,
  AttentionBackward, whose backward (the double backward) and jvp work from the saved P;
- MemoryEfficientAttentionFunction, the memory-efficient path (and flash, on a GPU): saves O and one
  logsumexp per query row; its backward as an op, MemoryEfficientAttentionBackward, whose backward
  is the blockwise double backward, never a (Tq, Tk) matrix.

Both write their third derivative with differentiable ops (graph.py)."""
from autograd import Function, Tensor, backend, unbroadcast

from ..activation import dropout_scale
from . import blockwise, higher, math
from .blockwise import lead_shape, window_option
from .dropout import attention_keep_block
from .graph import graph_attention_double_backward
from .masks import at_least_2d
from .tables import (attention_backward, attention_backward_jvp, attention_blockwise_backward,
                     attention_blockwise_double_backward, attention_blockwise_forward, attention_blockwise_jvp,
                     attention_double_backward, attention_forward, attention_jvp)


class AttentionFunction(Function):
    """q (..., Tq, hd), k (..., Tk, hd), v (..., Tk, hdv) [, additive mask] -> out (..., Tq, hdv)
    [, P (..., Tq, Tk)].

    S = s Q K^T + mask, P = softmax(S) (dropout: Pd = P * keep / (1 - p)), O = Pd V;
    dV = Pd^T dO, dPd = dO V^T (+ dP from the returned weights), dS = P (dP - rowsum(dP P)),
    dQ = s dS K, dK = s dS^T Q, and d(additive mask) = dS summed over its broadcast axes.
    The kernel tables attention_forward / attention_backward run it (cpu: blocks of a batch axis
    on the threads of `npformer.runtime.threads`, see cpu.py).
    """
    backward_formula = staticmethod(math.attention_backward)

    @staticmethod
    def forward(ctx, q, k, v, additive, blocked, causal, scale, keep, dropout_scale, return_weights):
        xp = backend.get_array_module(q)
        lead = lead_shape(q, k, v)
        probs = xp.empty(lead + (q.shape[-2], k.shape[-2]), dtype=q.dtype)   # (..., Tq, Tk)
        out = xp.empty(lead + (q.shape[-2], v.shape[-1]), dtype=q.dtype)     # (..., Tq, hdv)
        weights = xp.empty_like(probs) if keep is not None and return_weights else None
        attention_forward(xp, q, k, v, at_least_2d(additive), blocked, causal, scale, keep, dropout_scale,
                          probs, out, weights)
        ctx.save_for_backward(q, k, v, probs, keep)
        ctx.scale, ctx.dropout_scale, ctx.return_weights = scale, dropout_scale, return_weights
        ctx.masks = (additive, blocked, causal)                               # for differentiable_backward
        ctx.mask_shape = None if additive is None else additive.shape
        return (out, probs if weights is None else weights) if return_weights else out

    @staticmethod
    def backward(ctx, dout, dweights=None):
        q, k, v, probs, keep = ctx.saved_tensors
        return naive_attention_gradients(q, k, v, probs, keep, dout, dweights, ctx.scale, ctx.dropout_scale,
                                         ctx.mask_shape, ctx.needs_input_grad[:4])

    @staticmethod
    def differentiable_backward(ctx, dout, dweights=None):
        """The backward as the op `AttentionBackward`, one node of the graph: its forward is the
        kernel above (threads on the CPU), its backward the double backward and its jvp the tangent
        of the gradients, each by hand from the saved P."""
        q, k, v, probs, keep = ctx.saved_tensors
        additive, blocked, causal = ctx.masks
        operands = [t if t is not None else raw for t, raw in zip(ctx.inputs, (q, k, v, additive))]
        need = ctx.needs_input_grad[:4]
        grads = AttentionBackward.apply(*operands, dout, dweights, probs=probs, keep=keep, blocked=blocked,
                                        causal=causal, scale=ctx.scale, dropout_scale=ctx.dropout_scale, need=need)
        return by_attention_input(grads, need)

    @staticmethod
    def jvp(ctx, tq, tk, tv, tmask):
        """(t_O [, t_Pd]) from the saved P: the forward's steps along the tangents (attention_jvp)."""
        q, k, v, probs, keep = ctx.saved_tensors
        xp = backend.get_array_module(probs)
        tout = xp.empty(probs.shape[:-1] + (v.shape[-1],), dtype=probs.dtype)   # (..., Tq, hdv)
        moves_scores = tq is not None or tk is not None or tmask is not None
        tweights = xp.empty_like(probs) if ctx.return_weights and moves_scores else None
        attention_jvp(xp, q, k, v, probs, keep, ctx.scale, ctx.dropout_scale, tq, tk, tv, at_least_2d(tmask), tout,
                      tweights)
        return (tout, tweights) if ctx.return_weights else tout


def naive_attention_gradients(q, k, v, probs, keep, dout, dweights, scale, dropout_scale, mask_shape, need):
    """(dQ, dK, dV, dMask) of the naive path by the kernel attention_backward, each summed to the
    shape of its input (mask_shape: the float mask's), None where `need` (four bools) says no."""
    xp = backend.get_array_module(dout)
    need_q, need_k, need_v, need_mask = need
    lead = probs.shape[:-2]
    dq = xp.empty(lead + q.shape[-2:], dtype=q.dtype) if need_q else None
    dk = xp.empty(lead + k.shape[-2:], dtype=q.dtype) if need_k else None
    dv = xp.empty(lead + v.shape[-2:], dtype=q.dtype) if need_v else None
    dmask = xp.empty_like(probs) if need_mask else None                      # (..., Tq, Tk) dS
    attention_backward(xp, q, k, v, probs, keep, dout, dweights, scale, dropout_scale, dq, dk, dv, dmask)
    return (unbroadcast(dq, q.shape) if need_q else None,
            unbroadcast(dk, k.shape) if need_k else None,
            unbroadcast(dv, v.shape) if need_v else None,
            unbroadcast(dmask, mask_shape) if need_mask else None)


def by_attention_input(grads, need):
    """(for q, k, v, mask) from what AttentionBackward returns or receives, one array or Tensor per
    gradient it computes (those of (dQ, dK, dV, dMask) that `need` asks for): None for the others."""
    grads = iter(grads)
    return tuple(next(grads) if wanted else None for wanted in need)


class AttentionBackward(Function):
    """(q, k, v, additive mask, dO, dweights) -> those of (dQ, dK, dV, dMask) that `need` asks for:
    the naive path's backward as an op, so that the gradient of attention is one node of the graph
    (create_graph, forward over reverse). dweights is the gradient reaching the returned weights, or
    None. P (probs) and the dropout mask, AttentionFunction's saved arrays, come as constants with
    the mask's bool part and causality: the rules below differentiate through P by hand.

    forward: `attention_backward`, the first-order kernel (threads on the CPU). backward: the double
    backward `attention_double_backward`; jvp: the gradients' tangents `attention_backward_jvp`; both
    on raw (..., Tq, Tk) matrices from the saved P. differentiable_backward (third order and above):
    the double backward's formulas with Tensors, P recomputed in the graph (graph_attention_double_backward)."""
    backward_formula = staticmethod(higher.attention_double_backward)

    @staticmethod
    def forward(ctx, q, k, v, additive, dout, dweights, probs, keep, blocked, causal, scale, dropout_scale, need):
        grads = naive_attention_gradients(q, k, v, probs, keep, dout, dweights, scale, dropout_scale,
                                          None if additive is None else additive.shape, need)
        ctx.save_for_backward(q, k, v, additive, probs, keep, dout, dweights)
        ctx.options = (blocked, causal, scale, dropout_scale, need)
        return tuple(g for g, wanted in zip(grads, need) if wanted)

    @staticmethod
    def backward(ctx, *grads):
        q, k, v, additive, probs, keep, dout, dweights = ctx.saved_tensors
        _, _, scale, dropout_scale, need = ctx.options
        gq, gk, gv, gmask = by_attention_input(grads, need)
        need_q, need_k, need_v, need_mask, need_dout, need_dweights = ctx.needs_input_grad
        xp = backend.get_array_module(dout)
        lead = probs.shape[:-2]
        moves_scores = gq is not None or gk is not None or gmask is not None    # W: without it dV, d dweights = 0
        dq = xp.empty(lead + q.shape[-2:], dtype=q.dtype) if need_q else None
        dk = xp.empty(lead + k.shape[-2:], dtype=q.dtype) if need_k else None
        dv = xp.empty(lead + v.shape[-2:], dtype=q.dtype) if need_v and moves_scores else None
        dmask = xp.empty_like(probs) if need_mask else None                  # (..., Tq, Tk)
        ddout = xp.empty_like(dout) if need_dout else None                   # (..., Tq, hdv)
        ddweights = xp.empty_like(probs) if need_dweights and moves_scores else None
        attention_double_backward(xp, q, k, v, probs, keep, dout, dweights, scale, dropout_scale, gq, gk, gv,
                                  at_least_2d(gmask), dq, dk, dv, dmask, ddout, ddweights)
        return (None if dq is None else unbroadcast(dq, q.shape), None if dk is None else unbroadcast(dk, k.shape),
                None if dv is None else unbroadcast(dv, v.shape),
                None if dmask is None else unbroadcast(dmask, additive.shape), ddout, ddweights)

    @staticmethod
    def jvp(ctx, tq, tk, tv, tmask, tdout, tdweights):
        """The tangents of the gradients it returns (`attention_backward_jvp`): what forward over
        reverse (autograd.functional.hvp) uses."""
        q, k, v, additive, probs, keep, dout, dweights = ctx.saved_tensors
        _, _, scale, dropout_scale, need = ctx.options
        xp = backend.get_array_module(dout)
        need_q, need_k, need_v, need_mask = need
        lead = probs.shape[:-2]
        moves_dv = tq is not None or tk is not None or tmask is not None or tdout is not None  # else t_dV = 0
        tangents = (xp.empty(lead + q.shape[-2:], dtype=q.dtype) if need_q else None,
                    xp.empty(lead + k.shape[-2:], dtype=q.dtype) if need_k else None,
                    xp.empty(lead + v.shape[-2:], dtype=q.dtype) if need_v and moves_dv else None,
                    xp.empty_like(probs) if need_mask else None)
        attention_backward_jvp(xp, q, k, v, probs, keep, dout, dweights, scale, dropout_scale, tq, tk, tv,
                               at_least_2d(tmask), tdout, tdweights, *tangents)
        shapes = (q.shape, k.shape, v.shape, None if additive is None else additive.shape)
        return tuple(None if t is None else unbroadcast(t, shape)
                     for t, shape, wanted in zip(tangents, shapes, need) if wanted)

    @staticmethod
    def differentiable_backward(ctx, *grads):
        """The double backward's formulas on whole (Tq, Tk) matrices of Tensors, P recomputed in the
        graph from q, k and the mask (graph_attention_double_backward): a third derivative, and every
        order above."""
        q, k, v, additive, probs, keep, dout, dweights = ctx.saved_tensors
        blocked, causal, scale, dropout_scale, need = ctx.options
        q, k, v, dout = (t if t is not None else Tensor(raw)
                         for t, raw in zip(ctx.inputs[:3] + ctx.inputs[4:5], (q, k, v, dout)))
        additive = ctx.inputs[3] if ctx.inputs[3] is not None else additive    # a Tensor, else the constant
        dweights = ctx.inputs[5] if ctx.inputs[5] is not None else dweights
        z = None if keep is None else keep * probs.dtype.type(dropout_scale)    # (..., Tq, Tk) Z, a constant
        grads = graph_attention_double_backward(q, k, v, additive, dout, dweights, blocked, causal, scale, z,
                                                *by_attention_input(grads, need))
        return tuple(g if wanted else None for g, wanted in zip(grads, ctx.needs_input_grad))


class MemoryEfficientAttentionFunction(Function):
    """Same math as `AttentionFunction` without the (Tq, Tk) matrices: saves the output O and
    one logsumexp L per query row; the backward recomputes P = exp(S - L) block by block.
    The work is done by the kernel tables `attention_blockwise_forward` and
    `attention_blockwise_backward` (the blockwise reference, or the flash kernels on a GPU).
    Dropout: the contract's mask, regenerated from (seed, offset) in backward, never stored.
    window: a causal sliding window W (keys j <= i - W hidden too; the key blocks outside it are
    skipped at every order), or None.
    """
    backward_formula = staticmethod(blockwise.attention_blockwise_backward)

    @staticmethod
    def forward(ctx, q, k, v, additive, blocked, causal, scale, block_size, dropout, mask_grad, window=None):
        mask = at_least_2d(additive)
        out, lse = attention_blockwise_forward(backend.get_array_module(q), q, k, v, blocked, mask, causal, scale,
                                               block_size, dropout, mask_grad, **window_option(window))
        ctx.save_for_backward(q, k, v, out, lse, blocked, mask)
        ctx.options = (causal, scale, block_size, dropout)
        ctx.window = window
        ctx.mask_shape = None if additive is None else additive.shape
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, blocked, mask = ctx.saved_tensors
        need_q, need_k, need_v, need_mask = ctx.needs_input_grad[:4]
        dq, dk, dv, dmask = attention_blockwise_backward(backend.get_array_module(dout), q, k, v, out, lse, dout,
                                                         blocked, mask, *ctx.options, need_mask,
                                                         **window_option(ctx.window))
        return (unbroadcast(dq, q.shape) if need_q else None,
                unbroadcast(dk, k.shape) if need_k else None,
                unbroadcast(dv, v.shape) if need_v else None,
                dmask.reshape(ctx.mask_shape) if need_mask else None)

    @staticmethod
    def differentiable_backward(ctx, dout):
        """The backward as the op `MemoryEfficientAttentionBackward`, whose own backward is the
        blockwise double backward: a second derivative without a (Tq, Tk) matrix."""
        q, k, v, out, lse, blocked, mask = ctx.saved_tensors
        operands = [t if t is not None else raw for t, raw in zip(ctx.inputs, (q, k, v, mask))]
        need = ctx.needs_input_grad[:4]
        grads = MemoryEfficientAttentionBackward.apply(*operands, dout, out=out, lse=lse, blocked=blocked,
                                                       options=ctx.options, need_mask=need[3], window=ctx.window)
        grads = grads + (None,) * (4 - len(grads))                             # no dMask without need_mask
        return tuple(g if wanted else None for g, wanted in zip(grads, need))

    @staticmethod
    def jvp(ctx, tq, tk, tv, tmask):
        """t_O block by block from the saved O and L (`attention_blockwise_jvp`), never a (Tq, Tk) matrix."""
        q, k, v, out, lse, blocked, mask = ctx.saved_tensors
        return attention_blockwise_jvp(backend.get_array_module(out), q, k, v, out, lse, tq, tk, tv,
                                       at_least_2d(tmask), blocked, mask, *ctx.options, **window_option(ctx.window))


class MemoryEfficientAttentionBackward(Function):
    """(q, k, v, additive mask, dO) -> (dQ, dK, dV[, dMask]): the memory-efficient path's backward
    as an op (its forward runs `attention_blockwise_backward`, the flash kernels included), so that
    a gradient of attention can be differentiated again. O and L, the forward's saved output and
    logsumexp, come as constants: the backward below differentiates through them by hand.
    Its backward is `attention_blockwise_double_backward`, block by block, never a (Tq, Tk) matrix;
    its differentiable_backward the same formulas on whole matrices (third order and above)."""
    backward_formula = staticmethod(blockwise.attention_blockwise_double_backward)

    @staticmethod
    def forward(ctx, q, k, v, additive, dout, out, lse, blocked, options, need_mask, window=None):
        mask = at_least_2d(additive)
        dq, dk, dv, dmask = attention_blockwise_backward(backend.get_array_module(dout), q, k, v, out, lse, dout,
                                                         blocked, mask, *options, need_mask, **window_option(window))
        ctx.save_for_backward(q, k, v, out, lse, dout, blocked, mask)
        ctx.options, ctx.mask_shape, ctx.window = options, None if additive is None else additive.shape, window
        grads = (unbroadcast(dq, q.shape), unbroadcast(dk, k.shape), unbroadcast(dv, v.shape))
        return (grads + (dmask.reshape(ctx.mask_shape),)) if need_mask else grads

    @staticmethod
    def backward(ctx, gq, gk, gv, gmask=None):
        q, k, v, out, lse, dout, blocked, mask = ctx.saved_tensors
        if gmask is not None:
            gmask = gmask.reshape(mask.shape)
        need_mask = ctx.needs_input_grad[3]
        dq, dk, dv, dmask, ddout = attention_blockwise_double_backward(
            backend.get_array_module(dout), q, k, v, out, lse, dout, blocked, mask, *ctx.options, gq, gk, gv, gmask,
            need_mask, **window_option(ctx.window))
        return (unbroadcast(dq, q.shape), unbroadcast(dk, k.shape), unbroadcast(dv, v.shape),
                dmask.reshape(ctx.mask_shape) if need_mask else None, ddout)

    @staticmethod
    def differentiable_backward(ctx, gq, gk, gv, gmask=None):
        """The double backward's formulas (attention_blockwise_double_backward's) on whole (Tq, Tk)
        matrices of Tensors, P recomputed in the graph: a third derivative, and every order above.
        Its memory is the naive path's, not bounded like the second derivative's."""
        q, k, v, out, lse, dout, blocked, mask = ctx.saved_tensors
        causal, scale, _, dropout = ctx.options
        lead, (tq, tk) = out.shape[:-2], (q.shape[-2], k.shape[-2])
        q, k, v, dout = (t if t is not None else Tensor(raw)
                         for t, raw in zip(ctx.inputs[:3] + ctx.inputs[4:], (q, k, v, dout)))
        additive = ctx.inputs[3] if ctx.inputs[3] is not None else mask
        # Z = keep / (1 - p): the forward's dropout mask, a constant
        z = None
        if dropout is not None:
            z = attention_keep_block(dropout, lead, tq, tk, 0, tq, 0, tk, out) * dropout_scale(dropout[0])
        dq, dk, dv, s_bar, ddout, _ = graph_attention_double_backward(
            q, k, v, additive, dout, None, blocked, causal, scale, z, gq, gk, gv,
            None if gmask is None else gmask.reshape(mask.shape), window=ctx.window)
        return dq, dk, dv, s_bar if ctx.needs_input_grad[3] else None, ddout
