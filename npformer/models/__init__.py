"""npformer.models: the paper's encoder-decoder, a GPT-style causal LM and BERT-style encoders;
safetensors files and Hugging Face GPT-2/BERT folders (`load_pretrained`, `save_pretrained`)."""
from .bert import BidirectionalEncoder, EncoderClassifier
from .gpt import CausalLM
from .pretrained import MODEL_CLASSES, load_pretrained, load_safetensors, save_pretrained, save_safetensors
from .seq2seq import Seq2SeqTransformer

__all__ = ["Seq2SeqTransformer", "CausalLM", "BidirectionalEncoder", "EncoderClassifier", "load_pretrained",
           "save_pretrained", "save_safetensors", "load_safetensors", "MODEL_CLASSES"]
