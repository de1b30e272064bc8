"""What each vocabulary token decodes to on its own, for rules written on text instead of token ids.

Why one helper: sentence and step boundaries (SkipKV's delimiters, ReasonCache's step ends) must hold
for any tokenizer (byte-level "Ċ", SentencePiece "<0x0A>", merged ".ĊĊ"), so they are decided on each
token's decoded text once per tokenizer. Special tokens are left out: a chat marker never ends a
sentence. Singletons go through one `batch_decode`, equivalent to `decode([i])` per id, which
matters for 150k-token vocabularies.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def token_texts(tokenizer: PreTrainedTokenizerBase) -> list[tuple[int, str]]:
    """`(id, text)` of every non-special vocabulary token, decoded alone."""
    special = set(tokenizer.all_special_ids)
    ids = [i for i in range(len(tokenizer)) if i not in special]
    texts = tokenizer.batch_decode([[i] for i in ids], clean_up_tokenization_spaces=False)
    return list(zip(ids, texts, strict=True))
