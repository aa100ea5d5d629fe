"""Data: tokenizers, corpora, batching and training tasks, kept apart (numpy only: no torch; jax only inside
``token_task``'s per-process rows, imported when a multi-process run asks).

- ``tokenizers``: Char / Pair / BPE tokenizers; ``hf_tokenizer``: an HF directory's tokenizer.json;
- ``corpora``: the built-in corpora and text files; ``generated``: the synthetic task sets;
- ``batching``: batches as pure functions of (seed, step);
- ``task`` / ``tasks``: what a run trains on (``Task``, ``load_task``); ``token_task``, ``mixture_task``: token files.
"""
from jaxgpt.core.constants import BATCH_KEYS, IGNORE_INDEX, batch_keys
from jaxgpt.data.batching import encode_pairs, get_batch, pad_batch, shuffled_batch, split_train_val
from jaxgpt.data.corpora import CORPORA, PAIR_CORPORA, builtin_corpus, builtin_pairs, load_text
from jaxgpt.data.tokenizers import SPACE, BPETokenizer, CharTokenizer, PairTokenizer, tokenizer_from_dict, train_bpe

__all__ = ["BATCH_KEYS", "CORPORA", "IGNORE_INDEX", "PAIR_CORPORA", "SPACE", "BPETokenizer", "CharTokenizer",
           "PairTokenizer", "batch_keys", "builtin_corpus", "builtin_pairs", "encode_pairs", "get_batch",
           "load_text", "pad_batch", "shuffled_batch", "split_train_val", "tokenizer_from_dict", "train_bpe"]
