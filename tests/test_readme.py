"""The README's Python snippets run as written (in a fresh folder, in order, one namespace),
with the YAML files the README tells the reader to save beside them (`lowprec.yaml`, and
each block that starts with `# save as NAME`)."""

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
    for block in _blocks("yaml"):
        if m := re.match(r"# save as (\S+)\n", block):
            (tmp_path / m.group(1)).write_text(block)
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
    # the Hugging Face Trainer snippet: the callback promoted the MLP stage and tracked the run
    callback = namespace["callback"]
    assert callback.state.formats()["model.layers.0.mlp.up_proj"] == "fp8_tensorwise"
    assert callback.state.formats()["model.layers.0.self_attn.q_proj"] == "bf16"
    assert [e.kind for e in callback.session.events] == ["promote"]
    assert (tmp_path / "mlflow.db").is_file()
    # the Lightning snippet: the same for a Lightning Trainer
    lit = namespace["lit_callback"]
    assert lit.state.formats()["model.layers.0.mlp.up_proj"] == "fp8_tensorwise"
    assert [e.kind for e in lit.session.events] == ["promote"]
