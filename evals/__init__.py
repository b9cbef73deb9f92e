"""Score a trained causal LM for memorization: extraction, perplexity, membership inference, exposure."""
from __future__ import annotations

from evals.decoding import beam_generate, greedy_generate
from evals.exposure import exposure_extrapolated, exposure_rank, sequence_log_perplexity
from evals.extraction import ExtractionResult, extract, extract_pairs, extractability, summarize, to_jsonl
from evals.metrics import exact_match, longest_common_prefix, rouge_l, token_accuracy
from evals.mia import membership_inference, min_k_mean, roc_metrics, score_sequences
from evals.perplexity import mean_loss, sequence_logprobs

__all__ = [
    "ExtractionResult", "beam_generate", "exact_match", "exposure_extrapolated", "exposure_rank", "extract",
    "extract_pairs", "extractability", "greedy_generate", "longest_common_prefix", "mean_loss",
    "membership_inference", "min_k_mean", "roc_metrics", "rouge_l", "score_sequences",
    "sequence_log_perplexity", "sequence_logprobs", "summarize", "to_jsonl", "token_accuracy",
]
