"""npformer.models: the paper's encoder-decoder, a GPT-style causal LM and a BERT-style classifier."""
from .bert import EncoderClassifier
from .gpt import CausalLM
from .seq2seq import Seq2SeqTransformer

__all__ = ["Seq2SeqTransformer", "CausalLM", "EncoderClassifier"]
