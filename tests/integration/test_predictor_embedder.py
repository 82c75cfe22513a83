"""The real MiniLM embedder: INT8 quantization and token limits change the embedding space
(and its id), and quantized vectors stay close to the float ones."""

import numpy as np

from services.predictor.embedder import Embedder

PROMPTS = [
    "Write a haiku about the sea.",
    "Explain how a transformer computes attention, step by step, with an example.",
    "What is the capital of France?",
]


def test_quantized_embedder_is_close_and_has_its_own_space():
    fp32, q8 = Embedder(max_seq_length=64), Embedder(max_seq_length=64, quantize=True)
    a, b = fp32.embed(PROMPTS), q8.embed(PROMPTS)  # [3, D] each
    assert a.shape == b.shape == (3, fp32.dim)
    assert np.allclose(np.linalg.norm(b, axis=1), 1.0, atol=1e-4)
    cos = np.sum(a * b, axis=1)
    assert cos.min() > 0.8  # same space, roughly
    assert not np.allclose(a, b, atol=1e-3)  # but really quantized
    # nearest neighbours agree: each prompt's own float vector is its best match
    assert (np.argmax(b @ a.T, axis=1) == np.arange(3)).all()
    assert q8.quantized and not fp32.quantized
    assert len({fp32.space, q8.space, Embedder(max_seq_length=128).space}) == 3
