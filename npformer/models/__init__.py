"""npformer.models: the paper's encoder-decoder, a GPT-style causal LM and BERT-style encoders;
Hugging Face GPT-2/BERT weights from safetensors files (`load_pretrained`)."""
from .bert import BidirectionalEncoder, EncoderClassifier
from .gpt import CausalLM
from .seq2seq import Seq2SeqTransformer

__all__ = ["Seq2SeqTransformer", "CausalLM", "BidirectionalEncoder", "EncoderClassifier"]
