"""Text -> token blocks: corpora, tokenizers, packing, and canary/duplicate injection.

Importing this package pulls in torch only; gensim, transformers and datasets are imported when
a function needs them (they cost seconds to import).
"""
from data_pipelines.canaries import SecretSpace, canary_candidates, render
from data_pipelines.chat import (
                                 CHAT_CORPORA,
                                 ChatExample,
                                 ChatTokens,
                                 chat_blocks,
                                 check_responses,
                                 extraction_pairs,
                                 is_chat_spec,
                                 load_chat,
                                 render_chat,
)
from data_pipelines.chat_inject import CANARY_PROMPT, canary_conversation, conversation_of, inject_chat
from data_pipelines.corpora import CORPORA, Document, load_corpus
from data_pipelines.dedup import DedupConfig, DedupManifest, Removal, deduplicate
from data_pipelines.inject import (
                                 CanarySpec,
                                 DuplicateSpec,
                                 InjectedItem,
                                 Manifest,
                                 inject,
                                 record_token_positions,
)
from data_pipelines.packing import (
                                 IGNORE_INDEX,
                                 Blocks,
                                 TokenLists,
                                 pack,
                                 per_document,
                                 split_documents,
                                 tokenize_documents,
                                 unpack,
)
from data_pipelines.tokenizer import EOT, load_tokenizer

__all__ = [
    "CHAT_CORPORA", "CORPORA", "EOT", "IGNORE_INDEX", "Blocks", "CanarySpec", "ChatExample", "ChatTokens",
    "Document", "DuplicateSpec", "InjectedItem", "Manifest", "SecretSpace", "TokenLists",
    "canary_candidates", "chat_blocks", "extraction_pairs", "inject", "is_chat_spec", "load_chat",
    "load_corpus", "load_tokenizer", "pack", "per_document", "record_token_positions", "render",
    "check_responses", "render_chat", "split_documents", "tokenize_documents", "unpack",
    "DedupConfig", "DedupManifest", "Removal", "deduplicate",
    "CANARY_PROMPT", "canary_conversation", "conversation_of", "inject_chat",
]
