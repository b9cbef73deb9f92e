"""Score a trained causal LM for memorization: extraction, perplexity, membership inference, exposure."""
from __future__ import annotations

from evals.decoding import beam_generate, greedy_generate, verified_greedy
from evals.exposure import exposure_extrapolated, exposure_rank, group_exposure, sequence_log_perplexity
from evals.extraction import ExtractionResult, extract, extract_pairs, extractability, summarize, to_jsonl
from evals.metrics import exact_match, longest_common_prefix, rouge_l, token_accuracy
from evals.mia import membership_inference, mia_metrics, min_k_mean, roc_metrics, score_sequences
from evals.perplexity import corpus_loss, mean_loss, sequence_logprobs
from evals.scoring import Scorer

__all__ = [
    "ExtractionResult", "Scorer", "beam_generate", "corpus_loss", "exact_match", "exposure_extrapolated",
    "exposure_rank", "extract", "extract_pairs", "extractability", "greedy_generate", "group_exposure",
    "longest_common_prefix", "mean_loss", "membership_inference", "mia_metrics", "min_k_mean", "roc_metrics",
    "rouge_l", "score_sequences", "sequence_log_perplexity", "sequence_logprobs", "summarize", "to_jsonl",
    "token_accuracy", "verified_greedy",
]
