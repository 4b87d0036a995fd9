"""The eval suites are defined in the shipped suites.yaml (the repository's eval_suites/) and
checked when read: every task known, no key but `tasks` and `fast_limit`."""

from pathlib import Path

import pytest
import yaml

from lowprec.evals.suite import SUITES, load_suites
from lowprec.evals.tasks import BIGBENCH, TASKS

REPO = Path(__file__).resolve().parents[3]


def test_the_shipped_suites_are_the_repository_file():
    raw = yaml.safe_load((REPO / "eval_suites" / "suites.yaml").read_text())
    assert set(SUITES) == set(raw) == {"shakespeare", "shift", "default", "multiple_choice"}
    for name, suite in SUITES.items():
        assert list(suite.tasks) == raw[name]["tasks"] and suite.fast_limit == raw[name].get("fast_limit")
        assert set(suite.tasks) <= set(TASKS)
    # every BIG-bench task the task table defines is in the multiple-choice suite, HellaSwag too
    assert set(SUITES["multiple_choice"].tasks) == {f"bigbench_{b}" for b in BIGBENCH} | {"hellaswag"}


def test_a_suite_with_a_limit_reads_it():
    suites = load_suites("mine:\n  tasks: [heldout_shakespeare]\n  fast_limit: 4\n")
    assert suites["mine"].limits("fast") == {"heldout_shakespeare": 4}
    assert suites["mine"].limits("full") is None


@pytest.mark.parametrize("text, words", [
    ("mine:\n  tasks: [no_such_task]\n", "no_such_task"),
    ("mine:\n  task: [heldout_shakespeare]\n", "mine.task: unknown key 'task'. Did you mean 'tasks'?"),
    ("mine:\n  tasks: heldout_shakespeare\n", "mine.tasks: expected a list"),
    ("mine:\n  tasks: [heldout_shakespeare]\n  limit: 3\n", "mine.limit: unknown key 'limit'"),
    ("mine: [heldout_shakespeare]\n", "mine: expected a mapping with keys tasks, fast_limit"),
    ("mine:\n  tasks: [heldout_shakespeare]\n  fast_limit: 0\n", "fast_limit must be a positive int"),
    ("- heldout_shakespeare\n", "expected a mapping of suite names"),
])
def test_a_bad_suite_file_is_refused_with_what_is_wrong(text, words):
    from lowprec.base.parse import ConfigError
    with pytest.raises(ConfigError) as e:
        load_suites(text, "my_suites.yaml")
    assert str(e.value).startswith("my_suites.yaml: ") and words in str(e.value), str(e.value)
