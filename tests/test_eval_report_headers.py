"""report.md's headers say what the report holds; a group's row counts its tasks' documents."""
from evals.harness import _group_n
from memorization.eval.files import markdown_report

TASKS = {"tasks": {"a": {"acc": 0.5, "n": 5}, "b": {"acc": 0.2, "n": 7}},
         "groups": {"g": {"acc": 0.3, "n": 12}}, "n_shot": {"a": 0, "b": 0}, "num_fewshot": None,
         "limit": 5, "seed": 1234, "tokens": 10, "seconds": 1.0}


def test_a_tasks_only_report_says_nothing_about_cut_documents():
    md = markdown_report({"model": "m", "max_tokens": 128, "seconds": 2.0, "tasks": TASKS})
    assert "Documents cut" not in md and "| g | 12 |" in md
    with_docs = markdown_report({"model": "m", "max_tokens": 128, "seconds": 2.0, "tasks": TASKS,
                                 "perplexity": [{"corpus": "c", "docs": 2, "scored_tokens": 9, "loss": 1.0,
                                                 "perplexity": 2.7}]})
    assert "Documents cut to their first 128 tokens" in with_docs


def test_group_n_sums_its_tasks_through_nested_groups():
    rows = {"a": {"n": 5}, "b": {"n": 7}, "c": {"n": 1}}
    assert _group_n("top", rows, {"top": ["inner", "c"], "inner": ["a", "b"]}) == 13
