"""npformer.models: the paper's encoder-decoder, a GPT-style causal LM and a BERT-style classifier."""
from .bert import EncoderClassifier
from .gpt import CausalLM
from .seq2seq import Seq2SeqTransformer

__all__ = ["Seq2SeqTransformer", "CausalLM", "EncoderClassifier", "MODEL_CLASSES"]

# every model npformer.load_model may rebuild, by the class name a checkpoint stores (a fixed
# allow-list: a name read from a file never reaches getattr or import)
MODEL_CLASSES = {cls.__name__: cls for cls in (Seq2SeqTransformer, CausalLM, EncoderClassifier)}
