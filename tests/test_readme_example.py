"""The README's API example runs as written, on a tiny Qwen2 fixture directory standing in for
Qwen2.5-0.5B-Instruct (its 64-position context gets a shorter generation budget)."""
import pathlib
import re
import shutil

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_readme_api_example(tmp_path, monkeypatch):
    text = (ROOT / "README.md").read_text()
    code = re.search(r"## API in short\n\n```python\n(.*?)```", text, re.S).group(1)
    assert "max_new_tokens=256" in code
    code = code.replace("max_new_tokens=256", "max_new_tokens=8")
    shutil.copytree(ROOT / "tests" / "fixtures" / "hf" / "qwen2",
                    tmp_path / "path" / "to" / "Qwen2.5-0.5B-Instruct")
    monkeypatch.chdir(tmp_path)
    namespace = dict(questions=["2+3?", "hi"], my_reward=lambda text: float(len(text)))
    exec(compile(code, "README.md", "exec"), namespace)  # noqa: S102
    assert namespace["ack"].version == 1 and int(namespace["state"].version) == 1
    assert (tmp_path / "runs" / "ckpt").is_dir()
    assert (tmp_path / "runs" / "policy" / "config.json").is_file()
