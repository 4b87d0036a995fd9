"""The README's Python snippets run as written (in a fresh folder, in order, one namespace),
with the YAML file the README tells the reader to save beside them."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def _blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_snippets_run(tmp_path, monkeypatch):
    configs = [b for b in _blocks("yaml") if b.startswith("precision:")]
    assert len(configs) == 1, "the README shows one lowprec.yaml to save"
    (tmp_path / "lowprec.yaml").write_text(configs[0])
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    snippets = _blocks("python")
    assert len(snippets) >= 2
    for i, code in enumerate(snippets):
        exec(compile(code, f"README.md python block {i}", "exec"), namespace)
    # what the session snippet says it does: the stage was promoted and the loop went on
    session = namespace["session"]
    assert session.step_index == 60
    assert set(session.state.formats().values()) == {"fp8_tensorwise"}
    assert [e.kind for e in session.events] == ["promote"]
