"""The README's API example runs as written, on a tiny Qwen2 fixture directory standing in for
SmolLM2-135M-Instruct (its 64-position context gets a shorter generation budget, and two
steps stand in for twenty)."""
import pathlib
import re
import shutil

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_readme_api_example(tmp_path, monkeypatch):
    text = (ROOT / "README.md").read_text()
    code = re.search(r"## API in short\n.*?```python\n(.*?)```", text, re.S).group(1)
    for old, new in (("max_new_tokens=64", "max_new_tokens=8"), ("range(20)", "range(2)")):
        assert old in code
        code = code.replace(old, new)
    shutil.copytree(ROOT / "tests" / "fixtures" / "hf" / "qwen2",
                    tmp_path / "path" / "to" / "SmolLM2-135M-Instruct")
    monkeypatch.chdir(tmp_path)
    namespace = {}
    exec(compile(code, "README.md", "exec"), namespace)  # noqa: S102
    state, result = namespace["state"], namespace["result"]
    assert int(state.version) == 4 and result.ack.version == 4  # 2 steps x 2 mini-batches
    assert result.record["audited_samples"] == 16 and result.record["audit_failed"] == 0
    assert (tmp_path / "runs" / "ckpt").is_dir()
    assert (tmp_path / "runs" / "policy" / "config.json").is_file()
