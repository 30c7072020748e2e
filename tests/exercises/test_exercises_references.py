"""The checker's references: the engine's gradients of each exercise's graph equal torch's
autograd, and central differences, on the default inputs (float64, the random upstream)."""
import numpy as np
import pytest

from npformer.exercises.problems import EXERCISES, engine_gradients, finite_differences


def torch_forwards(torch):
    """Each exercise's forward in torch, on its leaves, given the learner's inputs."""
    tf = torch.nn.functional
    return {
        "softmax_backward": lambda y, dy: lambda x: torch.softmax(x, -1),
        "log_softmax_backward": lambda y, dy: lambda x: torch.log_softmax(x, -1),
        "cross_entropy_backward": lambda logits, target, dloss: lambda z: tf.cross_entropy(z, torch.as_tensor(target)),
        "layer_norm_backward": lambda x, weight, dy, eps: lambda x, w, b: tf.layer_norm(x, (x.shape[-1],), w, b, eps),
        "linear_backward": lambda x, weight, dy: tf.linear,
        "gelu_backward": lambda x, dy: tf.gelu,
        "embedding_backward": lambda ids, n, dy: lambda w: tf.embedding(torch.as_tensor(ids), w),
        "attention_backward": lambda q, k, v, mask, dout, scale: lambda q, k, v: tf.scaled_dot_product_attention(
            q, k, v, attn_mask=torch.as_tensor(mask), scale=scale),
    }


@pytest.mark.parametrize("name", list(EXERCISES))
def test_the_engine_references_equal_torch_and_finite_differences(name, torch):
    exercise = EXERCISES[name]
    inputs = exercise.make_inputs(np.random.default_rng(0))
    graph = exercise.graph(*inputs)
    leaves = [torch.tensor(a, dtype=torch.float64, requires_grad=True) for a in graph.leaves]
    out = torch_forwards(torch)[name](*inputs)(*leaves)
    out.backward(torch.as_tensor(np.asarray(graph.upstream, dtype=np.float64)))
    ours = engine_gradients(graph)
    for mine, leaf, numeric in zip(ours, leaves, finite_differences(graph)):
        scale = max(1.0, float(np.abs(mine).max()))
        np.testing.assert_allclose(mine, leaf.grad.numpy(), rtol=0, atol=1e-12 * scale)
        np.testing.assert_allclose(mine, numeric, rtol=1e-6, atol=1e-7 * scale)
