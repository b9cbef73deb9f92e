"""Near-duplicate documents: MinHash LSH candidates, kept only where the exact Jaccard similarity passes.

Two documents are near-duplicates when the Jaccard similarity of their sets of n-token windows
(shingles of token ids, n = `ngram`) is at least `threshold`, the document-level criterion of Lee et
al. 2022's NearDup (5-grams, 0.8, there on words; here on the tokenizer's ids, like the exact passes).
Candidate pairs come from MinHash locality-sensitive hashing (datasketch's MinHash and MinHashLSH,
`perms` permutations in b bands of r rows: the largest r for which a pair at the threshold is
proposed with probability >= 1 - 1e-3, `bands`; DedupConfig refuses fewer permutations than that
needs, `min_perms`); every candidate's similarity is then computed
exactly on the two shingle sets, so a pair that is kept always passes the threshold, and a pair that
passes is missed only when LSH never proposed it (at most 1e-3 at the threshold, less above it).
Near-duplicates form clusters (connected components, as NearDup does: a chain of near-copies is one
cluster even where its ends are further apart); the earliest document of a cluster in corpus order
is kept, the others removed whole.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["MISS", "EarliestUnion", "NearCluster", "bands", "min_perms", "near_duplicate_clusters",
           "shingles"]

MISS = 1e-3  # the largest chance that LSH never proposes a pair at the threshold (bands)


class EarliestUnion:
    """Union-find over 0..n-1 whose root is each set's smallest member (the earliest document)."""

    def __init__(self, n: int) -> None:
        self.parent = list(range(n))

    def root(self, i: int) -> int:
        """The smallest member of i's set."""
        while self.parent[i] != i:
            self.parent[i] = self.parent[self.parent[i]]
            i = self.parent[i]
        return i

    def join(self, i: int, j: int) -> None:
        """Merge the sets of i and j."""
        a, b = self.root(i), self.root(j)
        if a != b:
            self.parent[max(a, b)] = min(a, b)

    def groups(self, members: Sequence[int] | None = None) -> dict[int, list[int]]:
        """root -> its members (of `members`, default all), in index order."""
        out: dict[int, list[int]] = {}
        for i in range(len(self.parent)) if members is None else members:
            out.setdefault(self.root(i), []).append(i)
        return out


@dataclass
class NearCluster:
    """One cluster of near-duplicate documents: the kept one (earliest) and the removed ones, each with
    its exact Jaccard similarity to the kept one (below the threshold only when linked by a chain)."""

    kept: int  # index into the token lists
    removed: list[tuple[int, float]]


def shingles(tokens: Sequence[int], ngram: int) -> set[bytes]:
    """The set of `ngram`-token windows of a token list (as bytes); a shorter list is one shingle."""
    arr = np.asarray(tokens, dtype=np.int64)
    if len(arr) <= ngram:
        return {arr.tobytes()} if len(arr) else set()
    windows = np.lib.stride_tricks.sliding_window_view(arr, ngram)
    return {w.tobytes() for w in windows}


def jaccard(a: set[bytes], b: set[bytes]) -> float:
    """|a & b| / |a | b| (1.0 for two empty sets)."""
    union = len(a | b)
    return len(a & b) / union if union else 1.0


def bands(threshold: float, perms: int) -> tuple[int, int]:
    """(b, r): the LSH bands for `perms` permutations (b >= 2, as MinHashLSH needs), r as large as keeps
    the chance of never proposing a pair of similarity `threshold`, (1 - threshold^r)^b with
    b = perms // r, at most MISS (a larger r proposes fewer dissimilar pairs); None-like (0, 0) when no r
    does (too few permutations: `min_perms`)."""
    for r in range(perms // 2, 0, -1):
        if (1 - threshold ** r) ** (perms // r) <= MISS:
            return perms // r, r
    return 0, 0


def min_perms(threshold: float) -> int:
    """The fewest permutations for which `bands` finds bands at `threshold`."""
    perms = 2
    while bands(threshold, perms) == (0, 0):
        perms *= 2
    lo = perms // 2
    while lo + 1 < perms:  # the least in (perms / 2, perms]
        mid = (lo + perms) // 2
        lo, perms = (lo, mid) if bands(threshold, mid) != (0, 0) else (mid, perms)
    return perms


def near_duplicate_clusters(token_lists: Sequence[Sequence[int]], threshold: float, ngram: int,
                            perms: int, seed: int = 1) -> list[NearCluster]:
    """Every cluster of two or more near-duplicate token lists (module docstring), in order of its kept
    document; documents in no cluster are not listed."""
    from datasketch import MinHash, MinHashLSH  # deferred: datasketch imports scipy (+0.5 s)

    sets = [shingles(t, ngram) for t in token_lists]
    live = [i for i, s in enumerate(sets) if s]  # an empty document has no shingles: never a near-copy
    if len(live) < 2:
        return []
    hashes = MinHash.bulk([sets[i] for i in live], num_perm=perms, seed=seed)
    lsh = MinHashLSH(num_perm=perms, params=bands(threshold, perms))
    union = EarliestUnion(len(sets))
    for i, h in zip(live, hashes):
        for j in lsh.query(h):  # earlier documents only: each pair once
            if jaccard(sets[i], sets[j]) >= threshold:
                union.join(i, j)
        lsh.insert(i, h)
    return [NearCluster(r, [(i, jaccard(sets[r], sets[i])) for i in ms if i != r])
            for r, ms in sorted(union.groups(live).items()) if len(ms) > 1]
